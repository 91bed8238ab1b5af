"""Ring attention (lab7.ipynb §3–§4) on real processes (gloo, 2 and 3 ranks). Each rank's attention equals
attention over the whole prompt, the model's logits equal Hugging Face's at every position, each rank keeps
1/p of the KV, the bytes on the wire are the hand count, and a rank that dies is an error on its neighbours.
One process group per world size runs every check. References: PyTorch's scaled_dot_product_attention over all
the keys and HF LlamaForCausalLM (both computed here, in the pytest process), the bytes counted by wrapping
torch.distributed in the workers."""

import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.distributed import launch
from labkit.model import Config, Llama
from labkit.testing import LLAMA_CONFIGS, random_llama, random_tokens

pytestmark = pytest.mark.dist
SEED = 5
SCHEMES = ("contiguous", "zigzag")
ATTN_T = 23  # divisible by neither 2, 3, 4 nor 6
MODELS = {  # prompts of 19 and 26 tokens
    "gqa2-theta": (dict(LLAMA_CONFIGS["gqa2-tied"], rope_parameters={"rope_type": "default", "rope_theta": 3e4}), 19),
    "mqa-odd": (LLAMA_CONFIGS["mqa-odd"], 26),
}


def ring_checks(q, k, v, cases):
    """Worker: ring attention on this rank's positions, then the context-parallel prefill of each model."""
    from labkit.impl import load

    ring, cp = load("stage07_tensor_parallel.context.ring"), load("stage07_tensor_parallel.context.cp_model")
    rank, p = dist.get_rank(), dist.get_world_size()
    sent = {"calls": 0, "bytes": 0}
    for name in ("all_gather", "all_gather_into_tensor", "broadcast", "all_reduce", "all_to_all"):
        setattr(dist, name, lambda *a, _n=name, **k: (_ for _ in ()).throw(AssertionError(f"{_n} gathers the KV")))
    isend = dist.isend

    def counted(tensor, *args, **kwargs):
        sent["calls"] += 1
        sent["bytes"] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    dist.isend = counted
    out = {}
    for scheme in SCHEMES:
        try:
            pos = ring.split_positions(q.shape[2], p, scheme)[rank]
            o = ring.ring_attention(
                q[:, :, pos], k[:, :, pos], v[:, :, pos], ring.split_positions(q.shape[2], p, scheme)
            )
            out[f"attn/{scheme}"] = {"positions": pos, "o": o}
        except Exception:
            out[f"attn/{scheme}"] = {"error": traceback.format_exc()}
    for name, (config, state, ids) in cases.items():
        for scheme in SCHEMES:
            try:
                model = Llama(config).eval()
                model.load_state_dict(state, strict=False)
                sent.update(calls=0, bytes=0)
                res = cp.cp_prefill(model, ids, scheme, timeout_s=30)
                res["sent"] = dict(sent)
                out[f"{name}/{scheme}"] = res
            except Exception:
                out[f"{name}/{scheme}"] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def references():
    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, h, ATTN_T, 16, generator=g) for h in (6, 2, 2))
    attn = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    cases, expected = {}, {"attn": attn}
    for i, (name, (overrides, T)) in enumerate(MODELS.items()):
        hf = random_llama(SEED + i, **overrides)
        ids = random_tokens(SEED + i, T, hf.config.vocab_size - 3) + 3
        with torch.no_grad():
            expected[name] = hf(ids[None]).logits[0]
        config = Config.from_hf(hf.config.to_dict())
        cases[name] = (config, {k: t.clone() for k, t in hf.state_dict().items()}, ids)
    return (q, k, v, cases), expected


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"cp{p}")
def group(request, references):
    args, expected = references
    try:
        results = launch(ring_checks, request.param, *args, timeout=150)
    except Exception as e:  # RankFailed, TimeoutError
        results = e
    return request.param, results, expected, args[3]


def _per_rank(group, key):
    p, results, _, _ = group
    if isinstance(results, Exception):
        pytest.fail(f"the CP={p} process group failed before reporting (seed={SEED}):\n{results}")
    for rank, r in enumerate(results):
        if "error" in r[key]:
            pytest.fail(f"CP={p}: check {key!r} raised on rank {rank} (seed={SEED}):\n{r[key]['error']}")
    return [r[key] for r in results]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_ring_attention_equals_attention_over_the_whole_prompt(impl, group, scheme):
    p, _, expected, _ = group
    for rank, r in enumerate(_per_rank(group, f"attn/{scheme}")):
        want = expected["attn"][:, :, r["positions"]]
        assert r["o"].shape == want.shape, (
            f"CP={p} rank {rank}: output {tuple(r['o'].shape)}, expected {tuple(want.shape)}"
        )
        delta = (r["o"] - want).abs().max().item()
        assert delta < 1e-5, (
            f"CP={p} rank {rank}, {scheme} split of {ATTN_T} positions (seed={SEED}): differs from causal SDPA over "
            f"the whole prompt by {delta:.2e}; does every query see every earlier key, each block once?"
        )


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", MODELS)
def test_cp_prefill_logits_equal_hf_everywhere(impl, group, name, scheme):
    p, _, expected, _ = group
    per_rank = _per_rank(group, f"{name}/{scheme}")
    T = expected[name].shape[0]
    seen = torch.cat([r["positions"] for r in per_rank]).sort().values
    assert torch.equal(seen, torch.arange(T)), f"CP={p}: the ranks hold positions {seen.tolist()}, not 0 .. {T - 1}"
    for rank, r in enumerate(per_rank):
        delta = (r["logits"] - expected[name][r["positions"]]).abs().max().item()
        assert delta < 1e-4, (
            f"CP={p} rank {rank}, {name}, {scheme}, T={T} (seed={SEED}): logits differ from HF by {delta:.2e}"
        )


@pytest.mark.parametrize("name", MODELS)
def test_each_rank_keeps_its_share_of_the_kv(impl, group, name):
    p, _, expected, cases = group
    c, T = cases[name][0], expected[name].shape[0]
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    for scheme in SCHEMES:
        for rank, r in enumerate(_per_rank(group, f"{name}/{scheme}")):
            want = len(r["positions"]) * per_token
            assert r["kv_bytes"] == want, (
                f"CP={p} rank {rank}, {scheme}: holds {r['kv_bytes']} B of KV, its share is {want} B"
            )
            assert len(r["positions"]) <= -(-T // p) + (scheme == "zigzag"), f"CP={p}: rank {rank} holds more than 1/p"


@pytest.mark.parametrize("name", MODELS)
def test_ring_traffic_matches_the_hand_count(impl, group, name):
    """Rank r forwards every block but the one that reaches it last, from rank r + 1, in every layer."""
    p, _, expected, cases = group
    c, T = cases[name][0], expected[name].shape[0]
    for scheme in SCHEMES:
        per_rank = _per_rank(group, f"{name}/{scheme}")
        sizes = [len(r["positions"]) for r in per_rank]
        for rank, r in enumerate(per_rank):
            want = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4 * (T - sizes[(rank + 1) % p])
            assert r["sent"]["bytes"] == want, (
                f"CP={p} rank {rank}, {scheme}: sent {r['sent']['bytes']} B in {r['sent']['calls']} sends; the hand "
                f"count is {want} B (K and V of every block but rank {(rank + 1) % p}'s, in each of {c.num_hidden_layers} layers)"
            )


@pytest.mark.parametrize("T,p", [(40, 1), (23, 2), (23, 3), (64, 4), (101, 3)])
def test_ring_bytes_per_rank_is_the_hand_count(impl, T, p):
    """Rank r forwards every block but rank r + 1's (the last to reach it): K and V, in every layer."""
    config = Config(**dict(LLAMA_CONFIGS["mqa-odd"], head_dim=16, num_hidden_layers=3))
    ring = impl("stage07_tensor_parallel.context.ring")
    for scheme in SCHEMES if T >= 2 * p else ("contiguous",):
        sizes = [T // n + (i < T % n) for n in [p if scheme == "contiguous" else 2 * p] for i in range(n)]
        if scheme == "zigzag":
            sizes = [sizes[r] + sizes[2 * p - 1 - r] for r in range(p)]
        for rank in range(p):
            want = 3 * 2 * 1 * 16 * 4 * (T - sizes[(rank + 1) % p]) if p > 1 else 0
            got = ring.ring_bytes_per_rank(config, T, p, rank, scheme)
            assert got == want, f"T={T}, p={p}, rank {rank}, {scheme}: {got} B, the hand count is {want} B"


def ring_with_a_dead_rank(T):
    """Worker: rank 1 leaves before the ring starts (its sockets closed); the others must get PeerLost."""
    from labkit.impl import load

    ring = load("stage07_tensor_parallel.context.ring")
    rank, p = dist.get_rank(), dist.get_world_size()
    positions = ring.split_positions(T, p, "contiguous")
    if rank == 1:
        dist.destroy_process_group()
        return ("victim", "", 0.0)
    mine = len(positions[rank])
    x = torch.randn(1, 2, mine, 8)
    t0 = time.monotonic()
    try:
        ring.ring_attention(x, x, x, positions, timeout_s=3)
        return ("finished", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


def test_a_dead_rank_in_the_ring_is_an_error_not_a_hang(impl):
    per_rank = launch(ring_with_a_dead_rank, 3, 10, timeout=60)
    for rank in (0, 2):
        kind, message, seconds = per_rank[rank]
        assert kind == "PeerLost", (
            f"CP=3, rank 1 dead: rank {rank} ended with {kind} {message[:300]!r} after {seconds:.1f} s; it should raise "
            "labkit.distributed.PeerLost (every transfer through labkit.distributed with the timeout)"
        )
