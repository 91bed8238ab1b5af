"""§6–§7 on the real model: SmolLM2-135M has attention sinks. While nothing is evicted, the learner's
streaming cache (4 sinks + window) gives the full model's logits, fed in two chunks; and the attention
each kept token has received, which the cache accumulates for H2O, equals the sum of Hugging Face's
eager attention weights. Its share on position 0 is the sink share the handout plots per layer."""

import pytest
import torch

from labkit.testing import real_hf, real_ids, real_labkit

pytestmark = [
    pytest.mark.real,
    pytest.mark.in_process("the learner's cache accumulates its scores in place; the test reads them back"),
]

T, FIRST = 112, 64  # the sink share counts the queries after the first 64, as the handout does


@torch.no_grad()
def hf_logits_and_attentions(ids: torch.Tensor):
    """HF's logits (1, T, V) and each layer's softmax weights (1, H, T, T), from its eager attention
    (the fused kernels return no weights); the shared model goes back to its own kernel afterwards."""
    hf = real_hf()
    kernel = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        out = hf(ids, output_attentions=True)
    finally:
        hf.set_attn_implementation(kernel)
    return out.logits, out.attentions


def test_02b_streaming_cache_on_the_real_model_equals_hf_and_measures_the_sink(impl):
    sinks = impl("stage02_kv_cache.sinks")
    model = real_labkit()
    ids = real_ids(T)[None]
    cache = sinks.StreamingCache(model.config, T, sinks.SinkWindow(4))  # budget T: nothing is evicted
    first = sinks.forward_streaming(model, ids[:, :FIRST], cache)
    for layer in cache.layers:  # from here on, count only what the later queries give
        layer.score.zero_()
    logits = torch.cat([first, sinks.forward_streaming(model, ids[:, FIRST:], cache)], dim=1)
    expected_logits, attentions = hf_logits_and_attentions(ids)
    torch.testing.assert_close(
        logits, expected_logits, atol=2e-3, rtol=1e-3,
        msg=f"SmolLM2, {T} tokens in chunks of {FIRST} and {T - FIRST}, nothing evicted: logits differ from HF's",
    )  # fmt: skip
    heads = model.config.num_attention_heads
    for i, (layer, weights) in enumerate(zip(cache.layers, attentions, strict=True)):
        order = layer.pos.argsort()
        assert layer.pos[order].tolist() == list(range(T)), f"layer {i}: nothing should be evicted below the budget"
        received = layer.score[order]  # position p: its weight summed over heads and the queries after FIRST
        expected = weights[0, :, FIRST:].sum(dim=(0, 1))
        torch.testing.assert_close(
            received, expected, atol=2e-3, rtol=1e-3,
            msg=f"layer {i}: attention received per position, summed over heads and queries {FIRST}..{T - 1}, vs HF",
        )  # fmt: skip
        share, hf_share = float(received[0]) / (heads * (T - FIRST)), float(weights[0, :, FIRST:, 0].mean())
        assert abs(share - hf_share) < 1e-4, f"layer {i}: sink share {share:.4f} from the cache, {hf_share:.4f} from HF"
