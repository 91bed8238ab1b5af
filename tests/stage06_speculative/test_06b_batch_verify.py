"""§2–§3 of lab2.ipynb: verifying a ragged batch of drafts in one target forward, each sequence
accepting its own count and giving back the KV blocks of its rejected drafts; and choose_k, the
per-sequence draft length from the stage's cost model, which turns speculation off when it stops paying."""

import pytest
import torch
from stage06b_batch_helpers import blocks_match_tokens, close_pair

from labkit import paged
from labkit.testing import FP32_MARGIN, assert_greedy_within, greedy_logits, random_tokens

pytestmark = pytest.mark.in_process("the learner's code changes the test's paged store in place")

VERIFY = "stage06_speculative.batch_verify"
CASES = [("gqa2-tied", 0, 4), ("mqa-odd", 1, 3), ("mha-untied", 2, 16), ("gqa4-3layers", 3, 5)]


def ragged_batch(target, seed: int, block_size: int):
    """Four sequences in the states an engine meets: decoding (cache = all tokens but the last),
    just admitted (empty cache: a prefill), lagging (a few unread tokens, after a preemption),
    and decoding with no drafts. Returns (store, seq_ids, tokens)."""
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(3, 14, (4,), generator=g)).tolist()
    tokens = [random_tokens(seed * 10 + i, n, vocab).tolist() for i, n in enumerate(lengths)]
    cached = [len(tokens[0]) - 1, 0, max(len(tokens[2]) - 3, 1), len(tokens[3]) - 1]
    store = paged.PagedKVStore(target, 64, block_size)
    ids = [7, 3, 11, 5]  # ids need not be 0..B-1
    warm = [i for i in range(4) if cached[i]]
    paged.forward(target, store, [ids[i] for i in warm], [tokens[i][: cached[i]] for i in warm])
    return store, ids, tokens


def greedy_ref(target, tokens: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (labkit.model with its contiguous cache)."""
    return target.generate(tokens, n, stop_at_eos=False)


@pytest.mark.parametrize(("config", "seed", "block_size"), CASES)
def test_verify_batch_greedy_accepts_each_sequences_own_count_in_one_forward(impl, config, seed, block_size):
    m = impl(VERIFY)
    target, _ = close_pair(config, seed)
    store, ids, tokens = ragged_batch(target, seed, block_size)
    g = torch.Generator().manual_seed(seed)
    ks = [int(torch.randint(2, 7, (1,), generator=g)), 3, 4, 0]
    agree = [int(torch.randint(0, ks[0], (1,), generator=g)), 1, ks[2], 0]  # seq 2 has every draft right
    drafts, expected = [], []
    for toks, k, a in zip(tokens, ks, agree, strict=True):
        ref = greedy_ref(target, toks, k + 1)
        wrong = (ref[a] + 1 + int(torch.randint(0, 5, (1,), generator=g))) % target.config.vocab_size if a < k else None
        rest = torch.randint(0, target.config.vocab_size, (k,), generator=g).tolist()
        drafts.append(ref[:a] + ([wrong] if a < k else []) + rest[a + 1 : k])
        expected.append(ref[: a + 1])
    calls = []
    hook = target.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        new = m.verify_batch(target, store, ids, tokens, drafts)
    finally:
        hook.remove()
    assert len(calls) == 1, (
        f"seed={seed}: verify_batch ran the target {len(calls)} times; the whole batch is ONE forward"
    )
    kept = []
    for i in range(4):
        # one forward over the ragged batch sums in other shapes than greedy_ref: equal up to a near-tie
        what = f"seed={seed} sequence {i} (k={ks[i]}, drafts {drafts[i]}): the target's greedy accepts {agree[i]}"
        logits = greedy_logits(target, tokens[i], expected[i])
        assert_greedy_within(new[i], expected[i], logits, FP32_MARGIN, what)
        # the store keeps the accepted drafts: the expected ones, unless a near-tie (allowed above) parted them
        accepted = agree[i] if new[i] == expected[i] else len(new[i]) - 1
        assert new[i][:accepted] == drafts[i][:accepted], f"{what}: accepted {new[i][:-1]}, not a prefix of the drafts"
        kept.append(len(tokens[i]) + accepted)
    problem = blocks_match_tokens(store, dict(zip(ids, kept, strict=True)))
    assert problem is None, f"seed={seed} block_size={block_size}: after verification, {problem}"


@pytest.mark.parametrize(("config", "seed", "block_size"), CASES[:2])
def test_verify_batch_keeps_the_accepted_kv_correct_for_the_next_step(impl, config, seed, block_size):
    """Rolled back right, the store continues exactly like the target's own greedy decoding."""
    m = impl(VERIFY)
    target, _ = close_pair(config, seed)
    store, ids, tokens = ragged_batch(target, seed, block_size)
    refs = [greedy_ref(target, t, 12) for t in tokens]
    out = [[] for _ in ids]
    g = torch.Generator().manual_seed(seed)
    for _ in range(4):
        drafts = []
        for i in range(4):
            k = int(torch.randint(0, 4, (1,), generator=g))
            good = refs[i][len(out[i]) : len(out[i]) + k]
            drafts.append([t if torch.rand(1, generator=g) < 0.7 else (t + 1) % 97 for t in good])
        new = m.verify_batch(target, store, ids, [t + o for t, o in zip(tokens, out, strict=True)], drafts)
        for i in range(4):
            out[i] += new[i]
    for i in range(4):
        want, what = refs[i][: len(out[i])], f"seed={seed} sequence {i} after 4 steps: greedy"
        assert_greedy_within(
            out[i], want, lambda i=i, want=want: greedy_logits(target, tokens[i], want), FP32_MARGIN, what
        )


def warp_ref(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T), keeping a token when the mass of the more likely ones is < top_p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(dim=-1, descending=True)
    sorted_p = probs.gather(-1, order)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize(("config", "seed", "block_size"), CASES[1:3])
def test_verify_batch_sampled_accepts_sure_drafts_and_rejects_impossible_ones(impl, config, seed, block_size):
    """A draft whose q equals the target's p is accepted whatever the uniform; a draft the target's
    nucleus excludes (p = 0) is rejected, and the replacement comes from inside the nucleus."""
    m = impl(VERIFY)
    T, top_p = 0.8, 0.6
    target, _ = close_pair(config, seed)
    store, ids, tokens = ragged_batch(target, seed, block_size)
    drafts, qs, agree = [], [], [2, 0, 3, 0]
    ks = [4, 2, 3, 0]
    nucleus = []
    for toks, k, a in zip(tokens, ks, agree, strict=True):
        drafted = list(greedy_ref(target, toks, a))  # the argmax is always inside the nucleus
        with torch.no_grad():
            p = warp_ref(target(torch.tensor([toks + drafted]))[0, len(toks) - 1 :].float(), T, top_p)
        q = [p[i] for i in range(a)]
        if a < k:
            outside = int(torch.nonzero(p[a] == 0)[0])
            drafted.append(outside)
            q.append(torch.nn.functional.one_hot(torch.tensor(outside), p.shape[-1]).float())
            drafted += [0] * (k - a - 1)
            q += [torch.full((p.shape[-1],), 1.0 / p.shape[-1])] * (k - a - 1)
        drafts.append(drafted)
        qs.append(torch.stack(q) if q else torch.zeros(0, p.shape[-1]))
        nucleus.append(p[a] > 0)
    new = m.verify_batch(target, store, ids, tokens, drafts, qs, T, top_p, torch.Generator().manual_seed(seed))
    for i in range(4):
        assert new[i][:-1] == drafts[i][: agree[i]], (
            f"seed={seed} sequence {i}: accepted {new[i][:-1]}, expected the {agree[i]} drafts with q = p"
        )
        assert nucleus[i][new[i][-1]], f"seed={seed} sequence {i}: token {new[i][-1]} is outside the target's top-p"
    problem = blocks_match_tokens(store, {s: len(t) + a for s, t, a in zip(ids, tokens, agree, strict=True)})
    assert problem is None, f"seed={seed}: after sampled verification, {problem}"


def speculative_step_ref(p: torch.Tensor, q: torch.Tensor, drafted: list[int], gen: torch.Generator) -> list[int]:
    """Algorithm 1 of Leviathan et al. written out: k uniforms, the leading run of u < p/q, then one
    draw from p[k] or from norm(max(0, p[n] - q[n])), every draw from `gen` in the documented order."""
    k = len(drafted)
    u = torch.rand(k, generator=gen)
    n = 0
    while n < k and u[n] < p[n, drafted[n]] / q[n, drafted[n]]:
        n += 1
    if n == k:
        dist = p[k]
    else:
        residual = (p[n] - q[n]).clamp(min=0.0)
        dist = residual / residual.sum() if residual.sum() > 0 else p[n]
    return drafted[:n] + [int(torch.multinomial(dist, 1, generator=gen))]


@pytest.mark.parametrize(
    ("config", "seed", "block_size", "T", "top_p"), [("gqa2-tied", 0, 4, 0.9, 0.9), ("mqa-odd", 1, 3, 1.3, 1.0)]
)
def test_verify_batch_sampled_makes_the_documented_draws_from_the_generator(impl, config, seed, block_size, T, top_p):
    """Same generator, same draws: per sequence in order, k uniforms then one token, from p = the
    target's warped distribution and the residual after a rejection; over three steps."""
    m = impl(VERIFY)
    target, draft = close_pair(config, seed, noise=0.5)  # a farther draft: some drafts get rejected
    store, ids, tokens = ragged_batch(target, seed, block_size)
    g = torch.Generator().manual_seed(seed + 50)
    gen, gen_ref = torch.Generator().manual_seed(seed + 7), torch.Generator().manual_seed(seed + 7)
    rejected = accepted = 0
    for step in range(3):
        drafts, qs, expected = [], [], []
        for toks in tokens:
            k = int(torch.randint(0, 5, (1,), generator=g))
            drafted, q = [], []
            with torch.no_grad():
                for _ in range(k):
                    q.append(warp_ref(draft(torch.tensor([toks + drafted]))[0, -1].float(), T, top_p))
                    drafted.append(int(torch.multinomial(q[-1], 1, generator=g)))
                p = warp_ref(target(torch.tensor([toks + drafted]))[0, len(toks) - 1 :].float(), T, top_p)
            q = torch.stack(q) if q else torch.zeros(0, p.shape[-1])
            drafts.append(drafted)
            qs.append(q)
            expected.append(speculative_step_ref(p, q, drafted, gen_ref))
            accepted += len(expected[-1]) - 1
            rejected += len(expected[-1]) - 1 < k
        new = m.verify_batch(target, store, ids, tokens, drafts, qs, T, top_p, gen)
        for i in range(4):
            assert new[i] == expected[i], (
                f"seed={seed} step {step} sequence {i} (drafts {drafts[i]}): got {new[i]}, expected {expected[i]} "
                f"(k uniforms then one draw per sequence, in order, all from the generator)"
            )
        tokens = [t + e for t, e in zip(tokens, expected, strict=True)]
    assert accepted and rejected, f"seed={seed}: the case should both accept and reject drafts ({accepted}, {rejected})"


class LinearCosts:
    """A cost model in the test: each forward costs fixed + per_token * tokens read."""

    def __init__(self, fixed: float, per_token: float, draft_fixed: float, draft_per_token: float):
        self.a, self.b, self.da, self.db = fixed, per_token, draft_fixed, draft_per_token

    def target(self, B: int, T: int) -> float:
        return self.a + self.b * B * T

    def draft(self, B: int) -> float:
        return self.da + self.db * B


COSTS = {
    "memory-bound": LinearCosts(1.0, 0.002, 0.08, 0.0002),
    "cpu-like": LinearCosts(1.0, 0.15, 0.2, 0.01),
    "dear-draft": LinearCosts(1.0, 0.01, 0.6, 0.005),
    "free-drafts": LinearCosts(1.0, 0.0, 0.0, 0.0),  # every k costs the same: at alpha 0 all tie, 0 must win
}


def best_ks(alpha: float, B: int, costs: LinearCosts, k_max: int) -> set[int]:
    """Every k whose speedup is the best (to rounding), by brute force from first principles."""

    def speedup(k):
        emitted = sum(alpha**i for i in range(k + 1))  # drafts 1..i all accepted, plus the target's token
        return emitted * costs.target(B, 1) / (k * costs.draft(B) + costs.target(B, k + 1))

    s = [speedup(k) for k in range(k_max + 1)]
    return {k for k in range(k_max + 1) if s[k] > max(s) - 1e-9}


@pytest.mark.parametrize("costs", COSTS)
def test_choose_k_is_the_smallest_best_k_of_the_cost_model(impl, costs):
    m = impl(VERIFY)
    model = COSTS[costs]
    picked = set()
    for alpha in (0.0, 0.3, 0.55, 0.8, 0.95, 1.0):
        for B in (1, 2, 3, 8, 16, 64):
            for k_max in (1, 4, 8):
                got = m.choose_k(alpha, B, model, k_max)
                want = best_ks(alpha, B, model, k_max)
                assert got == min(want), (
                    f"costs={costs} alpha={alpha} batch={B} k_max={k_max}: choose_k gave {got}, the cost model's "
                    f"best is k={min(want)} (exact math, no randomness)"
                )
                picked.add(got)
    assert len(picked) > 2, f"costs={costs}: the grid should exercise several k, saw {picked}"


def test_choose_k_turns_speculation_off_when_the_batch_is_large(impl):
    m = impl(VERIFY)
    cpu = COSTS["cpu-like"]
    ks = [m.choose_k(0.8, B, cpu, 8) for B in (1, 2, 4, 8, 16, 32)]
    assert ks[0] > 0, f"at batch 1 a good draft (alpha 0.8) pays on this cost model; choose_k gave {ks}"
    assert ks[-1] == 0, f"at batch 32 the verify pass costs k + 1 decode steps, so speculation must be off: {ks}"
    assert ks == sorted(ks, reverse=True), f"k must not grow with the batch on a linear cost model: {ks}"
