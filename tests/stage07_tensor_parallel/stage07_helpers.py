"""Helpers several stage-07 fleet tests share: the reference every fleet's output is checked against.

The reference is labkit's own model recomputing the whole sequence for each token (no cache, no
engine), which tests/meta checks against Hugging Face; never the stage's solution.
"""

import torch

from labkit.device import pin_threads


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The n tokens greedy decoding appends to `prompt`, on one thread: the replicas use the other core."""
    ids = list(prompt)
    with pin_threads(1):
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]
