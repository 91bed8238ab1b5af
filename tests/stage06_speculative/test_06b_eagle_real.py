"""EAGLE on SmolLM2-135M-Instruct with the shipped head (labkit/assets/smollm2-eagle): Hugging Face's greedy
tokens on a chat prompt, in fewer target forwards than tokens."""

import pytest

from labkit import eagle
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.testing import REAL_MARGIN, assert_greedy_within, greedy_logits, hf_greedy_logits, real_hf, real_labkit

pytestmark = [pytest.mark.real, pytest.mark.slow]
NEW_TOKENS = 24
PROMPT = (
    "<|im_start|>user\nWhat is the capital of France, and what is it famous for?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize("k", [4])
def test_eagle_with_the_shipped_head_gives_hf_greedy_on_smollm2(impl, k):
    m = impl("stage06_speculative.eagle")
    prompt = load_tokenizer(require_real_model()).encode(PROMPT).ids
    want, logits = hf_greedy_logits(real_hf(), prompt, NEW_TOKENS)
    target = real_labkit()
    # The bound first, from the two reference paths: labkit's float32 model against HF's on these tokens.
    err = (greedy_logits(target, prompt, want) - logits).abs().max().item()
    assert err <= REAL_MARGIN / 2, f"labkit's SmolLM2 is {err:.3g} from HF's logits, past REAL_MARGIN / 2"
    got, stats = m.eagle_generate(target, eagle.load(eagle.REAL_EAGLE, target), prompt, NEW_TOKENS, k=k)
    # a verification forward over k + 1 tokens rounds differently from HF's one-token steps: near-ties may flip
    assert_greedy_within(got, want, logits, REAL_MARGIN, f"SmolLM2 + shipped EAGLE head, k={k} (err {err:.3g})")
    assert stats.target_forwards < NEW_TOKENS, (
        f"SmolLM2, k={k}: {stats.target_forwards} target forwards for {NEW_TOKENS} tokens; the trained head "
        "should have some drafts accepted"
    )
