"""Cached generation on real checkpoints' architectures (issue 13): equal to HF generate greedy.

Random-init HF models built from real config.json fields (labkit.testing.FAMILY_CONFIGS). Your
attention_block carries q/k/v and o biases through the projections, and your attention_mask
carries Mistral's window; what it does not implement (qk-norm, scaled RoPE) is refused by the
given forward (tests/meta/test_stage_refusals.py).
"""

import pytest

from labkit.testing import FP32_MARGIN, assert_hf_greedy, labkit_from_hf, random_family, random_tokens

SEED = 31
FAMILIES = ["llama3-4x-layout", "smollm2", "llama-attention-mlp-bias", "mistral-window", "qwen2-tied"]


@pytest.fixture(scope="module")
def models():
    out = {}
    for i, name in enumerate(FAMILIES):
        hf, _ = random_family(name, seed=SEED + i)
        out[name] = (hf, labkit_from_hf(hf))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_kv_cache_equals_hf_greedy(impl, models, name):
    hf, model = models[name]
    prompt = random_tokens(SEED, 9, model.config.vocab_size).tolist()
    got = impl("stage02_kv_cache.generate").generate_kv_cache(model, prompt, 14)
    assert_hf_greedy(got, hf, prompt, 14, FP32_MARGIN, f"{name}: cached greedy (seed={SEED})")


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-tied"])
def test_generate_batched_equals_hf_greedy(impl, models, name):
    hf, model = models[name]
    # No pad id (0) in the prompts: HF would mask it out of attention.
    prompts = [(random_tokens(SEED + n, n, model.config.vocab_size - 3) + 3).tolist() for n in (4, 11, 7)]
    got = impl("stage02_kv_cache.generate").generate_batched(model, prompts, 10)
    assert len(got) == len(prompts), f"{name}: one output per prompt (seed={SEED})"
    for b, (p, g) in enumerate(zip(prompts, got, strict=True)):
        assert_hf_greedy(g, hf, p, 10, FP32_MARGIN, f"{name}: left-padded batch row {b} (seed={SEED})")
