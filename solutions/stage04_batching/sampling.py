"""Sampling and stop strings: what the engine does with a sequence's logits and its text after each step.

    token = sample(logits, params, generator)      # engine.py calls it once per sequence and step
    cut = find_stop(text, params.stop)             # ... and these two on the detokenized output
    end = safe_length(text, params.stop)
"""

import torch

from .sequence import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from logits (vocab,) float32.

    temperature 0 -> argmax. Otherwise softmax(logits / temperature) restricted to the top_k largest
    logits (if top_k > 0) and then to the smallest set of tokens whose probability reaches top_p (if
    top_p < 1), renormalized, sampled with `generator` (a per-request seed makes it reproducible).
    """
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        outside = torch.cumsum(probs, -1) - probs >= params.top_p  # the mass before it already reaches top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def safe_length(text: str, stops: list[str]) -> int:
    """How much of a not-yet-finished text can be streamed: hold back a trailing broken UTF-8 sequence
    (decoded as U+FFFD) and any tail that could still grow into a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    held = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
    return end - held
