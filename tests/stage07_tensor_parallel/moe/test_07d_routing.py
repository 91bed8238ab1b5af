"""§1 of lab8.ipynb: routing and the MoE block against transformers' own Qwen3-MoE and DeepSeek-V3 modules,
built from their Config classes with random weights over configs that vary expert counts, k, sizes,
norm_topk_prob, groups, the shared experts and the routed scaling factor. The block runs the given per-token
loop here; §2's tests run it with the grouped experts."""

import pytest
import torch
from moe_helpers import DEEPSEEK_CONFIGS, QWEN3_CONFIGS, deepseek_v3_moe, dense_weights, qwen3_moe

SEED = 58


def _tokens(seed: int, hidden: int, n: int = 37) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", QWEN3_CONFIGS)
def test_softmax_topk_matches_qwen3_moe_router(impl, name):
    routing = impl("stage07_tensor_parallel.moe.routing")
    hf = qwen3_moe(name, SEED)
    x = _tokens(SEED, hf.gate.hidden_dim)
    with torch.no_grad():
        logits, want_w, want_i = hf.gate(x)
    got_w, got_i = routing.softmax_topk(logits, hf.gate.top_k, hf.gate.norm_topk_prob)
    E = hf.gate.num_experts
    assert got_i.shape == want_i.shape, f"{name}: indices {tuple(got_i.shape)}, expected {tuple(want_i.shape)}"
    chosen = dense_weights(torch.ones_like(got_w), got_i, E) != dense_weights(torch.ones_like(want_w), want_i, E)
    assert not chosen.any(), (
        f"{name} (seed={SEED}): {int(chosen.any(1).sum())} of {len(x)} tokens chose other experts than "
        "Qwen3-MoE (top-k of the softmax over all experts)"
    )
    torch.testing.assert_close(
        dense_weights(got_w, got_i, E), dense_weights(want_w, want_i, E), atol=1e-6, rtol=1e-5,
        msg=lambda m: f"{name} (seed={SEED}): routing weights differ from Qwen3-MoE's (softmax over all E, in "
        f"float32, renormalised only when norm_topk_prob={hf.gate.norm_topk_prob}): {m}",
    )  # fmt: skip


@pytest.mark.parametrize("name", DEEPSEEK_CONFIGS)
def test_group_limited_topk_matches_deepseek_v3_router(impl, name):
    routing = impl("stage07_tensor_parallel.moe.routing")
    hf = deepseek_v3_moe(name, SEED)
    gate = hf.gate
    x = _tokens(SEED + 1, gate.hidden_dim)
    with torch.no_grad():
        logits, want_w, want_i = gate(x)
    got_w, got_i = routing.group_limited_topk(
        logits, gate.top_k, gate.num_group, gate.topk_group, gate.e_score_correction_bias.clone(),
        gate.norm_topk_prob, gate.routed_scaling_factor,
    )  # fmt: skip
    E = gate.num_experts
    chosen = dense_weights(torch.ones_like(got_w), got_i, E) != dense_weights(torch.ones_like(want_w), want_i, E)
    assert not chosen.any(), (
        f"{name} (seed={SEED}): {int(chosen.any(1).sum())} of {len(x)} tokens chose other experts than DeepSeek-V3 "
        "(sigmoid scores plus the correction bias; groups ranked by their two best; top-k within the best groups)"
    )
    torch.testing.assert_close(
        dense_weights(got_w, got_i, E), dense_weights(want_w, want_i, E), atol=1e-6, rtol=1e-5,
        msg=lambda m: f"{name} (seed={SEED}): weights differ from DeepSeek-V3's (unbiased sigmoid scores, "
        f"renormalised={gate.norm_topk_prob}, times routed_scaling_factor={gate.routed_scaling_factor}): {m}",
    )  # fmt: skip


@pytest.mark.parametrize("name", QWEN3_CONFIGS)
def test_moe_block_matches_qwen3_moe(impl, name):
    block_mod = impl("stage07_tensor_parallel.moe.block")
    hf = qwen3_moe(name, SEED + 2)
    x = torch.randn(3, 11, hf.gate.hidden_dim, generator=torch.Generator().manual_seed(SEED + 2))
    with torch.no_grad():
        want = hf(x)
        got = block_mod.MoEBlock.from_hf(hf)(x, experts=block_mod.loop_experts)  # §2's grouped form comes next
    torch.testing.assert_close(
        got, want, atol=2e-5, rtol=1e-5,
        msg=lambda m: f"{name} (seed={SEED + 2}): the MoE block differs from transformers' Qwen3MoeSparseMoeBlock: {m}",
    )  # fmt: skip


@pytest.mark.parametrize("name", DEEPSEEK_CONFIGS)
def test_moe_block_matches_deepseek_v3(impl, name):
    block_mod = impl("stage07_tensor_parallel.moe.block")
    hf = deepseek_v3_moe(name, SEED + 3)
    x = torch.randn(2, 13, hf.gate.hidden_dim, generator=torch.Generator().manual_seed(SEED + 3))
    with torch.no_grad():
        want = hf(x)
        got = block_mod.MoEBlock.from_hf(hf)(x, experts=block_mod.loop_experts)  # §2's grouped form comes next
    torch.testing.assert_close(
        got, want, atol=2e-5, rtol=1e-5,
        msg=lambda m: f"{name} (seed={SEED + 3}): the MoE block differs from transformers' DeepseekV3MoE "
        f"(shared experts {hf.config.n_shared_experts}): {m}",
    )  # fmt: skip
