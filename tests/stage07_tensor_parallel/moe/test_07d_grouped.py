"""§2 of lab8.ipynb: grouped execution. Sorting pairs by expert against the obvious sort written here; the
grouped experts against transformers' own Qwen3MoeExperts on random routings (experts with no tokens, one
token, k = E) and inside the block against DeepSeek-V3's module; and its cost: one product per expert with rows, and the routed FLOPs only (counted at the
ATen level, so neither a per-token loop nor the dense form passes)."""

import pytest
import torch
from moe_helpers import DEEPSEEK_CONFIGS, QWEN3_CONFIGS, deepseek_v3_moe, qwen3_moe, slow_moe
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

MODULE = "stage07_tensor_parallel.moe.experts"
SEED = 58
PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "_grouped_mm"}


def _routing(seed: int, n: int, k: int, num_experts: int, used: int | None = None):
    """n tokens, k distinct experts each drawn from the first `used` experts, random positive weights."""
    g = torch.Generator().manual_seed(seed)
    used = used or num_experts
    idx = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(n)]) if n else torch.zeros(0, k).long()
    return idx, torch.rand(n, k, generator=g) + 0.1


@pytest.mark.parametrize("n,k,num_experts,used", [(13, 2, 6, 6), (1, 3, 8, 8), (40, 1, 10, 4), (9, 4, 4, 4)])
def test_sort_by_expert_orders_pairs_by_expert_stably(impl, n, k, num_experts, used):
    mod = impl(MODULE)
    idx, _ = _routing(SEED + n, n, k, num_experts, used)
    order, counts = mod.sort_by_expert(idx, num_experts)
    flat = idx.flatten().tolist()
    want = sorted(range(len(flat)), key=lambda p: (flat[p], p))
    want_counts = [flat.count(e) for e in range(num_experts)]
    assert counts.tolist() == want_counts, (
        f"n={n} k={k} E={num_experts} (seed={SEED + n}): counts {counts.tolist()}, expected {want_counts} "
        "(one entry per expert, zeros included: bincount with minlength)"
    )
    assert order.tolist() == want, (
        f"n={n} k={k} E={num_experts} (seed={SEED + n}): order {order.tolist()[:12]}..., expected {want[:12]}... "
        "(positions in topk_idx.flatten(), by expert, a stable sort within an expert)"
    )


@pytest.mark.parametrize("name", QWEN3_CONFIGS)
@pytest.mark.parametrize("n", [1, 29])
def test_grouped_experts_match_qwen3_moe_experts(impl, name, n):
    mod = impl(MODULE)
    hf = qwen3_moe(name, SEED + n)
    E, k = hf.experts.num_experts, hf.gate.top_k
    idx, w = _routing(SEED + n, n, k, E, used=max(k, E - 1))  # the last expert gets no token
    x = torch.randn(n, hf.experts.hidden_dim, generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        want = hf.experts(x, idx, w)
        got = mod.grouped_experts(x, idx, w, hf.experts.gate_up_proj.detach(), hf.experts.down_proj.detach())
    torch.testing.assert_close(
        got, want, atol=2e-5, rtol=1e-5,
        msg=lambda m: f"{name}, {n} tokens (seed={SEED + n}): grouped experts differ from Qwen3MoeExperts "
        "(each row's expert, its weight, summed back into its own token): " + m,
    )  # fmt: skip


@pytest.mark.parametrize("name", DEEPSEEK_CONFIGS)
def test_moe_block_with_grouped_experts_matches_deepseek_v3(impl, name):
    block_mod = impl("stage07_tensor_parallel.moe.block")
    hf = deepseek_v3_moe(name, SEED + 5)
    x = torch.randn(2, 21, hf.gate.hidden_dim, generator=torch.Generator().manual_seed(SEED + 5))
    with torch.no_grad():
        want, got = hf(x), block_mod.MoEBlock.from_hf(hf)(x)
    torch.testing.assert_close(
        got, want, atol=2e-5, rtol=1e-5,
        msg=lambda m: f"{name} (seed={SEED + 5}): the block with grouped experts differs from DeepseekV3MoE: {m}",
    )  # fmt: skip


class _Products(TorchDispatchMode):
    """Counts the matrix products the code under test launches, at the ATen level."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket.__name__ in PRODUCTS
        return func(*args, **(kwargs or {}))


@pytest.mark.in_process("counts the products the learner's code launches: a worker process would hide them")
def test_grouped_experts_one_product_per_expert_and_routed_flops_only(impl):
    mod = impl(MODULE)
    g = torch.Generator().manual_seed(SEED)
    E, k, D, I, n = 6, 2, 24, 16, 48
    gate_up, down = torch.randn(E, 2 * I, D, generator=g) * 0.3, torch.randn(E, D, I, generator=g) * 0.3
    idx, w = _routing(SEED, n, k, E, used=E - 1)
    x = torch.randn(n, D, generator=g)
    products, flops = _Products(), FlopCounterMode(display=False)
    with torch.no_grad(), flops, products:
        got = mod.grouped_experts(x, idx, w, gate_up, down)
    torch.testing.assert_close(got, slow_moe(x, idx, w, gate_up, down), atol=2e-5, rtol=1e-5)
    routed = n * k * 2 * (2 * I * D + I * D)  # each pair: (2I x D) then (D x I), 2 FLOPs a multiply-add
    active = E - 1
    assert flops.get_total_flops() <= 1.01 * routed, (
        f"grouped_experts spent {flops.get_total_flops()} FLOPs in matrix products, "
        f"{flops.get_total_flops() / routed:.2f}x the routed pairs' {routed} (seed={SEED}): an expert computed on "
        "tokens that did not choose it (the dense form, or padding every expert to the largest)"
    )
    assert products.calls <= 3 * active, (
        f"grouped_experts launched {products.calls} matrix products for {n * k} pairs over {active} experts "
        f"(seed={SEED}): at most 3 per expert with rows (gate/up and down); a loop over tokens launches one per pair"
    )
