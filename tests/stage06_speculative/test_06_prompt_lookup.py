"""Prompt-lookup drafting: candidates copied from the context, verified by the target."""

import numpy as np
import pytest
import torch

from labkit.testing import FP32_MARGIN, assert_greedy_within, assert_hf_greedy, greedy_logits, random_tokens


def slow_candidates(tokens: list[int], k: int, max_ngram: int) -> list[int]:
    """Reference: every earlier match of the last n tokens, longest n first, the latest match wins."""
    for n in range(max_ngram, 0, -1):
        if len(tokens) <= n:
            continue
        suffix = tuple(tokens[-n:])
        starts = [i for i in range(len(tokens) - n) if tuple(tokens[i : i + n]) == suffix]
        if starts:
            return tokens[max(starts) + n : max(starts) + n + k]
    return []


def test_lookup_candidates_hand_example(impl):
    m = impl("stage06_speculative.prompt_lookup")
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6]
    got = m.lookup_candidates(tokens, 3, max_ngram=3)
    assert got == [7, 2, 3], f"last 2-gram (5, 6) last occurred at index 6, followed by 7 2 3; got {got}"
    assert m.lookup_candidates([4, 1, 2, 3], 3) == [], "no suffix recurs: no candidates"
    assert m.lookup_candidates([9, 4, 9], 5) == [4, 9], "a 1-gram match proposes what followed, up to the end"


@pytest.mark.parametrize("seed", range(5))
def test_lookup_candidates_match_slow_reference(impl, seed):
    m = impl("stage06_speculative.prompt_lookup")
    rng = np.random.default_rng(seed)
    for _ in range(40):
        vocab = int(rng.integers(2, 12))
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 60))).tolist()
        k, max_ngram = int(rng.integers(1, 8)), int(rng.integers(1, 5))
        got = m.lookup_candidates(tokens, k, max_ngram)
        want = slow_candidates(tokens, k, max_ngram)
        assert got == want, f"seed={seed} tokens={tokens} k={k} max_ngram={max_ngram}: expected {want}, got {got}"


def hf_prompt_lookup(hf_model, prompt: list[int], max_new_tokens: int, k: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]),
        prompt_lookup_num_tokens=k,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("config", "seed", "k"), [("gqa2-tied", 0, 3), ("mqa-odd", 1, 5), ("mha-untied", 2, 2)])
@pytest.mark.in_process("reads back the test's forward counters after the learner's loop")
def test_lookup_decode_equals_target_greedy_with_fewer_forwards(impl, pair, count_forwards, config, seed, k):
    m = impl("stage06_speculative.prompt_lookup")
    hf_target, _, target, _ = pair(config, seed)
    passage = random_tokens(seed, 15, 97).tolist()
    prompt = passage + [7] + passage[:5]  # the text starts repeating: a copy-heavy prompt
    calls = count_forwards(target)
    got, stats = m.lookup_decode(target, prompt, 40, k=k)
    assert_hf_greedy(got, hf_target, prompt, 40, FP32_MARGIN, f"{config} seed={seed} k={k}: the target's greedy")
    theirs = hf_prompt_lookup(hf_target, prompt, 40, k)
    what = f"{config} seed={seed} k={k}: HF lookup"
    assert_greedy_within(got, theirs, lambda: greedy_logits(hf_target, prompt, theirs), FP32_MARGIN, what)
    assert calls.calls == stats.target_forwards < 40, (
        f"{config} seed={seed} k={k}: {calls.calls} target forwards ({stats.target_forwards} in stats) for 40 tokens; "
        "copied candidates should be accepted sometimes"
    )
    assert stats.accepted + stats.target_forwards == 40, f"{config} seed={seed}: {stats}"
