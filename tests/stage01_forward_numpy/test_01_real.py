"""Stage 01 on the real model: the NumPy Llama reads SmolLM2-135M-Instruct's folder (`make setup`
converts it) and gives Hugging Face's logits on real text, and its greedy answer is HF's."""

import numpy as np
import pytest

from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.testing import assert_greedy_within, hf_greedy_logits, hf_logits, kept, real_hf, real_ids

MODULE = "stage01_forward_numpy.llama_numpy"
# 30 float32 layers of a real model sum in another order than PyTorch's: 1e-4 of a logit range of ~40
# (measured 1.0e-4 on this text); a wrong θ, eps or head layout is off by whole units.
TOLERANCE = 3e-4
QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def params(impl):
    return kept(impl(MODULE).load_llama_params, require_real_model())  # graded in a worker: its weights stay there


def test_llama_forward_matches_hf_on_real_text(impl, params):
    ids = real_ids()
    got = impl(MODULE).llama_forward(params, ids.numpy())
    expected = hf_logits(real_hf(), ids)
    assert got.shape == expected.shape, f"logits shape {got.shape}, expected (T, V) = {expected.shape}"
    assert got.dtype == np.float32, f"logits are {got.dtype}; keep every array float32"
    delta = np.abs(got - expected).max()
    worst = int(np.abs(got - expected).max(axis=1).argmax())
    assert delta < TOLERANCE, (
        f"SmolLM2 on REAL_TEXT ({len(ids)} tokens): max |Δlogits| vs HF = {delta:.2e} (worst at position {worst}), "
        f"tolerance {TOLERANCE:.0e}"
    )


def test_numpy_llama_answers_like_hf(impl, params):
    prompt = load_tokenizer(require_real_model()).encode(QUESTION).ids
    expected, logits = hf_greedy_logits(real_hf(), prompt, 8)
    got = impl("stage01_forward_numpy.sampling").generate(impl(MODULE).llama_forward, params, prompt, 8)
    # a forward within TOLERANCE of HF's logits may part from HF only at a token HF rates within 2 TOLERANCE
    assert_greedy_within(got, expected, logits, 2 * TOLERANCE, f"greedy tokens for {QUESTION!r}: HF generate")
