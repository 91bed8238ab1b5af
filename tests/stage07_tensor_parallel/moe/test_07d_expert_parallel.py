"""§3 of lab8.ipynb: expert parallelism over gloo. The capacity rule against the obvious GShard loop written
here; then process groups of 2, 3 and 4 ranks (one per world size runs every case; starting processes costs
seconds): each rank's tokens through the expert-parallel block equal transformers' module on them with no
drops, equal the obvious sum without the dropped pairs at a capacity factor below 1, and report exactly the
pairs dropped. The collectives are counted inside the workers: all-to-all only, each kept row sent there and back once."""

import math
import traceback

import pytest
import torch
import torch.distributed as dist
from moe_helpers import block_args, deepseek_v3_moe, gshard_keep, qwen3_moe, slow_moe

from labkit.distributed import RankFailed, launch

SEED = 58
MODULE = "stage07_tensor_parallel.moe.expert_parallel"
# (reference module, capacity factor or None); E = 8, 6 (uneven over 4 ranks) and 8 with groups and a shared expert
CASES = {
    "qwen3-E8-k3": ("qwen3", "E8-k3", None),
    "qwen3-E6-k2": ("qwen3", "E6-k2-norm", None),
    "deepseek-E8-k2-shared": ("deepseek", "E8-k2-g4of2-shared1", None),
    "qwen3-E8-k3-cf0.5": ("qwen3", "E8-k3", 0.5),
    "deepseek-E8-k2-cf0.75": ("deepseek", "E8-k2-g4of2-shared1", 0.75),
}
COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
               "broadcast", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "gather", "scatter")  # fmt: skip


@pytest.mark.parametrize("n,k,num_experts,capacity", [(12, 2, 4, 3), (7, 3, 6, 1), (20, 1, 5, 4), (9, 2, 8, 100)])
def test_capacity_keep_follows_gshard_priority(impl, n, k, num_experts, capacity):
    mod = impl(MODULE)
    g = torch.Generator().manual_seed(SEED + n)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)])
    got, want = mod.capacity_keep(idx, num_experts, capacity), gshard_keep(idx, num_experts, capacity)
    assert got.dtype == torch.bool and got.shape == idx.shape, (
        f"keep {got.dtype} {tuple(got.shape)}, expected bool (N, k)"
    )
    assert torch.equal(got, want), (
        f"n={n} k={k} E={num_experts} capacity={capacity} (seed={SEED + n}): kept {int(got.sum())} pairs, expected "
        f"{int(want.sum())}, {int((got != want).sum())} differ: first choices of every token come before any "
        "second choice, earlier tokens first, and an expert keeps its first `capacity` pairs"
    )


# ---------------------------------------------------------------- runs inside each rank


class _Counter:
    """Wraps torch.distributed's collectives: calls and bytes of the tensors each rank sends."""

    def __init__(self):
        self.calls, self.bytes = {}, 0
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            sent = args[1] if len(args) > 1 else kwargs.get("input")
            if isinstance(sent, torch.Tensor):
                self.bytes += sent.numel() * sent.element_size()
            return fn(*args, **kwargs)

        return counted


def check_everything(cases):
    """Worker: every case on this rank -> {case: {"y", "dropped", "calls", "bytes"} or {"error"}}."""
    from labkit.distributed import report
    from labkit.impl import load

    ep, block_mod = load(MODULE), load("stage07_tensor_parallel.moe.block")
    rank, world = dist.get_rank(), dist.get_world_size()
    counter, out = _Counter(), {}
    for name, (args, state, xs, cf) in cases.items():
        report(name)
        try:
            block = block_mod.MoEBlock(**args)
            block.load_state_dict(state)
            shard = ep.ExpertShard.of(block, rank, world)
            counter.calls, counter.bytes = {}, 0
            y, dropped = ep.ep_forward(shard, xs[rank], cf)
            out[name] = {"y": y, "dropped": dropped, "calls": dict(counter.calls), "bytes": counter.bytes}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


# ---------------------------------------------------------------- the pytest side


@pytest.fixture(scope="module")
def cases(impl):
    """The workers get plain tensors (no transformers module: importing transformers costs seconds a process)."""
    block_mod = impl("stage07_tensor_parallel.moe.block")
    built, expected = {}, {}
    for i, (name, (family, config, cf)) in enumerate(CASES.items()):
        hf = (qwen3_moe if family == "qwen3" else deepseek_v3_moe)(config, SEED + i)
        g = torch.Generator().manual_seed(SEED + i)
        xs = [torch.randn(9 + r, hf.gate.hidden_dim, generator=g) for r in range(4)]  # ranks hold different counts
        built[name] = (block_args(hf), block_mod.MoEBlock.from_hf(hf).state_dict(), xs, cf)
        expected[name] = [_reference(hf, x, cf) for x in xs]
    return built, expected


@torch.no_grad()
def _reference(hf, x, cf):
    """(y, dropped pairs) for one rank's tokens: transformers' module, or without drops the obvious sum."""
    if cf is None:
        return hf(x[None])[0], 0
    _, weights, idx = hf.gate(x)
    E, k = hf.experts.num_experts, idx.shape[1]
    keep = gshard_keep(idx, E, math.ceil(cf * len(x) * k / E))
    y = slow_moe(x, idx, weights * keep, hf.experts.gate_up_proj, hf.experts.down_proj)
    if getattr(hf, "shared_experts", None) is not None:
        y = y + hf.shared_experts(x)
    return y, int((~keep).sum())


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"ep{p}")
def group(request, cases):
    built, expected = cases
    try:
        results = launch(check_everything, request.param, built, timeout=120)
    except (RankFailed, TimeoutError) as e:
        results = e
    return request.param, results, expected, built


def _per_rank(group, name):
    world, results, _, _ = group
    if isinstance(results, Exception):
        pytest.fail(f"the EP={world} process group failed before reporting (seed={SEED}):\n{results}")
    for rank, res in enumerate(results):
        if "error" in res[name]:
            pytest.fail(f"EP={world}: case {name!r} raised on rank {rank} (seed={SEED}):\n{res[name]['error']}")
    return [res[name] for res in results]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is None])
def test_expert_parallel_equals_hf_block_without_drops(group, name):
    world, _, expected, _ = group
    for rank, res in enumerate(_per_rank(group, name)):
        want, _ = expected[name][rank]
        torch.testing.assert_close(
            res["y"], want, atol=2e-5, rtol=1e-5,
            msg=lambda m, rank=rank: f"EP={world} rank {rank}, {name} (seed={SEED}): differs from transformers' "
            f"block on this rank's tokens (rows sent to the wrong expert or summed into the wrong token?): {m}",
        )  # fmt: skip
        assert res["dropped"] == 0, f"EP={world} rank {rank}, {name}: reported {res['dropped']} drops with no capacity"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is not None])
def test_expert_parallel_drops_exactly_the_pairs_past_capacity(group, name):
    world, _, expected, _ = group
    for rank, res in enumerate(_per_rank(group, name)):
        want, want_dropped = expected[name][rank]
        assert res["dropped"] == want_dropped, (
            f"EP={world} rank {rank}, {name} (seed={SEED}): reported {res['dropped']} dropped pairs, expected "
            f"{want_dropped} (capacity ceil(cf·N·k/E) per expert, GShard priority)"
        )
        torch.testing.assert_close(
            res["y"], want, atol=2e-5, rtol=1e-5,
            msg=lambda m, rank=rank: f"EP={world} rank {rank}, {name} (seed={SEED}): differs from the obvious sum "
            f"without the dropped pairs: {m}",
        )  # fmt: skip


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_sends_each_kept_row_once_by_all_to_all(group, name):
    world, _, expected, built = group
    args, _, xs, _ = built[name]
    D, k = args["hidden_size"], args["k"]
    per_rank = _per_rank(group, name)
    for rank, res in enumerate(per_rank):
        others = {c: n for c, n in res["calls"].items() if c not in ("all_to_all_single", "all_to_all")}
        assert not others, f"EP={world} rank {rank}, {name}: made {others}; dispatch and combine need all-to-all only"
    kept = sum(len(xs[r]) * k - expected[name][r][1] for r in range(world))
    sent = sum(res["bytes"] for res in per_rank)
    # every kept row out and its answer back (D floats each), an expert id a row, a count per pair of ranks
    bound = kept * (2 * D * 4 + 8) + 2 * world * world * 8
    assert sent <= bound, (
        f"EP={world}, {name} (seed={SEED}): the ranks sent {sent} bytes for {kept} kept pairs of {D} floats, over "
        f"the {bound} that each kept row there and back once costs (dropped rows sent, or rows sent everywhere?)"
    )
