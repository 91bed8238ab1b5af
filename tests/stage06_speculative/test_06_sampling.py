"""Speculative sampling's accept/reject step: the emitted token is distributed exactly as p."""

import numpy as np
import pytest
import torch


def random_dist(rng: np.random.Generator, vocab: int, zeros: int) -> torch.Tensor:
    """A random distribution over `vocab` tokens with `zeros` impossible tokens."""
    w = rng.gamma(0.7, size=vocab)
    w[rng.choice(vocab, size=zeros, replace=False)] = 0.0
    return torch.tensor(w / w.sum(), dtype=torch.float32)


def hf_warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Reference: transformers' own temperature and top-p warpers, then softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.8, 0.5)])
def test_warp_matches_hf_temperature_and_top_p(impl, seed, temperature, top_p):
    m = impl("stage06_speculative.sampling")
    logits = torch.randn(5, 61, generator=torch.Generator().manual_seed(seed)) * 3
    got = m.warp(logits, temperature, top_p)
    want = hf_warp(logits, temperature, top_p)
    torch.testing.assert_close(
        got, want, atol=1e-6, rtol=1e-5, msg=lambda s: f"seed={seed} T={temperature} top_p={top_p}: {s}"
    )


def first_token_distribution(accept_reject, p, q, rest, u_rest) -> torch.Tensor:
    """P(first emitted token = y), enumerating every branch of one verification round exactly.

    The draft's first token x has probability q[0, x]. Given x, the outcome depends on u[0] only
    through the comparison u[0] < p[0, x] / q[0, x], so it is constant between the breakpoints
    {0, min(1, p/q), 1}; evaluating at the middle of each piece and weighting by its length is an
    exact integral over u[0] ~ U[0, 1). (A uniform grid is added so a wrong threshold shows too.)
    """
    vocab = p.shape[1]
    out = torch.zeros(vocab, dtype=torch.float64)
    for x in range(vocab):
        if q[0, x] == 0:
            continue  # the draft never proposes x
        ratio = min(1.0, float(p[0, x] / q[0, x]))
        cuts = np.unique(np.concatenate([[0.0, ratio, 1.0], np.linspace(0, 1, 17)]))
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            u = torch.tensor([(lo + hi) / 2, *u_rest], dtype=torch.float32)
            n, dist = accept_reject(p, q, torch.tensor([x, *rest]), u)
            weight = float(q[0, x]) * (hi - lo)
            if n >= 1:
                out[x] += weight  # x itself is emitted
            else:
                out += weight * dist.double()  # the replacement is drawn from dist
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3])
def test_first_token_is_exactly_target_distribution(impl, seed, k):
    m = impl("stage06_speculative.sampling")
    rng = np.random.default_rng(seed)
    vocab = 8
    p = torch.stack([random_dist(rng, vocab, zeros=seed % 3) for _ in range(k + 1)])
    q = torch.stack([random_dist(rng, vocab, zeros=(seed + 1) % 3) for _ in range(k)])
    rest = [int(rng.choice(vocab, p=q[i].double().numpy() / q[i].double().sum().item())) for i in range(1, k)]
    u_rest = rng.uniform(size=k - 1).tolist()
    got = first_token_distribution(m.accept_reject, p, q, rest, u_rest)
    np.testing.assert_allclose(
        got.numpy(), p[0].double().numpy(), atol=1e-6, err_msg=f"seed={seed} k={k}: P(first token) must equal p"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accept_reject_counts_leading_acceptances(impl, seed):
    m = impl("stage06_speculative.sampling")
    rng = np.random.default_rng(seed)
    k, vocab = 4, 8
    p = torch.stack([random_dist(rng, vocab, 0) for _ in range(k + 1)])
    q = torch.stack([random_dist(rng, vocab, 0) for _ in range(k)])
    drafted = torch.tensor([int(torch.argmax(q[i] - p[i])) for i in range(k)])  # q > p there: rejectable
    ratio = (p[torch.arange(k), drafted] / q[torch.arange(k), drafted]).numpy()
    for j in range(k):
        u = torch.tensor([r * 0.5 if i != j else (r + 1) / 2 for i, r in enumerate(ratio)], dtype=torch.float32)
        n, dist = m.accept_reject(p, q, drafted, u)
        residual = (p[j] - q[j]).clamp(min=0)
        assert n == j, f"seed={seed}: drafts before position {j} pass and position {j} fails, expected n={j}, got {n}"
        torch.testing.assert_close(dist, residual / residual.sum(), msg=lambda s, j=j: f"seed={seed} j={j}: {s}")
    n, dist = m.accept_reject(p, q, drafted, torch.tensor(ratio * 0.5, dtype=torch.float32))
    assert n == k, f"seed={seed}: every draft passes, expected n={k}, got {n}"
    torch.testing.assert_close(dist, p[k], msg=lambda s: f"seed={seed}: all accepted -> bonus from p[k]: {s}")


def test_accept_reject_never_accepts_a_token_the_target_cannot_emit(impl):
    """u is in [0, 1) and a draft passes when u < p/q: with p(x) = 0 it must fail even at u = 0."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.6, 0.2, 0.2]])
    n, dist = impl("stage06_speculative.sampling").accept_reject(p, q, torch.tensor([0]), torch.zeros(1))
    assert n == 0, "the target gives the drafted token probability 0: reject it, whatever u is"
    torch.testing.assert_close(dist, torch.tensor([0.0, 0.5, 0.5]), msg="resample from norm(max(0, p - q))")


@pytest.mark.parametrize("top_p", [0.5, 0.9])
@pytest.mark.in_process("reads back the test's forward counters and caches after the learner's code ran")
def test_propose_sampled_returns_the_warped_draft_distributions(impl, pair, top_p):
    _, hf_draft, _, draft = pair("gqa2-tied", 6)
    tokens = [5, 17, 3, 40, 8]
    cache = draft.new_cache(1, 16)
    drafted, q = impl("stage06_speculative.speculative").propose_sampled(
        draft, cache, tokens, 3, 0.8, top_p, torch.Generator().manual_seed(6)
    )
    assert cache.length == len(tokens) + 2, f"the draft cache holds tokens + drafted[:-1], not {cache.length} tokens"
    with torch.no_grad():
        logits = hf_draft(torch.tensor([tokens + drafted[:-1]])).logits[0, len(tokens) - 1 :]
    torch.testing.assert_close(
        q, hf_warp(logits, 0.8, top_p), atol=1e-5, rtol=0, msg=f"seed=6 top_p={top_p}: q[i] is warp(draft logits)"
    )
