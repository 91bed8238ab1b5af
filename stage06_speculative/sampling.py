"""Speculative sampling: accept a drafted token with probability min(1, p/q), otherwise resample
from the leftover mass norm(max(0, p - q)). The emitted token is then distributed exactly as p
(Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

p is always the target's distribution, q the draft's, both after the same temperature and top-p.
"""

import torch


def warp(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution from logits: softmax(logits / temperature), then nucleus (top-p) filtering.

    logits: (..., V) any float dtype
    returns (..., V) float32, rows sum to 1. Top-p keeps a token when the mass of the tokens more
    likely than it is < top_p (so the most likely token is always kept), then renormalises.
    """
    raise NotImplementedError("stage06: warp — see lab.ipynb §5")


def accept_reject(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, u: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Verify k drafted tokens against the target (one round of Algorithm 1), given the randomness.

    p:       (k+1, V) float32 target distributions; row i scores the position of drafted[i], row k is
             the position after the last draft
    q:       (k, V) float32 draft distributions drafted[i] was sampled from
    drafted: (k,) int64
    u:       (k,) float32 uniforms in [0, 1); drafted[i] is accepted when u[i] < p[i, x] / q[i, x]
    returns  (n, dist): n = number of leading accepted drafts, and the (V,) distribution the next
             token is drawn from: norm(max(0, p[n] - q[n])) after a rejection, p[k] if all k passed.
    """
    raise NotImplementedError("stage06: accept_reject — see lab.ipynb §6")


def sample(dist: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id drawn from a (V,) distribution."""
    return int(torch.multinomial(dist, 1, generator=generator))
