"""Your GGUF files of the tiny target, run by llama.cpp itself, against the Hugging Face model.

llama.cpp is optional (it compiles on install): these tests skip at collection, saying how to install it,
when `llama_cpp` is not importable, and run wherever it is (`make llamacpp`; `make test` builds it once).
"""

from importlib.util import find_spec

import numpy as np
import pytest
import torch

import labkit
from labkit.checkpoint import load_tokenizer
from labkit.quality import heldout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        find_spec("llama_cpp") is None,
        reason="needs llama_cpp (make llamacpp: builds llama-cpp-python, a few minutes on 2 idle cores)",
    ),
]


@pytest.fixture(scope="module")
def llama_cpp():
    import llama_cpp

    return llama_cpp


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64) - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize(("mix", "max_kl", "min_top1"), [("F32", 1e-6, 0.999), ("Q8_0", 1e-3, 0.98)])
def test_03b_llamacpp_runs_your_gguf_like_hf(impl, llama_cpp, tmp_path, mix, max_kl, min_top1):
    from transformers import AutoModelForCausalLM

    path = impl("stage03_quantization.gguf_export").export_gguf(labkit.TARGET, tmp_path / f"tiny-{mix}.gguf", mix)
    windows = heldout(load_tokenizer(labkit.TARGET), n_tokens=2 * 192, seq=192)
    hf = AutoModelForCausalLM.from_pretrained(labkit.TARGET, dtype=torch.float32).eval()
    llm = llama_cpp.Llama(str(path), n_ctx=192, n_batch=192, n_threads=1, logits_all=True, verbose=False)
    for i, w in enumerate(windows):
        with torch.no_grad():
            ref = log_softmax(hf(w[None]).logits[0].numpy())
        llm.reset()
        llm.eval(w.tolist())
        got = log_softmax(np.array(llm.scores[: len(w)]))
        kl = (np.exp(ref) * (ref - got)).sum(-1).mean()
        top1 = (got.argmax(-1) == ref.argmax(-1)).mean()
        assert kl < max_kl and top1 >= min_top1, (
            f"window {i}: llama.cpp on your {mix} file vs HF fp32: KL {kl:.3g} (max {max_kl}), top-1 agreement "
            f"{top1:.3f} (min {min_top1}). If F32 fails, look at the q/k row permutation and the tokenizer."
        )
