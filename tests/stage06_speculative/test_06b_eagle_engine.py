"""The EAGLE head as the batching engine's proposer (lab4 §4 inside lab2's engine): greedy output equals the
target's own greedy decoding (up to a near-tie, FP32_MARGIN) with sequences joining and leaving and with preemption, and a head that is
mostly right gets most of its drafts accepted."""

import pytest
from stage06_eagle_helpers import copying_head, make_target, random_head
from test_06b_batch_engine import expected_outputs, like_greedy, requests, run_checked

pytestmark = pytest.mark.in_process("the engine holds the test's models and stores")

ENGINE = "stage06_speculative.batch_engine"


@pytest.mark.parametrize(("config", "seed", "block_size", "k"), [("gqa2-tied", 0, 4, 3), ("mqa-odd", 1, 3, 4)])
def test_engine_with_eagle_equals_target_greedy_with_sequences_joining(impl, config, seed, block_size, k):
    eng = impl(ENGINE)
    _, target = make_target(config, seed, num_hidden_layers=1)
    reqs = requests(seed, 6, target.config.vocab_size)
    engine = eng.SpecBatchEngine(target, copying_head(target), k=k, block_size=block_size, max_batch=4)
    seqs = run_checked(engine, reqs[:4], {2: reqs[4:]}, seed)
    for i, (s, ref, (prompt, _)) in enumerate(zip(seqs, expected_outputs(target, reqs, None), reqs, strict=True)):
        like_greedy(s.generated, target, prompt, ref, f"{config} seed={seed} request {i}: target greedy")
    assert engine.accepted > engine.rejected, (
        f"{config} seed={seed}: a mostly-right head had {engine.accepted} drafts accepted, {engine.rejected} "
        "rounds rejected: is each sequence handed its own true features?"
    )


@pytest.mark.parametrize(("config", "seed", "block_size", "k"), [("gqa2-tied", 4, 3, 4), ("mha-untied", 5, 5, 2)])
def test_engine_with_eagle_survives_preemption(impl, config, seed, block_size, k):
    eng = impl(ENGINE)
    _, target = make_target(config, seed)
    reqs = requests(seed, 6, target.config.vocab_size)
    most = max(len(p) + n + k for p, n in reqs)
    engine = eng.SpecBatchEngine(
        target, random_head(target, seed), k=k, block_size=block_size, num_blocks=-(-most // block_size) + 1
    )
    seqs = run_checked(engine, reqs, {}, seed)
    assert engine.preemptions > 0, f"seed={seed}: the pool was meant to be too small for the whole batch"
    for i, (s, ref, (prompt, _)) in enumerate(zip(seqs, expected_outputs(target, reqs, None), reqs, strict=True)):
        like_greedy(s.generated, target, prompt, ref, f"seed={seed} request {i} after {engine.preemptions} preemptions")
