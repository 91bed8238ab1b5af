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
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


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
    k = drafted.shape[0]
    rows = torch.arange(k)
    accepted = u < p[rows, drafted] / q[rows, drafted]
    n = int(accepted.long().cumprod(dim=0).sum())
    if n == k:
        return n, p[k]
    residual = (p[n] - q[n]).clamp(min=0.0)
    total = residual.sum()
    # p == q leaves no residual mass; a rejection then has probability 0 and only rounding gets here.
    return n, residual / total if total > 0 else p[n]


def sample(dist: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id drawn from a (V,) distribution."""
    return int(torch.multinomial(dist, 1, generator=generator))
