"""Medusa heads (Cai et al., 2024): K extra next-next-token predictors on a frozen target's last hidden state.

Head k (k = 1..K) reads the final (normed) hidden state h_t at position t and guesses the token at
t + k + 1; the target's own lm_head already gives t + 1. Each head is one residual block, as in the
paper's Medusa-1:  logits_k = lm_head(h_t + SiLU(W_k h_t + b_k)), with the target's lm_head shared by
every head (not trained) and W_k, b_k zero at the start, so an untrained head repeats the lm_head's guess.

The tiny target's heads are trained by `python -m labkit.train --only medusa` and ship in
labkit/assets/tiny-target-medusa (config.json + bf16 model.safetensors). Stage 06 part 2 builds a
candidate tree from their top-k guesses and verifies it in one target forward.
"""

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint
from .model import Llama


class ResBlock(nn.Module):
    """h + SiLU(W h + b): the identity at initialisation (W = 0, b = 0)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """heads(hidden (..., D)) -> logits (..., K, V): head k's guess for the token k + 1 places after
    the next one. `lm_head` is the target's own (shared, frozen); only the residual blocks are weights."""

    def __init__(self, num_heads: int, lm_head: nn.Linear):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(lm_head.in_features) for _ in range(num_heads))
        self.lm_head = [lm_head]  # a list keeps the target's weight out of this module's state_dict

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.lm_head[0]
        return torch.stack([lm_head(block(hidden)) for block in self.blocks], dim=-2)


def attach(target: Llama, num_heads: int) -> MedusaHeads:
    """Fresh (identity) heads on `target`'s lm_head, in the target's dtype."""
    p = target.lm_head.weight
    return MedusaHeads(num_heads, target.lm_head).to(dtype=p.dtype, device=p.device)


def save(heads: MedusaHeads, path: str | os.PathLike, report: dict | None = None) -> None:
    """config.json (num_heads, hidden_size, and the training report) + bf16 model.safetensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"num_heads": heads.num_heads, "hidden_size": heads.lm_head[0].in_features, **(report or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))


def load(path: str | os.PathLike, target: Llama) -> MedusaHeads:
    """Heads saved by `save`, attached to `target` (whose hidden size they must have), in its dtype."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a folder written by labkit.medusa.save")
    config = json.loads((path / "config.json").read_text())
    if config["hidden_size"] != target.config.hidden_size:
        raise checkpoint.CheckpointError(
            f"{path}: heads of hidden_size {config['hidden_size']} cannot read a target of hidden_size "
            f"{target.config.hidden_size}; train heads for this target with labkit.train --only medusa"
        )
    heads = attach(target, config["num_heads"])
    state = load_file(str(path / "model.safetensors"))
    heads.load_state_dict({k: v.to(target.lm_head.weight.dtype) for k, v in state.items()}, strict=True)
    return heads.eval()
