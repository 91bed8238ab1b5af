"""EAGLE at temperature > 0: many seeded runs, chi-square against the target's own sampling distribution
(computed exactly with transformers), with a head whose vocabulary lacks some of the target's tokens."""

import numpy as np
import pytest
import torch
from stage06_eagle_helpers import make_target
from test_06_speculative_sampling import NEW, RUNS, VOCAB, chi2_pvalue, exact_marginals

from labkit import eagle
from labkit.testing import random_tokens


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "temperature", "top_p"), [(1, 0.8, 1.0), (2, 0.7, 0.8)])
def test_eagle_sampling_matches_target_distribution(impl, seed, temperature, top_p):
    m = impl("stage06_speculative.eagle")
    hf_target, target = make_target("gqa2-tied", seed, vocab_size=VOCAB)
    head = eagle.attach(target, torch.arange(VOCAB - 3), seed)  # it can never propose the last 3 tokens
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    prompt = random_tokens(seed, 6, VOCAB).tolist()
    counts = np.zeros((NEW, VOCAB))
    accepted = rejected = 0
    for run in range(RUNS):
        out, stats = m.eagle_generate(target, head, prompt, NEW, k=2, temperature=temperature, top_p=top_p, seed=run)
        assert len(out) == NEW, f"seed={seed} run={run}: expected {NEW} tokens, got {out}"
        counts[np.arange(NEW), out] += 1
        accepted, rejected = accepted + stats.accepted, rejected + stats.rejected
    assert accepted > 100 and rejected > 100, (
        f"seed={seed}: both branches must be exercised (accepted {accepted}, rejected rounds {rejected})"
    )
    for i, probs in enumerate(exact_marginals(hf_target, prompt, temperature, top_p)):
        pvalue = chi2_pvalue(counts[i], probs)
        assert pvalue > 1e-3, (
            f"seed={seed} T={temperature} top_p={top_p}: token {i + 1} of {RUNS} EAGLE runs is not distributed as "
            f"the target's own sampling (chi-square p={pvalue:.2e})\ncounts   {counts[i].astype(int)}\n"
            f"expected {np.round(probs * RUNS, 1)}"
        )
