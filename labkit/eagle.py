"""An EAGLE draft head (Li et al., 2024): autoregression over the target's features, not its tokens.

The target's feature f_t is its final normed hidden state at position t, the LM head's input. The
head reads the pair (f_t, embedding of token t + 1), the token the target actually chose there,
and predicts f_{t+1}; the target's own LM head turns the prediction into the draft's guess for
token t + 2. Drafting k tokens feeds the predicted feature back k - 1 times, so only the first
step sees a true feature: the token input tells the head which of the target's possible futures
was taken, which is what lets it predict a feature far better than a head predicting a token.

    fc:    concat(f_t, embed(token t + 1)) (2H) -> H
    layer: one Llama decoder layer of the target's shape, with its own small KV cache
    head:  the target's LM head, restricted to `vocab`, the most frequent tokens of the training
           data (FR-Spec), then BPE order: the draft's LM head is most of a draft step on a
           49,152-token vocabulary.

The embedding and LM head rows are the target's (frozen, not saved); fc and the layer are the
weights (`python -m labkit.train --only eagle` trains SmolLM2's, in labkit/assets/smollm2-eagle).
Stage 06 part 2 writes the cached draft step and the drafting loop; `forward` here is only the
teacher-forced pass that training uses, over whole sequences at once, with no cache.
"""

import copy
import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from . import ASSETS
from .model import Block, KVCache, Llama, causal_mask

REAL_EAGLE = ASSETS / "smollm2-eagle"


class EagleHead(nn.Module):
    """head(feats (B, T, H), next_ids (B, T)) -> predicted next features (B, T, H), teacher-forced.

    `vocab` (N,) int64 are the token ids the draft may propose; `lm_head` (H -> N, no bias) reads their logits
    off a feature with their rows of the target's LM head (`lm_head_weight`, (N, H)). The target is kept outside this module's state_dict (a list holds it)."""

    def __init__(self, target: Llama, vocab: torch.Tensor):
        super().__init__()
        c = target.config
        self.config = dataclasses.replace(c, num_hidden_layers=1)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size)
        self.layer = Block(self.config)
        self.register_buffer("vocab", vocab.to(torch.long), persistent=False)
        # the draft's LM head: the target's rows for `vocab`, copied once (a gather per step would cost more), frozen
        # and not saved; a Linear, so that labkit.fast_paged.accelerate runs it on the packed loops like fc and the layer
        self.lm_head = nn.Linear(c.hidden_size, len(self.vocab), bias=False)
        del self.lm_head.weight
        self.lm_head.register_buffer("weight", target.lm_head.weight[self.vocab].detach().clone(), persistent=False)
        self.target = [target]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(N, H): the draft's LM head rows (head.lm_head(x) == x @ head.lm_head_weight.T)."""
        return self.lm_head.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target[0].model.embed_tokens(ids)

    def new_cache(self, max_seq_len: int) -> KVCache:
        p = self.fc.weight
        return KVCache(self.config, 1, max_seq_len, p.dtype, p.device)

    def forward(self, feats: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """feats (B, T, H) at positions 0 .. T - 1, next_ids (B, T) the tokens after them -> (B, T, H) the predicted
        features one position on: the teacher-forced pass over whole sequences that training uses, without a
        cache. Drafting one position at a time after a cached prefix is stage 06's draft_forward (lab4 §2)."""
        T = feats.shape[1]
        x = self.fc(torch.cat([feats, self.embed(next_ids)], dim=-1))
        cos, sin = self.target[0].rope(0, T)
        return self.layer(x, cos, sin, causal_mask(0, T), None, 0)


def attach(target: Llama, vocab: torch.Tensor, seed: int = 0) -> EagleHead:
    """A fresh head on `target`, in its dtype, that starts by predicting f_{t+1} = f_t: fc copies the
    feature half of its input, and the layer's output projections (o_proj, down_proj) are zero, so the
    layer adds nothing until training makes it. Its other weights are small and random (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    head = EagleHead(target, vocab)
    H = head.config.hidden_size
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            if "norm" not in name:
                p.copy_(
                    torch.randn(p.shape, generator=gen) * 0.02 if "o_proj" not in name and "down" not in name else 0
                )
        head.fc.weight.copy_(torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1))
        head.fc.bias.zero_()
    p = target.lm_head.weight
    return head.to(dtype=p.dtype, device=p.device)


def packed(head: EagleHead, quantization: str | None = None) -> EagleHead:
    """A copy of `head` sharing every tensor, whose linear layers (fc, the layer's projections, the reduced LM
    head) run labkit.cpu_kernels' loops (labkit.fast_paged.PackedLinear): a draft step reads each weight once at
    the loop's bandwidth instead of PyTorch's at one row. `quantization` "q8_0" stores them in Q8_0, a quarter
    of the bytes: a draft step is memory-bound, and a draft's rounding can cost acceptance but never change what
    the target verifies. `head` itself where the kernels cannot build."""
    from . import cpu_kernels
    from .fast_paged import CPP_MAX_ROWS, PackedLinear, fits

    ops = cpu_kernels.ops()
    if ops is None:
        return head

    def rebuilt(module: nn.Module) -> nn.Module:
        if type(module) is nn.Linear:
            if not fits(module, quantization):
                raise ValueError(f"{module}: labkit.cpu_kernels cannot store it as {quantization}")
            return PackedLinear(module, ops, quantization, CPP_MAX_ROWS)
        if not any(type(m) is nn.Linear for m in module.modules()):
            return module
        new = copy.copy(module)  # a shallow copy: its tensors and hooks shared, its children rebuilt
        new._modules = {name: child and rebuilt(child) for name, child in module._modules.items()}
        return new

    return rebuilt(head)


def save(head: EagleHead, path: str | os.PathLike, report: dict | None = None) -> None:
    """config.json (hidden size, the reduced vocabulary, the training report) + bf16 model.safetensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"hidden_size": head.config.hidden_size, "token_ids": head.vocab.tolist(), **(report or {})}
    (path / "config.json").write_text(json.dumps(config) + "\n")
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))


def load(path: str | os.PathLike, target: Llama, vocab_size: int | None = None, full_vocab: bool = False) -> EagleHead:
    """A head saved by `save`, on `target`, in its dtype; `vocab_size` keeps only that many of its
    most frequent tokens (None: all it was trained with), `full_vocab` gives it the target's whole LM head."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if config["hidden_size"] != target.config.hidden_size:
        raise ValueError(f"{path}: a head for hidden size {config['hidden_size']}, not {target.config.hidden_size}")
    vocab = torch.arange(target.config.vocab_size) if full_vocab else torch.tensor(config["token_ids"][:vocab_size])
    head = EagleHead(target, vocab)
    state = load_file(str(path / "model.safetensors"))
    head.load_state_dict({k: v.to(target.lm_head.weight.dtype) for k, v in state.items()}, strict=True)
    return head.eval()
