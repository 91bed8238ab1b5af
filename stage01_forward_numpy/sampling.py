"""Turning logits into text: greedy decoding and temperature / top-k sampling, seeded.

`generate` works with any forward function of the form forward(params, token_ids (T,)) -> (T, V),
so the same loop drives the NumPy GPT-2 and the NumPy Llama of this stage.
"""

from collections.abc import Callable

import numpy as np

from .gpt2_numpy import softmax  # noqa: F401


def sample_next(
    logits: np.ndarray, temperature: float = 0.0, top_k: int | None = None, rng: np.random.Generator | None = None
) -> int:
    """Pick the next token from the logits of the last position.

    logits: (V,) float32. temperature == 0 means greedy: the argmax (lowest id on a tie), no rng needed.
    Otherwise sample from softmax(logits / temperature), restricted to the top_k largest logits
    when top_k is given, drawing from `rng` only, so equal seeds give equal tokens.
    """
    raise NotImplementedError("stage01: sample_next — see lab.ipynb §6")


def generate(
    forward: Callable[[dict, np.ndarray], np.ndarray],
    params: dict,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    rng: np.random.Generator | None = None,
    eos_id: int | None = None,
) -> list[int]:
    """Append max_new_tokens tokens to `prompt` one at a time; returns only the new tokens.

    Each step runs `forward` on the whole sequence so far and keeps the last row of logits:
    T steps cost O(T²) token-positions of work (stage 02's KV cache removes the recomputation).
    Stops early after emitting eos_id, if given.
    """
    raise NotImplementedError("stage01: generate — see lab.ipynb §6")
