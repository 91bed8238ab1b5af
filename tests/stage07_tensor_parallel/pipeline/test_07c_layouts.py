"""§6 of lab6.ipynb: the cost model of part 1 extended to tp x pp layouts. References: the step written out
term by term in the test (exact arithmetic on labkit.specs' Llama-3-70B and H100 figures), and the properties
any such model must have (one GPU pays no communication, pipeline stages divide the memory, the bubble)."""

import pytest

from labkit.model import num_params
from labkit.specs import H100, LLAMA3_8B, LLAMA3_70B

LAYOUTS = "stage07_tensor_parallel.pipeline.layouts"
TP_LINK = dict(link_bandwidth=300e9, link_latency=2e-6)
PP_LINK = dict(link_bandwidth=40e9, link_latency=7e-6)


def by_hand(c, tp, pp, batch, m, context, dtype_bytes):
    """The decode step of the docstring, one term at a time."""
    b, layers = batch / m, c.num_hidden_layers / pp
    w = num_params(c) / tp / pp
    kv = 2 * max(c.num_key_value_heads / tp, 1) * c.head_dim  # per token per layer, on one GPU
    flop = 2 * b * w + layers * b * context * (c.num_attention_heads / tp) * c.head_dim * 2 * 2
    read = (w + b * context * layers * kv) * dtype_bytes
    msg = b * c.hidden_size * dtype_bytes
    tp_comm = layers * 2 * 2 * (tp - 1) * (TP_LINK["link_latency"] + msg / tp / TP_LINK["link_bandwidth"])
    pp_comm = (PP_LINK["link_latency"] + msg / PP_LINK["link_bandwidth"]) if pp > 1 else 0
    step = (m + pp - 1) * (max(flop / H100["flops"], read / H100["hbm_bandwidth"]) + tp_comm + pp_comm)
    memory = (w + batch * context * c.num_hidden_layers * kv / pp) * dtype_bytes
    return step, batch / step, memory, (pp - 1) / (m + pp - 1)


CASES = [
    (LLAMA3_70B, 8, 1, 32, 1, 4096, 2),
    (LLAMA3_70B, 8, 2, 64, 4, 8192, 2),
    (LLAMA3_70B, 16, 1, 64, 1, 8192, 2),  # more TP ranks than KV heads: the heads are replicated
    (LLAMA3_70B, 1, 4, 8, 8, 2048, 2),
    (LLAMA3_8B, 2, 2, 12, 3, 1000, 4),
    (LLAMA3_8B, 1, 1, 1, 1, 0, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].num_hidden_layers}L-tp{c[1]}-pp{c[2]}-b{c[3]}-m{c[4]}")
def test_layout_cost_matches_the_terms_by_hand(impl, case):
    c, tp, pp, batch, m, context, dtype_bytes = case
    got = impl(LAYOUTS).layout_cost(
        c, tp, pp, batch, m, context, H100["flops"], H100["hbm_bandwidth"], TP_LINK, PP_LINK, dtype_bytes
    )
    step, throughput, memory, bubble = by_hand(c, tp, pp, batch, m, context, dtype_bytes)
    for what, g, w in [("step_s", got.step_s, step), ("throughput", got.throughput, throughput),
                       ("memory_bytes", got.memory_bytes, memory), ("bubble", got.bubble, bubble)]:  # fmt: skip
        assert g == pytest.approx(w, rel=1e-9), (
            f"tp={tp} pp={pp} batch={batch} m={m} context={context}: {what} = {g:.6g}, by hand {w:.6g} "
            f"({g / w if w else float('inf'):.3f}x); check that term against the docstring"
        )


def test_pipeline_stages_divide_memory_and_pay_a_bubble(impl):
    mod = impl(LAYOUTS)

    def cost(tp, pp, m):
        return mod.layout_cost(LLAMA3_70B, tp, pp, 64, m, 8192, H100["flops"], H100["hbm_bandwidth"], TP_LINK, PP_LINK)

    one, two = cost(8, 1, 1), cost(8, 2, 1)
    assert two.memory_bytes == pytest.approx(one.memory_bytes / 2), "two stages should halve what each GPU holds"
    assert two.step_s > one.step_s, "at m = 1 a second stage only adds its send: the step cannot get faster"
    assert cost(8, 2, 8).bubble < cost(8, 2, 2).bubble, "more micro-batches should shrink the bubble"


def test_layout_cost_refuses_uneven_microbatches(impl):
    with pytest.raises(ValueError):
        impl(LAYOUTS).layout_cost(LLAMA3_8B, 1, 2, 10, 3, 64, H100["flops"], H100["hbm_bandwidth"], TP_LINK, PP_LINK)
