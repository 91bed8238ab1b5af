"""§4 of lab2.ipynb: the speculating batch engine end to end. Greedy output equals the target's own
greedy decoding and the same engine without speculation, with sequences joining and leaving
mid-run; blocks in use equal what the accepted tokens need after every step; preemption loses
nothing; sampled output follows the target's distribution (chi-square, as in part 1)."""

import numpy as np
import pytest
import torch
from stage06b_batch_helpers import blocks_match_tokens, close_pair
from test_06_speculative_sampling import VOCAB, chi2_pvalue, exact_marginals, hf_probs

from labkit.testing import FP32_MARGIN, assert_greedy_within, greedy_logits, random_tokens

pytestmark = pytest.mark.in_process("the engine holds the test's models and stores")

ENGINE = "stage06_speculative.batch_engine"


def requests(seed: int, n: int, vocab: int):
    """n (prompt, max_new_tokens) pairs of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 15, (n,), generator=g).tolist()
    news = torch.randint(3, 16, (n,), generator=g).tolist()
    return [
        (random_tokens(seed * 100 + i, L, vocab).tolist(), m)
        for i, (L, m) in enumerate(zip(lengths, news, strict=True))
    ]


def run_checked(engine, reqs, join_at: dict[int, list], seed: int):
    """Submit reqs, more at the steps in join_at; after every step check both stores' blocks."""
    seqs = [engine.add(p, n) for p, n in reqs]
    while engine.has_work():
        engine.step()
        seqs += [engine.add(p, n) for p, n in join_at.get(engine.steps, [])]
        running = [s for s in engine.running if s.seq_id in engine.store.lengths]
        problem = blocks_match_tokens(engine.store, {s.seq_id: len(s.tokens) - 1 for s in running})
        assert problem is None, f"seed={seed} step {engine.steps}: target store: {problem}"
        if engine.draft_store is not None:
            drafted = {s.seq_id: engine.draft_store.length(s.seq_id) for s in running}
            assert all(drafted[s.seq_id] < len(s.tokens) for s in running), f"seed={seed}: draft store ahead"
            problem = blocks_match_tokens(engine.draft_store, {k: v for k, v in drafted.items() if v})
            assert problem is None, f"seed={seed} step {engine.steps}: draft store: {problem}"
    return seqs


def expected_outputs(target, reqs, eos_id):
    out = []
    for p, n in reqs:
        ref = target.generate(p, n, stop_at_eos=False)
        out.append(ref[: ref.index(eos_id) + 1] if eos_id in ref else ref)
    return out


def like_greedy(got, target, prompt, ref, what):
    """A batch verifies k + 1 tokens of many sequences at once, summing in other shapes than one sequence's
    plain decode: got is ref up to a near-tie of the target's logits (labkit.testing.assert_greedy_within)."""
    assert_greedy_within(got, ref, lambda: greedy_logits(target, prompt, ref), FP32_MARGIN, what)


ENGINE_CASES = [("gqa2-tied", 0, 4, 3), ("mqa-odd", 4, 3, 5), ("gqa4-3layers", 2, 16, 2)]


@pytest.mark.parametrize(("config", "seed", "block_size", "k"), ENGINE_CASES)
def test_engine_greedy_equals_target_greedy_with_sequences_joining_and_leaving(impl, config, seed, block_size, k):
    eng = impl(ENGINE)
    target, draft = close_pair(config, seed)
    reqs = requests(seed, 9, target.config.vocab_size)
    eos = expected_outputs(target, reqs[:1], None)[0][4]  # a token one sequence really emits: it must stop there
    refs = expected_outputs(target, reqs, eos)
    join = {2: reqs[3:6], 5: reqs[6:]}
    spec = run_checked(eng.SpecBatchEngine(target, draft, k=k, block_size=block_size, eos_id=eos), reqs[:3], join, seed)
    plain = run_checked(
        eng.SpecBatchEngine(target, draft, k=0, block_size=block_size, eos_id=eos), reqs[:3], join, seed
    )
    for i, (s, p, ref, (prompt, _)) in enumerate(zip(spec, plain, refs, reqs, strict=True)):
        like_greedy(p.generated, target, prompt, ref, f"seed={seed} request {i}: the engine without speculation")
        like_greedy(s.generated, target, prompt, ref, f"seed={seed} k={k} request {i}: the speculative engine")
    accepted, proposed = sum(s.accepted for s in spec), sum(s.proposed for s in spec)
    assert 0 < accepted < proposed, f"seed={seed}: accepted {accepted} of {proposed}: both outcomes must occur"


@pytest.mark.parametrize(("config", "seed", "block_size", "k"), [("gqa2-tied", 4, 3, 4), ("mha-untied", 5, 5, 2)])
def test_engine_preemption_during_speculation_loses_nothing(impl, config, seed, block_size, k):
    eng = impl(ENGINE)
    target, draft = close_pair(config, seed)
    reqs = requests(seed, 6, target.config.vocab_size)
    most = max(len(p) + n + k for p, n in reqs)
    engine = eng.SpecBatchEngine(target, draft, k=k, block_size=block_size, num_blocks=-(-most // block_size) + 1)
    seqs = run_checked(engine, reqs, {}, seed)
    assert engine.preemptions > 0, f"seed={seed}: the pool was meant to be too small for the whole batch"
    for i, (s, ref, (prompt, _)) in enumerate(zip(seqs, expected_outputs(target, reqs, None), reqs, strict=True)):
        like_greedy(
            s.generated, target, prompt, ref, f"seed={seed} request {i}: after {engine.preemptions} preemptions"
        )


def test_engine_adaptive_k_speculates_at_batch_1_and_stops_in_a_large_batch(impl):
    """choose_k inside the engine: the same greedy tokens either way, drafts only where they pay."""
    eng = impl(ENGINE)
    seed = 6
    target, draft = close_pair("gqa2-tied", seed)
    # memory-bound up to 5 tokens a forward, compute-bound beyond: at batch 8 a step of k + 1 tokens per
    # sequence costs k + 1 plain steps, more than the at most k + 1 tokens it can emit
    costs = eng.Costs(draft=lambda B: 0.02 * max(1.0, 0.2 * B), target=lambda B, T: max(1.0, 0.2 * B * T))
    reqs = [(p, 8) for p, _ in requests(seed, 8, target.config.vocab_size)]
    refs = expected_outputs(target, reqs, None)
    alone = eng.SpecBatchEngine(target, draft, k=6, costs=costs)
    (solo,) = run_checked(alone, reqs[:1], {}, seed)
    assert solo.proposed > 0, f"seed={seed}: at batch 1 speculation pays: {solo}"
    like_greedy(solo.generated, target, reqs[0][0], refs[0], f"seed={seed}: batch 1")
    crowd = run_checked(eng.SpecBatchEngine(target, draft, k=6, costs=costs), reqs, {}, seed)
    probes = [s.proposed for s in crowd]  # the first step drafts one token each, to measure acceptance
    assert max(probes) <= 1, f"seed={seed}: a batch of 8 on this cost model must not speculate, drafted {probes}"
    for i, (s, ref, (prompt, _)) in enumerate(zip(crowd, refs, reqs, strict=True)):
        like_greedy(s.generated, target, prompt, ref, f"seed={seed}: batch 8, request {i}")


@pytest.mark.slow
def test_engine_sampling_follows_the_target_distribution(impl, pair):
    eng = impl(ENGINE)
    seed, T, top_p, new, copies, runs = 1, 0.7, 0.8, 3, 25, 40
    hf_target, hf_draft, target, draft = pair("gqa2-tied", seed, vocab_size=VOCAB)
    prompt = random_tokens(seed, 6, VOCAB).tolist()
    q = hf_probs(hf_draft, torch.tensor([prompt]), T, top_p)[0].numpy()
    marginals = exact_marginals(hf_target, prompt, T, top_p)
    assert chi2_pvalue(np.round(q * copies * runs), marginals[0]) < 1e-3, f"seed={seed}: draft too close"
    counts = np.zeros((new, VOCAB))
    accepted = rejected = 0
    for run in range(runs):
        engine = eng.SpecBatchEngine(target, draft, k=2, temperature=T, top_p=top_p, seed=run, block_size=4)
        seqs = [engine.add(prompt, new) for _ in range(copies)]
        engine.run()
        for s in seqs:
            counts[np.arange(new), s.generated] += 1
            accepted, rejected = accepted + s.accepted, rejected + s.rejected
    assert accepted > 100 and rejected > 100, f"seed={seed}: accepted {accepted}, rejected rounds {rejected}"
    for i, probs in enumerate(marginals):
        pvalue = chi2_pvalue(counts[i], probs)
        assert pvalue > 1e-3, (
            f"seed={seed} T={T} top_p={top_p}: token {i + 1} of {copies * runs} sequences is not distributed as "
            f"the target's own sampling (chi-square p={pvalue:.2e})\ncounts   {counts[i].astype(int)}\n"
            f"expected {np.round(probs * copies * runs, 1)}"
        )
