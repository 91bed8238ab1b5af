"""Greedy speculative decoding: the target's own greedy tokens, in fewer target forwards."""

import math

import pytest
import torch

import labkit
from labkit.testing import (
    FP32_MARGIN,
    assert_greedy_within,
    assert_hf_greedy,
    greedy_logits,
    hf_from_labkit,
    hf_greedy,
    random_tokens,
)


def no_eos(hf_model):
    """Make HF generate ignore EOS: the references decode a fixed number of tokens."""
    hf_model.config.eos_token_id = hf_model.generation_config.eos_token_id = 10**6
    return hf_model


CASES = [("mha-untied", 0, 1), ("gqa2-tied", 1, 2), ("gqa4-3layers", 2, 3), ("mqa-odd", 3, 5)]


def hf_assisted(hf_target, hf_draft, prompt: list[int], max_new_tokens: int, k: int) -> list[int]:
    """transformers' assisted generation, drafting exactly k tokens per round, EOS ignored."""
    out = hf_target.generate(
        torch.tensor([prompt]),
        assistant_model=hf_draft,
        num_assistant_tokens=k,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("config", "seed", "k"), CASES)
def test_greedy_speculative_equals_target_greedy_and_hf_assisted(impl, pair, config, seed, k):
    m = impl("stage06_speculative.speculative")
    hf_target, hf_draft, target, draft = pair(config, seed)
    prompt = random_tokens(seed, 9 + seed, 97).tolist()
    got, stats = m.greedy_speculative(target, draft, prompt, 37, k=k)
    # the target verifies k + 1 tokens at once, summing in other shapes than one token at a time
    what = f"{config} seed={seed} k={k}: speculative output"
    assert_hf_greedy(got, hf_target, prompt, 37, FP32_MARGIN, what)
    theirs = hf_assisted(hf_target, hf_draft, prompt, 37, k)
    assert_greedy_within(got, theirs, lambda: greedy_logits(hf_target, prompt, theirs), FP32_MARGIN, what + ", HF's")
    assert stats.generated == 37, f"{config} seed={seed}: stats.generated={stats.generated}, expected 37"


@pytest.mark.parametrize(("config", "seed", "k"), CASES)
@pytest.mark.in_process("reads back the test's caches and forward counters after the learner's loop")
def test_target_forwards_at_most_generated_and_stats_add_up(impl, pair, count_forwards, config, seed, k):
    m = impl("stage06_speculative.speculative")
    _, _, target, draft = pair(config, seed)
    calls = count_forwards(target)
    out, stats = m.greedy_speculative(target, draft, random_tokens(seed, 12, 97).tolist(), 40, k=k)
    assert calls.calls == stats.target_forwards, (
        f"{config} seed={seed}: the target ran {calls.calls} forwards but stats say {stats.target_forwards}"
    )
    assert stats.target_forwards <= len(out), (
        f"{config} seed={seed}: {stats.target_forwards} forwards > {len(out)} tokens"
    )
    # every round emits its accepted drafts plus one token of the target's own
    assert stats.accepted + stats.target_forwards == len(out), f"{config} seed={seed}: {stats}"
    assert stats.accepted <= stats.proposed, f"{config} seed={seed}: {stats}"


@pytest.mark.parametrize(("config", "seed", "k"), CASES)
@pytest.mark.in_process("reads back the test's caches and forward counters after the learner's loop")
def test_target_forwards_strictly_fewer_when_draft_agrees(impl, pair, count_forwards, config, seed, k):
    """With the target as its own draft every proposal is accepted: one forward per k + 1 tokens."""
    m = impl("stage06_speculative.speculative")
    hf_target, _, target, _ = pair(config, seed)
    prompt = random_tokens(seed, 10, 97).tolist()
    calls = count_forwards(target)
    draft_calls = count_forwards(draft := type(target)(target.config))
    draft.load_state_dict(target.state_dict())
    out, stats = m.greedy_speculative(target, draft.eval(), prompt, 30, k=k)
    assert_hf_greedy(out, hf_target, prompt, 30, FP32_MARGIN, f"{config} seed={seed} k={k}: the target's greedy")
    assert calls.calls == math.ceil(30 / (k + 1)) < 30, (
        f"{config} seed={seed} k={k}: a draft that always agrees needs ceil(30/{k + 1}) target forwards, got {calls.calls}"
    )
    assert stats.acceptance_rate == 1.0, f"{config} seed={seed}: acceptance {stats.acceptance_rate}, expected 1.0"
    assert draft_calls.calls <= stats.proposed, (
        f"{config} seed={seed}: the draft ran {draft_calls.calls} forwards for {stats.proposed} proposals; "
        "it should run one forward per proposed token, reusing its cache"
    )


@pytest.mark.parametrize(("config", "seed"), [("gqa2-tied", 0), ("mqa-odd", 1), ("gqa4-3layers", 2)])
@pytest.mark.in_process("reads back the test's caches and forward counters after the learner's loop")
def test_cache_rollback_after_rejection(impl, pair, config, seed):
    """After a round with a rejection, both caches continue exactly like a fresh forward over the kept tokens."""
    m = impl("stage06_speculative.speculative")
    hf_target, hf_draft, target, draft = pair(config, seed)
    tokens = random_tokens(seed, 14, 97).tolist()
    tc, dc = target.new_cache(1, 128), draft.new_cache(1, 128)
    k, rejected = 4, False
    for _ in range(8):  # a random draft disagrees within a few rounds
        drafted = m.propose_greedy(draft, dc, tokens, k)
        new = m.verify_greedy(target, tc, tokens, drafted)
        tokens = tokens + new
        rejected |= len(new) <= k
        if rejected:
            break
    assert rejected, f"{config} seed={seed}: expected a rejection within 8 rounds"
    assert tc.length == len(tokens) - 1, (
        f"{config} seed={seed}: target cache holds {tc.length}, expected {len(tokens) - 1}"
    )
    with torch.no_grad():
        cont = target(torch.tensor([tokens[-1:]]), tc)[0, -1]
        fresh = hf_target(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(cont, fresh, atol=1e-4, rtol=1e-4, msg=lambda s: f"{config} seed={seed}: target {s}")
    # the draft's next proposals must be what a fresh greedy run of the draft would produce
    what = f"{config} seed={seed}: after rollback, the draft's proposals against a fresh greedy run"
    assert_hf_greedy(m.propose_greedy(draft, dc, tokens, k), hf_draft, tokens, k, FP32_MARGIN, what)


@pytest.mark.parametrize("k", [2, 4])
def test_tiny_pair_greedy_identical_and_fewer_forwards(impl, k):
    from labkit.checkpoint import load_tokenizer
    from labkit.model import from_pretrained
    from labkit.quality import heldout

    m = impl("stage06_speculative.speculative")
    target, draft = from_pretrained(labkit.TARGET), from_pretrained(labkit.DRAFT)
    window = heldout(load_tokenizer(labkit.TARGET), n_tokens=512, seq=512)[0]
    prompt = window[:40].tolist()
    got, stats = m.greedy_speculative(target, draft, prompt, 48, k=k)
    hf_target = no_eos(hf_from_labkit(target))
    assert_hf_greedy(got, hf_target, prompt, 48, FP32_MARGIN, f"k={k}: tiny pair output")
    theirs = hf_assisted(hf_target, no_eos(hf_from_labkit(draft)), prompt, 48, k)
    assert_greedy_within(got, theirs, lambda: greedy_logits(hf_target, prompt, theirs), FP32_MARGIN, f"k={k}: HF's")
    assert stats.target_forwards < 48, f"k={k}: the distilled draft should save target forwards, got {stats}"


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_speculative_stops_right_after_eos(impl, pair, k):
    hf_target, _, target, draft = pair("gqa2-tied", 4)
    prompt = random_tokens(4, 8, 97).tolist()
    free = hf_greedy(hf_target, prompt, 30)
    eos = free[11]  # a token the target emits; generation must end at its first occurrence
    want = free[: free.index(eos) + 1]
    got, stats = impl("stage06_speculative.speculative").greedy_speculative(target, draft, prompt, 30, k=k, eos_id=eos)
    logits = greedy_logits(hf_target, prompt, want)
    what = f"seed=4 k={k} eos={eos}: the greedy tokens up to and including the first EOS"
    assert_greedy_within(got, want, logits, FP32_MARGIN, what)
    assert stats.generated == len(got), f"seed=4 k={k}: stats.generated={stats.generated}, kept {len(got)} tokens"
    # The target as its own draft accepts every draft: rounds of k + 1 tokens, so EOS lands mid-round.
    got, stats = impl("stage06_speculative.speculative").greedy_speculative(target, target, prompt, 30, k=k, eos_id=eos)
    assert_greedy_within(got, want, logits, FP32_MARGIN, f"seed=4 k={k} eos={eos}: drop what follows a mid-round EOS")
    assert stats.rejected == 0 and stats.accepted == stats.proposed > 0, f"seed=4 k={k}: nothing is rejected: {stats}"


def test_speculative_sample_draws_only_from_its_own_seed(impl, pair):
    """Every random draw (the drafts, the uniforms, the resample) comes from the seeded generator:
    the same seed gives the same tokens whatever the global RNG did, another seed other tokens."""
    m = impl("stage06_speculative.speculative")
    _, _, target, draft = pair("mqa-odd", 5)
    prompt = random_tokens(5, 7, 97).tolist()
    runs = []
    for global_seed, seed in [(1, 11), (2, 11), (3, 12)]:
        torch.manual_seed(global_seed)
        runs.append(m.speculative_sample(target, draft, prompt, 24, k=3, temperature=1.0, top_p=0.9, seed=seed)[0])
    assert runs[0] == runs[1], "seed=11 twice gave different tokens: a draw used the global RNG"
    assert runs[0] != runs[2], "seeds 11 and 12 gave the same 24 tokens: the seed is not used"
