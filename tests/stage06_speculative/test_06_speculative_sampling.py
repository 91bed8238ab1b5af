"""Speculative sampling with a real (random-init) draft/target pair: many seeded runs, chi-square
against the target's own sampling distribution, computed exactly with transformers."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from labkit.testing import random_tokens

VOCAB = 12  # small, so every category gets counts and the exact marginals are cheap
RUNS = 1000
NEW = 3  # with k=2: token 1 and 2 exercise accept/resample, token 3 the bonus or a fresh round


def hf_probs(hf_model, contexts: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The target's own next-token distributions (B, V): HF logits, HF's temperature and top-p warpers."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    with torch.no_grad():
        scores = hf_model(contexts).logits[:, -1].float()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).double()


def exact_marginals(hf_target, prompt: list[int], temperature: float, top_p: float) -> list[np.ndarray]:
    """P(token i = y) for i = 1..NEW under plain sampling from the target, by enumerating all prefixes."""
    marginals, joint = [], {(): 1.0}
    for _ in range(NEW):
        prefixes = list(joint)
        probs = hf_probs(hf_target, torch.tensor([prompt + list(pre) for pre in prefixes]), temperature, top_p)
        marginal, nxt = np.zeros(VOCAB), {}
        for pre, row in zip(prefixes, probs.numpy(), strict=True):
            marginal += joint[pre] * row
            for y in np.flatnonzero(row > 0):
                nxt[(*pre, int(y))] = joint[pre] * row[y]
        marginals.append(marginal)
        joint = nxt
    return marginals


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square, pooling categories with expected count < 5 into one bin."""
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if (counts[expected == 0] > 0).any():
        return 0.0  # a token the target can never emit was emitted
    keep = expected > 0
    return float(chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "temperature", "top_p"), [(1, 0.7, 0.8)])
def test_speculative_sampling_matches_target_distribution(impl, pair, seed, temperature, top_p):
    m = impl("stage06_speculative.speculative")
    hf_target, hf_draft, target, draft = pair("gqa2-tied", seed, vocab_size=VOCAB)
    prompt = random_tokens(seed, 6, VOCAB).tolist()
    # guard: the draft differs enough from the target that emitting draft samples would be caught
    q = hf_probs(hf_draft, torch.tensor([prompt]), temperature, top_p)[0].numpy()
    target_first = exact_marginals(hf_target, prompt, temperature, top_p)[0]
    assert chi2_pvalue(np.round(q * RUNS), target_first) < 1e-3, f"seed={seed}: draft too close to the target"
    counts = np.zeros((NEW, VOCAB))
    accepted = rejected = 0
    for run in range(RUNS):
        out, stats = m.speculative_sample(
            target, draft, prompt, NEW, k=2, temperature=temperature, top_p=top_p, seed=run
        )
        assert len(out) == NEW, f"seed={seed} run={run}: expected {NEW} tokens, got {out}"
        counts[np.arange(NEW), out] += 1
        accepted, rejected = accepted + stats.accepted, rejected + stats.rejected
    assert accepted > 100 and rejected > 100, (
        f"seed={seed}: both branches must be exercised (accepted {accepted}, rejected rounds {rejected})"
    )
    for i, probs in enumerate(exact_marginals(hf_target, prompt, temperature, top_p)):
        pvalue = chi2_pvalue(counts[i], probs)
        assert pvalue > 1e-3, (
            f"seed={seed} T={temperature} top_p={top_p}: token {i + 1} of {RUNS} runs is not distributed as the "
            f"target's own sampling (chi-square p={pvalue:.2e})\ncounts   {counts[i].astype(int)}\n"
            f"expected {np.round(probs * RUNS, 1)}"
        )
