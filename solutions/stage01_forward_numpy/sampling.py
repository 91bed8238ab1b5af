"""Turning logits into text: greedy decoding and temperature / top-k sampling, seeded.

`generate` works with any forward function of the form forward(params, token_ids (T,)) -> (T, V),
so the same loop drives the NumPy GPT-2 and the NumPy Llama of this stage.
"""

from collections.abc import Callable

import numpy as np

from .gpt2_numpy import softmax


def sample_next(
    logits: np.ndarray, temperature: float = 0.0, top_k: int | None = None, rng: np.random.Generator | None = None
) -> int:
    """Pick the next token from the logits of the last position.

    logits: (V,) float32. temperature == 0 means greedy: the argmax (lowest id on a tie), no rng needed.
    Otherwise sample from softmax(logits / temperature), restricted to the top_k largest logits
    when top_k is given, drawing from `rng` only, so equal seeds give equal tokens.
    """
    if temperature == 0.0:
        return int(np.argmax(logits))
    if rng is None:
        raise ValueError("sampling with temperature > 0 needs rng=np.random.default_rng(seed)")
    logits = logits / np.float32(temperature)
    if top_k is not None:
        top_k = min(top_k, len(logits))
        kth_largest = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits < kth_largest, -np.inf, logits)
    probs = softmax(logits.astype(np.float64))  # float64 so the probabilities sum to 1 as rng.choice requires
    return int(rng.choice(len(probs), p=probs))


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
    ids = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = forward(params, np.asarray(ids))[-1]
        token = sample_next(logits, temperature, top_k, rng)
        ids.append(token)
        new.append(token)
        if token == eos_id:
            break
    return new
