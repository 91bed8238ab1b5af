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
    raise NotImplementedError("stage04: sample — see lab.ipynb §5")


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    raise NotImplementedError("stage04: find_stop — see lab.ipynb §5")


def safe_length(text: str, stops: list[str]) -> int:
    """How much of a not-yet-finished text can be streamed: hold back a trailing broken UTF-8 sequence
    (decoded as U+FFFD) and any tail that could still grow into a stop string."""
    raise NotImplementedError("stage04: safe_length — see lab.ipynb §5")
