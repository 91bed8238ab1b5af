"""EAGLE drafting on random-init targets: the cached draft forward against the teacher-forced one, the
drafting loop against a rollout that recomputes everything, verification and the target's cache, the hand-off
of true features, and greedy output equal to the target's own up to a near-tie (FP32_MARGIN)."""

import pytest
import torch
from stage06_eagle_helpers import copying_head, make_target, random_head, true_features

from labkit.testing import (
    FP32_MARGIN,
    assert_decisive,
    assert_greedy_within,
    assert_hf_greedy,
    greedy_logits,
    random_tokens,
)

CASES = [("mha-untied", 0, 1), ("gqa2-tied", 1, 3), ("gqa4-3layers", 2, 4), ("mqa-odd", 3, 5)]


def first_mismatch(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str:
    """Where got (T, ...) first leaves want by more than atol + rtol |want|: the row, by how much, the worst
    row; '' if nowhere."""
    excess = ((got - want).abs() - atol - rtol * want.abs()).flatten(1).amax(-1)
    bad = (excess > 0).nonzero().flatten().tolist()
    if not bad:
        return ""
    err = (got - want).abs().flatten(1).amax(-1)
    return (
        f"position {bad[0]} is the first off, by {err[bad[0]]:.3g} (max |diff| {err.max():.3g} at position "
        f"{int(err.argmax())}; {len(bad)} of {len(got)} positions off)"
    )


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
    if where := first_mismatch(got, want, 1e-4, 1e-4):
        first = chunks[0]
        cause = (
            "the first chunk (an empty cache) is right, so look at what depends on the cached prefix L: RoPE "
            "rows L .. L + T - 1, causal_mask(L, T)"
            if not first_mismatch(got[:first], want[:first], 1e-4, 1e-4)
            else "the first chunk, from an empty cache, is off already: look at fc's input, concat(feats, "
            "embed(next_ids)) in that order, and the layer's call"
        )
        raise AssertionError(f"{config} seed={seed} chunks={chunks}: predicted features: {where}; {cause}")
    assert logits.shape == (T, target.config.vocab_size), f"{config} seed={seed}: logits {tuple(logits.shape)}"
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[:, outside]).all(), (
        f"{config} seed={seed}: a token outside the head's vocab is possible"
    )
    want_logits = want @ target.lm_head.weight[vocab].T
    if where := first_mismatch(logits[:, vocab], want_logits, 1e-3, 1e-4):
        raise AssertionError(
            f"{config} seed={seed}: logits at the head's vocabulary: {where}; token vocab[j]'s logit is "
            "predicted @ lm_head_weight[j], placed at column vocab[j] of the full vocabulary"
        )


def rollout(head, feats: torch.Tensor, ids: torch.Tensor, k: int, tokens=()) -> tuple[list[int], torch.Tensor]:
    """The slow way to draft k tokens: the whole sequence again each step, the draft's own features appended;
    the greedy tokens, and the logits (k, V) that chose each of `tokens` (the draft's own where given)."""
    want, rows, f, n = [], [], feats, ids
    with torch.no_grad():
        for i in range(k):
            pred = head(f[None], n[None])[0, -1]
            rows.append(pred @ head.target[0].lm_head.weight.T)
            want.append(int(rows[-1].argmax()))
            nxt = tokens[i] if i < len(tokens) else want[-1]
            f, n = torch.cat([f, pred[None]]), torch.cat([n, torch.tensor([nxt])])
    return want, torch.stack(rows)


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
    want, _ = rollout(head, feats, ids, k)
    # the cached draft sums in other shapes than the rollout: equal greedy tokens up to a near-tie of its logits
    what = f"{config} seed={seed} k={k}: drafted {drafted}, the rollout gives {want}"
    assert_greedy_within(drafted, want, lambda: rollout(head, feats, ids, k, drafted)[1], FP32_MARGIN, what)
    assert cache.length == T + k - 1, f"{config} seed={seed} k={k}: cache.length {cache.length}, expected {T + k - 1}"
    assert q.shape == (k, target.config.vocab_size), f"{config} seed={seed}: q {tuple(q.shape)}"
    torch.testing.assert_close(q.sum(-1), torch.ones(k), msg=f"{config} seed={seed}: rows of q are distributions")


@pytest.mark.parametrize(("config", "seed", "n"), [("gqa2-tied", 1, 1), ("mqa-odd", 3, 2), ("mha-untied", 0, 3), ("gqa4-3layers", 2, 4)])  # fmt: skip
def test_propose_stops_once_the_drafts_confidence_falls_below_the_threshold(impl, config, seed, n):
    """EAGLE-2's rule on a greedy chain of up to k = 4: the running product of the drafts' probabilities
    (softmax of the logits each came from) is compared after each draft; a threshold between the products after
    drafts n - 1 and n must give exactly n drafts."""
    m = impl("stage06_speculative.eagle")
    _, target = make_target(config, seed)
    head, k, T = random_head(target, seed), 4, 7
    feats = torch.randn(T, target.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    ids = random_tokens(seed + 1, T, target.config.vocab_size)
    want, rows = rollout(head, feats, ids, k)
    running = torch.softmax(rows, -1)[torch.arange(k), want].cumprod(0).tolist()
    before = running[n - 2] if n > 1 else 1.0
    if n < k:  # the draft n must be decisive: its probability far enough below 1 that rounding cannot bridge it
        assert running[n - 1] < 0.95 * before, f"{config} seed={seed}: reference: draft {n} is near-certain"
    # the geometric mean of the neighbouring products: far from both, on any scale
    threshold = (running[n - 1] * before) ** 0.5 if n < k else running[k - 2] / 2
    cache = head.new_cache(T + k)
    drafted, q = m.propose(head, cache, feats, ids.tolist(), k, threshold=threshold)
    products = ", ".join(f"{p:.3g}" for p in running)
    assert drafted == want[:n], (
        f"{config} seed={seed}: threshold {threshold:.3g}, the running products of the draft's probabilities "
        f"{products}: expected the {n} drafts {want[:n]}, got {drafted} (stop after the draft whose product falls "
        "below the threshold; the first draft is always made)"
    )
    assert q.shape == (n, target.config.vocab_size), f"{config} seed={seed}: q {tuple(q.shape)}, one row per draft"
    assert cache.length == T + n - 1, (
        f"{config} seed={seed}: cache.length {cache.length}, expected {T + n - 1} (the pending positions and the "
        f"{n - 1} drafts fed back; no draft step after the last draft)"
    )


@pytest.mark.parametrize(("config", "seed", "agree"), [("gqa2-tied", 6, 0), ("mqa-odd", 7, 2), ("mha-untied", 8, 4)])
def test_verify_keeps_only_the_accepted_drafts_in_the_targets_cache(impl, config, seed, agree):
    """Greedy verification of 4 drafts whose first `agree` are the target's own tokens: those are accepted, then
    the target's token; the features are the target's true ones at tokens[-1] and the accepted drafts; the
    target's cache holds tokens + the accepted drafts and no rejected draft's K/V."""
    m = impl("stage06_speculative.eagle")
    _, target = make_target(config, seed)
    tokens = random_tokens(seed, 9, target.config.vocab_size).tolist()
    want = target.generate(tokens, agree + 1, stop_at_eos=False)  # labkit's contiguous cache
    assert_decisive(want, greedy_logits(target, tokens, want), FP32_MARGIN, f"{config} seed={seed}: reference")
    wrong = int(greedy_logits(target, tokens, want)[agree].argmin())  # the target's least likely token
    drafted = (want[:agree] + [wrong] + want[agree + 1 :] + [wrong] * 4)[:4]
    cache = target.new_cache(1, len(tokens) + 8)
    m.target_forward(target, cache, tokens[:-1])
    q = torch.nn.functional.one_hot(torch.tensor(drafted), target.config.vocab_size).float()
    new, feats = m.verify(target, cache, tokens, drafted, q)
    assert new == want[: agree + 1], (
        f"{config} seed={seed}: drafts {drafted}, whose first {agree} are the target's greedy tokens: verify gave "
        f"{new}, expected {want[: agree + 1]} (the agreeing drafts, then the target's own token)"
    )
    extra = cache.length - len(tokens) - agree
    assert extra == 0, (
        f"{config} seed={seed}: after verify the target's cache holds {cache.length} positions, expected "
        f"{len(tokens) + agree} (the {len(tokens)} tokens and {agree} accepted drafts): "
        + ("a rejected draft's K/V are still in it" if extra > 0 else "accepted positions are missing")
    )
    true = true_features(target, tokens + want[:agree])[len(tokens) - 1 :]
    where = first_mismatch(feats, true, 1e-4, 1e-4) if feats.shape == true.shape else f"shape {tuple(feats.shape)}"
    assert not where, (
        f"{config} seed={seed}: the features verify hands back ({tuple(true.shape)}: at tokens[-1] and each "
        f"accepted draft) differ from the target's true ones: {where}"
    )


@pytest.mark.parametrize(("config", "seed", "k"), CASES)
def test_eagle_greedy_equals_target_greedy(impl, config, seed, k):
    m = impl("stage06_speculative.eagle")
    hf_target, target = make_target(config, seed)
    prompt = random_tokens(seed, 8 + seed, target.config.vocab_size).tolist()
    got, stats = m.eagle_generate(target, random_head(target, seed), prompt, 30, k=k)
    assert_hf_greedy(got, hf_target, prompt, 30, FP32_MARGIN, f"{config} seed={seed} k={k}: EAGLE's greedy output")
    assert stats.generated == 30 and stats.accepted + stats.target_forwards == 30, f"{config} seed={seed}: {stats}"


@pytest.mark.parametrize(("seed", "k"), [(0, 3), (1, 4)])
def test_a_draft_that_is_mostly_right_is_accepted_and_changes_nothing(impl, seed, k):
    m = impl("stage06_speculative.eagle")
    hf_target, target = make_target("gqa2-tied", seed, num_hidden_layers=1)
    prompt = random_tokens(seed, 10, target.config.vocab_size).tolist()
    got, stats = m.eagle_generate(target, copying_head(target), prompt, 40, k=k)
    assert_hf_greedy(got, hf_target, prompt, 40, FP32_MARGIN, f"seed={seed} k={k}: EAGLE's greedy output")
    assert stats.accepted >= 20, f"seed={seed} k={k}: a nearly exact draft had only {stats.accepted} of 40 accepted"
    assert stats.accepted + stats.target_forwards == 40, f"seed={seed} k={k}: {stats}"


@pytest.mark.parametrize("seed", [0, 1])
def test_eagle_with_a_confidence_threshold_still_equals_target_greedy(impl, seed):
    """A threshold above every product (1.0) leaves one draft per verification; the output is the target's own."""
    m = impl("stage06_speculative.eagle")
    hf_target, target = make_target("gqa2-tied", seed, num_hidden_layers=1)
    prompt = random_tokens(seed, 10, target.config.vocab_size).tolist()
    got, stats = m.eagle_generate(target, copying_head(target), prompt, 40, k=4, threshold=1.0)
    assert_hf_greedy(got, hf_target, prompt, 40, FP32_MARGIN, f"seed={seed} threshold=1: EAGLE's greedy output")
    assert stats.accepted + stats.target_forwards == 40, f"seed={seed}: {stats}"
    assert stats.proposed <= stats.target_forwards - 1, (
        f"seed={seed}: {stats.proposed} drafts in {stats.target_forwards - 1} verifications with threshold 1.0: "
        "eagle_generate must hand propose its threshold"
    )


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
        if where := first_mismatch(feats, true[start : start + n], 1e-4, 1e-4):
            raise AssertionError(
                f"{config} seed={seed}: the true features handed over at draft position {start}: {where}"
            )
        read = start + n
