"""EAGLE drafting on random-init targets: the cached draft forward against the teacher-forced one, the
drafting loop against a rollout that recomputes everything, the hand-off of true features, and greedy
output identical to the target's own."""

import pytest
import torch
from stage06_eagle_helpers import copying_head, make_target, random_head, true_features

from labkit.testing import hf_greedy, random_tokens

CASES = [("mha-untied", 0, 1), ("gqa2-tied", 1, 3), ("gqa4-3layers", 2, 4), ("mqa-odd", 3, 5)]


@pytest.mark.parametrize(("config", "seed", "chunks"), [("gqa2-tied", 0, [5, 1, 3]), ("mqa-odd", 1, [1, 1, 6, 2])])
def test_draft_forward_in_chunks_equals_the_teacher_forced_pass(impl, config, seed, chunks):
    m = impl("stage06_speculative.eagle")
    _, target = make_target(config, seed)
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:60]
    head = random_head(target, seed, vocab)
    T = sum(chunks)
    feats = torch.randn(T, target.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    ids = random_tokens(seed, T, target.config.vocab_size)
    with torch.no_grad():
        want = head(feats[None], ids[None])[0]  # labkit's teacher-forced pass, no cache
        cache, got, logits, start = head.new_cache(T), [], [], 0
        for n in chunks:
            f, lg = m.draft_forward(head, cache, feats[start : start + n], ids[start : start + n])
            assert cache.length == start + n, f"{config} seed={seed}: cache.length {cache.length}, expected {start + n}"
            got.append(f)
            logits.append(lg)
            start += n
    got, logits = torch.cat(got), torch.cat(logits)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"{config} seed={seed} chunks={chunks}")
    assert logits.shape == (T, target.config.vocab_size), f"{config} seed={seed}: logits {tuple(logits.shape)}"
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[:, outside]).all(), (
        f"{config} seed={seed}: a token outside the head's vocab is possible"
    )
    want_logits = want @ target.lm_head.weight[vocab].T
    torch.testing.assert_close(logits[:, vocab], want_logits, atol=1e-3, rtol=1e-4, msg=f"{config} seed={seed}")


@pytest.mark.parametrize(("config", "seed", "k"), CASES)
def test_propose_equals_a_rollout_that_recomputes_everything(impl, config, seed, k):
    m = impl("stage06_speculative.eagle")
    _, target = make_target(config, seed)
    head = random_head(target, seed)
    T = 7
    feats = torch.randn(T, target.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    ids = random_tokens(seed + 1, T, target.config.vocab_size)
    cache = head.new_cache(T + k)
    drafted, q = m.propose(head, cache, feats, ids.tolist(), k)
    want, f, n = [], feats, ids
    with torch.no_grad():
        for _ in range(k):  # the slow way: the whole sequence again, the draft's own features appended
            pred = head(f[None], n[None])[0, -1]
            want.append(int((pred @ target.lm_head.weight.T).argmax()))
            f, n = torch.cat([f, pred[None]]), torch.cat([n, torch.tensor(want[-1:])])
    assert drafted == want, f"{config} seed={seed} k={k}: drafted {drafted}, the rollout gives {want}"
    assert cache.length == T + k - 1, f"{config} seed={seed} k={k}: cache.length {cache.length}, expected {T + k - 1}"
    assert q.shape == (k, target.config.vocab_size), f"{config} seed={seed}: q {tuple(q.shape)}"
    torch.testing.assert_close(q.sum(-1), torch.ones(k), msg=f"{config} seed={seed}: rows of q are distributions")


@pytest.mark.parametrize(("config", "seed", "k"), CASES)
def test_eagle_greedy_equals_target_greedy(impl, config, seed, k):
    m = impl("stage06_speculative.eagle")
    hf_target, target = make_target(config, seed)
    prompt = random_tokens(seed, 8 + seed, target.config.vocab_size).tolist()
    got, stats = m.eagle_generate(target, random_head(target, seed), prompt, 30, k=k)
    assert got == hf_greedy(hf_target, prompt, 30), f"{config} seed={seed} k={k}: differs from the target's greedy"
    assert stats.generated == 30 and stats.accepted + stats.target_forwards == 30, f"{config} seed={seed}: {stats}"


@pytest.mark.parametrize(("seed", "k"), [(0, 3), (1, 4)])
def test_a_draft_that_is_mostly_right_is_accepted_and_changes_nothing(impl, seed, k):
    m = impl("stage06_speculative.eagle")
    hf_target, target = make_target("gqa2-tied", seed, num_hidden_layers=1)
    prompt = random_tokens(seed, 10, target.config.vocab_size).tolist()
    got, stats = m.eagle_generate(target, copying_head(target), prompt, 40, k=k)
    assert got == hf_greedy(hf_target, prompt, 40), f"seed={seed} k={k}: differs from the target's greedy"
    assert stats.accepted >= 20, f"seed={seed} k={k}: a nearly exact draft had only {stats.accepted} of 40 accepted"
    assert stats.accepted + stats.target_forwards == 40, f"seed={seed} k={k}: {stats}"


@pytest.mark.parametrize(("config", "seed", "k"), [("gqa2-tied", 4, 3), ("mqa-odd", 5, 4)])
@pytest.mark.in_process("wraps the learner's propose to see what each round hands the draft")
def test_each_round_hands_the_draft_the_targets_true_features(impl, monkeypatch, config, seed, k):
    m = impl("stage06_speculative.eagle")
    _, target = make_target(config, seed, num_hidden_layers=1)
    head = copying_head(target) if seed % 2 else random_head(target, seed)
    seen, propose = [], m.propose

    def spy(head, cache, feats, next_ids, *args, **kwargs):
        seen.append((cache.length, feats.clone(), list(next_ids)))
        return propose(head, cache, feats, next_ids, *args, **kwargs)

    monkeypatch.setattr(m, "propose", spy)
    prompt = random_tokens(seed, 9, target.config.vocab_size).tolist()
    out, _ = m.eagle_generate(target, head, prompt, 30, k=k)
    ids = prompt + out
    true = true_features(target, ids)
    assert seen and seen[0][0] == 0, f"{config} seed={seed}: the first proposal must start from an empty draft cache"
    read = 0
    for start, feats, next_ids in seen:
        n = len(next_ids)
        assert start == read, f"{config} seed={seed}: a proposal starts at draft position {start}, expected {read}"
        assert next_ids == ids[start + 1 : start + 1 + n], f"{config} seed={seed}: wrong tokens after position {start}"
        torch.testing.assert_close(
            feats, true[start : start + n], atol=1e-4, rtol=1e-4, msg=f"{config} seed={seed}: features at {start}"
        )
        read = start + n
