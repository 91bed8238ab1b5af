"""Transformers' own MoE modules, built from their real Config classes with random weights: the references
of lab8's tests. Each config varies what real checkpoints vary (expert counts, k, hidden and expert sizes,
norm_topk_prob; for DeepSeek-V3 also n_group/topk_group, the shared experts and routed_scaling_factor)."""

import torch

# (num_experts, k, hidden, moe_intermediate, norm_topk_prob); k = E is every expert on every token
QWEN3_CONFIGS = {
    "E4-k1": (4, 1, 16, 8, False),
    "E6-k2-norm": (6, 2, 24, 10, True),
    "E8-k3": (8, 3, 20, 12, False),
    "E5-k5-norm": (5, 5, 12, 6, True),
    "E16-k4-norm": (16, 4, 32, 8, True),
}
# (num_experts, k, n_group, topk_group, n_shared_experts, norm_topk_prob, routed_scaling_factor, hidden, moe_intermediate)
DEEPSEEK_CONFIGS = {
    "E8-k2-g4of2-shared1": (8, 2, 4, 2, 1, True, 2.5, 24, 10),
    "E8-k3-g2of1-noshared": (8, 3, 2, 1, 0, False, 1.0, 16, 8),
    "E16-k4-g4of3-shared2": (16, 4, 4, 3, 2, True, 1.5, 32, 6),
    "E6-k2-g1of1-shared1": (6, 2, 1, 1, 1, True, 2.5, 20, 12),
    "E12-k6-g3of2-noshared": (12, 6, 3, 2, 0, True, 0.7, 16, 10),
}


@torch.no_grad()
def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Standalone HF expert tensors start uninitialised and routers at zero: every weight drawn from a seed.
    The correction bias is drawn too, so it moves choices (its lesson) without setting the weights."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for b in module.buffers():
        b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return module.eval()


def qwen3_moe(name: str, seed: int) -> torch.nn.Module:
    # imported here: the expert-parallel workers import this file, and transformers costs seconds a process
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    E, k, D, I, norm = QWEN3_CONFIGS[name]
    c = Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm
    )
    c._experts_implementation = "eager"  # the standalone module has no model to pick it
    block = Qwen3MoeSparseMoeBlock(c)
    block.config = c  # DeepseekV3MoE keeps its config; this block does not, and block_args reads it
    return _randomize(block, seed)


def deepseek_v3_moe(name: str, seed: int) -> torch.nn.Module:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    E, k, n_group, topk_group, shared, norm, scale, D, I = DEEPSEEK_CONFIGS[name]
    c = DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
        topk_group=topk_group, n_shared_experts=shared, norm_topk_prob=norm, routed_scaling_factor=scale,
    )  # fmt: skip
    c._experts_implementation = "eager"
    return _randomize(DeepseekV3MoE(c), seed)


def dense_weights(weights: torch.Tensor, idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(N, k) choices -> (N, E) with each chosen expert's weight and 0 elsewhere: order-free comparison."""
    return torch.zeros(idx.shape[0], num_experts, dtype=torch.float32).scatter_(1, idx, weights.float())


def slow_moe(x, idx, weights, gate_up, down) -> torch.Tensor:
    """The obvious per-(token, choice) sum, written here: out[t] = Σ_j w[t, j] · SwiGLU_e(x[t])."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out.float()


def gshard_keep(idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The capacity rule written out: first choices of all tokens, then second choices, ..., earlier
    tokens first; an expert accepts its first `capacity` pairs."""
    used = [0] * num_experts
    keep = torch.zeros(idx.shape, dtype=torch.bool)
    for j in range(idx.shape[1]):
        for t in range(idx.shape[0]):
            e = int(idx[t, j])
            if used[e] < capacity:
                keep[t, j], used[e] = True, used[e] + 1
    return keep


def block_args(hf) -> dict:
    """MoEBlock's constructor arguments for a transformers module, read from its config (not from the code under test)."""
    c = hf.config
    if hasattr(hf, "shared_experts"):
        return dict(
            hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size, num_experts=c.n_routed_experts,
            k=c.num_experts_per_tok, routing="group_limited", norm_topk_prob=c.norm_topk_prob, n_group=c.n_group,
            topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
            shared_intermediate_size=c.moe_intermediate_size * c.n_shared_experts,
        )  # fmt: skip
    return dict(
        hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size, num_experts=c.num_experts,
        k=c.num_experts_per_tok, routing="softmax", norm_topk_prob=c.norm_topk_prob,
    )  # fmt: skip
