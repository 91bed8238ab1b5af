"""The paged engine on real checkpoints' architectures (issue 13): equal to HF generate greedy.

forward_paged (given) applies biases, Qwen3's qk-norm and scaled RoPE; your paged attention and
scheduler do the rest. A sliding window shorter than the engine's max_model_len is refused
(tests/meta/test_stage_refusals.py): paged_attention has no window.
"""

import pytest

from labkit.testing import FP32_MARGIN, assert_hf_greedy, labkit_from_hf, random_family, random_tokens

SEED = 41
FAMILIES = ["llama3.2-tied", "llama-linear-4x-type", "qwen2.5-untied", "qwen3", "qwen3-bias-untied"]


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_equals_hf(impl, name):
    seed = SEED + FAMILIES.index(name)
    hf, _ = random_family(name, seed=seed)
    model = labkit_from_hf(hf)
    prompts = [random_tokens(seed + n, n, model.config.vocab_size).tolist() for n in (5, 19, 12)]
    engine = impl("stage04_batching.engine").LLMEngine(model, num_blocks=16, block_size=4, max_num_seqs=3)
    params = impl("stage04_batching.sequence").SamplingParams(max_tokens=10, ignore_eos=True)
    outs = engine.generate(prompts, [params] * len(prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_hf_greedy(out.token_ids, hf, prompt, 10, FP32_MARGIN, f"{name}: engine (seed={seed})")
