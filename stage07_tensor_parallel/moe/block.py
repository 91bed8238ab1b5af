"""The MoE block around the learner's routing and grouped experts, and the two forms grouped execution
replaces (given code, lab8.ipynb §1-2).

    block = MoEBlock.from_hf(hf_module)        # a Qwen3MoeSparseMoeBlock or a DeepseekV3MoE, weights copied
    y = block(x)                               # x (B, T, D) -> (B, T, D), equal to hf_module(x)
    y = block(x, experts=loop_experts)         # the per-token loop, or dense_experts: the same sum

Weights keep transformers' layout: router (E, D), gate_up (E, 2I, D), down (E, D, I). DeepSeek-V3's
shared expert is a plain SwiGLU MLP every token goes through, beside the routed ones.
"""

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model import MLP, Config

from .experts import grouped_experts
from .routing import group_limited_topk, softmax_topk


class MoEBlock(nn.Module):
    """routing="softmax" (Mixtral, Qwen3-MoE) or "group_limited" (DeepSeek-V3); shared_intermediate_size 0
    for no shared expert."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        k: int,
        routing: str = "softmax",
        norm_topk_prob: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_intermediate_size: int = 0,
    ):
        super().__init__()
        if routing not in ("softmax", "group_limited"):
            raise ValueError(f"routing must be 'softmax' or 'group_limited', not {routing!r}")
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into n_group={n_group} equal groups")
        self.k, self.routing, self.norm_topk_prob = k, routing, norm_topk_prob
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        E, D, I = num_experts, hidden_size, moe_intermediate_size
        self.router = nn.Parameter(torch.zeros(E, D))
        self.gate_up = nn.Parameter(torch.zeros(E, 2 * I, D))
        self.down = nn.Parameter(torch.zeros(E, D, I))
        self.register_buffer("correction_bias", torch.zeros(E))
        self.shared = None
        if shared_intermediate_size:
            self.shared = MLP(Config(hidden_size=D, intermediate_size=shared_intermediate_size))

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) -> weights (N, k) float32, indices (N, k) int64."""
        logits = x.float() @ self.router.float().T
        if self.routing == "softmax":
            return softmax_topk(logits, self.k, self.norm_topk_prob)
        return group_limited_topk(
            logits, self.k, self.n_group, self.topk_group, self.correction_bias,
            self.norm_topk_prob, self.routed_scaling_factor,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, experts=None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.route(x)
        y = (experts or grouped_experts)(x, idx, weights.to(x.dtype), self.gate_up, self.down)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)

    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf: nn.Module) -> "MoEBlock":
        """A Qwen3MoeSparseMoeBlock or a DeepseekV3MoE (transformers), weights copied."""
        gate, experts = hf.gate, hf.experts
        E, twoI, D = experts.gate_up_proj.shape
        deepseek = hasattr(gate, "e_score_correction_bias")
        shared = getattr(hf, "shared_experts", None)
        block = cls(
            D, twoI // 2, E, gate.top_k, "group_limited" if deepseek else "softmax", gate.norm_topk_prob,
            getattr(gate, "num_group", 1), getattr(gate, "topk_group", 1),
            getattr(gate, "routed_scaling_factor", 1.0), shared.gate_proj.out_features if shared else 0,
        )  # fmt: skip
        block.router.copy_(gate.weight)
        block.gate_up.copy_(experts.gate_up_proj)
        block.down.copy_(experts.down_proj)
        if deepseek:
            block.correction_bias.copy_(gate.e_score_correction_bias)
        if block.shared is not None:
            block.shared.load_state_dict(shared.state_dict())
        return block


def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU: x (..., D), gate_up (2I, D), down (D, I) -> (..., D)."""
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def loop_experts(x, topk_idx, topk_weights, gate_up, down) -> torch.Tensor:
    """The per-token loop: N·k matrix-vector products, each reading a whole expert's weights."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(topk_idx[t].tolist(), topk_weights[t], strict=True):
            out[t] += w * expert(x[t], gate_up[e], down[e])
    return out


def dense_experts(x, topk_idx, topk_weights, gate_up, down) -> torch.Tensor:
    """Every expert on every token (E/k times the routed FLOPs), the unchosen ones weighted 0."""
    gate, up = torch.einsum("nd,efd->enf", x, gate_up).chunk(2, dim=-1)  # (E, N, I) each
    y = torch.einsum("eni,edi->end", F.silu(gate) * up, down)  # (E, N, D)
    dense_weights = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype).scatter_(1, topk_idx, topk_weights)
    return torch.einsum("end,ne->nd", y, dense_weights)
