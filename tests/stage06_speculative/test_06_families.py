"""Greedy speculative decoding on real checkpoints' architectures (issue 13).

Target and a 1-layer draft of the same family (labkit.testing.FAMILY_CONFIGS); your propose/verify
run on labkit's model, which applies the family's extras, and the cache is truncated after rejected
drafts, so windows and scaled RoPE must survive rollback. Reference: HF generate greedy.
"""

import pytest

from labkit.testing import FP32_MARGIN, assert_hf_greedy, labkit_from_hf, random_family, random_tokens

SEED = 71
FAMILIES = ["llama3.2-tied", "mistral-window", "qwen2-tied", "qwen3"]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_speculative_equals_hf_greedy(impl, name):
    seed = SEED + FAMILIES.index(name)
    hf_target, _ = random_family(name, seed=seed, eos_token_id=10**6)
    hf_draft, _ = random_family(name, seed=seed + 1000, eos_token_id=10**6, num_hidden_layers=1)
    prompt = random_tokens(seed, 9, hf_target.config.vocab_size).tolist()
    got, _ = impl("stage06_speculative.speculative").greedy_speculative(
        labkit_from_hf(hf_target), labkit_from_hf(hf_draft), prompt, 24, k=3
    )
    assert_hf_greedy(got, hf_target, prompt, 24, FP32_MARGIN, f"{name}: speculative greedy (seed={seed})")
