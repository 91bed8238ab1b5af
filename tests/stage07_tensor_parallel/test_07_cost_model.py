"""Communication accounting and the alpha-beta model of a tensor-parallel decode step (exact math)."""

import math

import pytest

from labkit.model import Config
from labkit.specs import H100, LLAMA3_70B

TINY = Config(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32)  # fmt: skip
LINKS = {"nvlink": dict(link_bandwidth=450e9, link_latency=3e-6), "pcie": dict(link_bandwidth=64e9, link_latency=10e-6)}


@pytest.mark.parametrize("config", [TINY, LLAMA3_70B], ids=["tiny", "70b"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_comm_bytes_per_token_formula(impl, config, p, dtype_bytes):
    cost = impl("stage07_tensor_parallel.cost_model")
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    want = (
        {"all_reduce": 0, "all_gather": 0}
        if p == 1
        else {"all_reduce": (2 * L + 1) * h * dtype_bytes, "all_gather": V // p * dtype_bytes}
    )
    got = cost.comm_bytes_per_token(config, p, dtype_bytes)
    assert got == want, f"TP={p}, {dtype_bytes}-byte elements: got {got}, expected {want}"


def _matrices_per_rank(c: Config, p: int) -> tuple[int, int, int]:
    """Slow and obvious: (weight elements one rank streams per decode step, its query heads, its KV heads)."""
    q_heads = c.num_attention_heads // p
    kv_heads = c.num_key_value_heads // p if c.num_key_value_heads % p == 0 else 1
    shapes = []
    for _ in range(c.num_hidden_layers):
        shapes += [(q_heads * c.head_dim, c.hidden_size), (kv_heads * c.head_dim, c.hidden_size)]  # q, k
        shapes += [(kv_heads * c.head_dim, c.hidden_size), (c.hidden_size, q_heads * c.head_dim)]  # v, o
        shapes += [(c.intermediate_size // p, c.hidden_size)] * 2 + [(c.hidden_size, c.intermediate_size // p)]
    shapes.append((c.vocab_size // p, c.hidden_size))  # LM head
    return sum(a * b for a, b in shapes), q_heads, kv_heads


def _expected(c, p, batch, link, context, dtype_bytes):
    W, heads, kv = _matrices_per_rank(c, p)
    L = c.num_hidden_layers
    compute = (2 * batch * W + 4 * batch * context * L * heads * c.head_dim) / H100["flops"]
    memory = (W + 2 * batch * context * L * kv * c.head_dim) * dtype_bytes / H100["hbm_bandwidth"]
    comm = 0.0
    if p > 1:
        alpha, beta = link["link_latency"], link["link_bandwidth"]
        msg = batch * c.hidden_size * dtype_bytes
        ring_all_reduce = 2 * (p - 1) * (alpha + msg / p / beta)
        ring_all_gather = (p - 1) * (alpha + batch * (c.vocab_size // p) * dtype_bytes / beta)
        comm = (2 * L + 1) * ring_all_reduce + ring_all_gather
    return compute, memory, comm


@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize(
    "config, p, batch, context",
    [
        (LLAMA3_70B, 1, 1, 0),
        (LLAMA3_70B, 2, 1, 0),
        (LLAMA3_70B, 8, 1, 4096),
        (LLAMA3_70B, 4, 32, 2048),
        (LLAMA3_70B, 16, 8, 1024),
        (TINY, 4, 3, 100),
    ],  # fmt: skip
)
def test_tp_step_time_matches_the_alpha_beta_model(impl, link, config, p, batch, context):
    cost = impl("stage07_tensor_parallel.cost_model")
    got = cost.tp_step_time(config, p, batch, **LINKS[link], **H100, context=context, dtype_bytes=2)
    compute, memory, comm = _expected(config, p, batch, LINKS[link], context, 2)
    where = f"TP={p}, batch={batch}, context={context}, {link}"
    for name, g, w in (("compute", got.compute, compute), ("memory", got.memory, memory), ("comm", got.comm, comm)):
        assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-15), f"{where}: {name} {g:.6g} s, expected {w:.6g} s"
    assert math.isclose(got.total, max(compute, memory) + comm, rel_tol=1e-9), (
        f"{where}: total is max(compute, memory) + comm"
    )


def test_70b_single_gpu_decode_is_bandwidth_bound(impl):
    cost = impl("stage07_tensor_parallel.cost_model")
    t = cost.tp_step_time(LLAMA3_70B, 1, 1, **LINKS["nvlink"], **H100)
    assert t.comm == 0.0, "one GPU communicates nothing"
    # ~70e9 bf16 weights over 3.35 TB/s: about 42 ms, the course plan's "~45 ms" decode step.
    assert 0.040 < t.memory < 0.044 and t.compute < t.memory / 100, (
        f"memory {t.memory:.4f} s, compute {t.compute:.2e} s"
    )
