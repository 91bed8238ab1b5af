"""Splits and partial attention (lab7.ipynb §1–§2): which positions each rank holds, and attention over one block of keys merged into a
running result by the online-softmax rescaling. References: the splits written out by their rule, and
PyTorch's scaled_dot_product_attention over all the keys at once."""

import math

import pytest
import torch
import torch.nn.functional as F

RING = "stage07_tensor_parallel.context.ring"


def chunks(T, n):
    """n chunks of T positions in order, the first T % n one longer (the slow obvious way)."""
    sizes = [T // n + (i < T % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [list(range(s, s + k)) for s, k in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize("T,p", [(12, 2), (13, 2), (13, 3), (2, 2), (100, 3), (7, 1)])
def test_contiguous_split_gives_each_rank_one_chunk(impl, T, p):
    got = [list(map(int, r)) for r in impl(RING).split_positions(T, p, "contiguous")]
    assert got == chunks(T, p), f"T={T}, p={p}: {got}, expected {chunks(T, p)} (the first T % p chunks one longer)"


@pytest.mark.parametrize("T,p", [(12, 2), (13, 2), (13, 3), (6, 3), (101, 3)])
def test_zigzag_split_pairs_an_early_chunk_with_a_late_one(impl, T, p):
    c = chunks(T, 2 * p)
    want = [c[r] + c[2 * p - 1 - r] for r in range(p)]
    got = [list(map(int, r)) for r in impl(RING).split_positions(T, p, "zigzag")]
    assert got == want, f"T={T}, p={p}: {got}, expected {want} (rank r: chunks r and 2p - 1 - r of 2p)"


def test_zigzag_balances_the_causal_work(impl):
    """Scored (query, key) pairs under the causal mask, per rank: zigzag's spread is at most a chunk's."""
    T, p = 96, 3
    for scheme, most in (("contiguous", None), ("zigzag", 1.1)):
        work = [int(sum(int(q) + 1 for q in r)) for r in impl(RING).split_positions(T, p, scheme)]
        if most:
            assert max(work) / min(work) <= most, f"{scheme}: per-rank causal work {work} is not balanced"
        else:
            assert max(work) / min(work) > 3, f"{scheme}: per-rank causal work {work} should grow with the rank"


@pytest.mark.parametrize("T,p,scheme", [(2, 3, "contiguous"), (5, 3, "zigzag"), (0, 1, "contiguous")])
def test_a_prompt_shorter_than_the_ranks_is_refused(impl, T, p, scheme):
    with pytest.raises(ValueError, match=str(T)):
        impl(RING).split_positions(T, p, scheme)


def test_an_unknown_split_is_refused(impl):
    with pytest.raises(ValueError, match="striped"):
        impl(RING).split_positions(12, 2, "striped")


def qkv(seed, T, H=4, n_kv=2, D=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, T, D, generator=g) * 2 for h in (H, n_kv, n_kv))
    return q, k, v


def reference(q, k, v, q_pos, k_pos):
    """softmax attention of q over the keys at or before each query's position (all of them at once)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    return out.nan_to_num(0.0) * mask.any(-1)[:, None]  # a query that sees no key: 0


@pytest.mark.parametrize("seed,n_kv", [(0, 2), (1, 1), (2, 4)])
def test_block_attention_is_causal_attention_over_the_block(impl, seed, n_kv):
    q, k, v = qkv(seed, 9, n_kv=n_kv)
    q_pos, k_pos = torch.tensor([3, 4, 5, 12, 13, 14, 20, 21, 22]), torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13])
    o, lse = impl(RING).block_attention(q, k, v, q_pos, k_pos)
    want = reference(q, k, v, q_pos, k_pos)
    assert not torch.isnan(o).any(), f"seed={seed}: NaN in o (queries 3 and 4 see no key of the block)"
    delta = (o - want).abs().max().item()
    assert delta < 1e-5, f"seed={seed}, n_kv={n_kv}: o differs from SDPA over the block by {delta:.2e}"
    rep = q.shape[1] // n_kv
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    want_lse = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf).logsumexp(-1)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"seed={seed}: lse should be -inf exactly where no key is seen"
    assert (lse[seen] - want_lse[seen]).abs().max() < 1e-5, f"seed={seed}: lse is not the log-sum-exp of the scores"


@pytest.mark.parametrize("seed,blocks", [(0, 2), (1, 3), (2, 5)])
def test_merging_blocks_in_any_order_gives_full_attention(impl, seed, blocks):
    ring = impl(RING)
    T = 17
    q, k, v = qkv(seed, T)
    pos = torch.randperm(T, generator=torch.Generator().manual_seed(seed))  # queries and keys in any order
    parts = pos.tensor_split(blocks)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed + 9)).tolist()
    o, lse = torch.zeros_like(q), torch.full(q.shape[:3], -math.inf)
    for b in order:
        idx = torch.isin(pos, parts[b]).nonzero()[:, 0]
        o_b, lse_b = ring.block_attention(q, k[:, :, idx], v[:, :, idx], pos, pos[idx])
        o, lse = ring.merge_partials(o, lse, o_b, lse_b)
    delta = (o - reference(q, k, v, pos, pos)).abs().max().item()
    assert delta < 1e-5, f"seed={seed}: {blocks} blocks merged in order {order} differ from SDPA by {delta:.2e}"


def test_merge_keeps_queries_that_saw_nothing_at_zero(impl):
    o, lse = torch.zeros(1, 1, 2, 4), torch.full((1, 1, 2), -math.inf)
    o_b, lse_b = torch.ones(1, 1, 2, 4), torch.tensor([[[-math.inf, 0.5]]])
    o_b[0, 0, 0] = 0
    got, got_lse = impl(RING).merge_partials(o, lse, o_b, lse_b)
    assert not torch.isnan(got).any(), f"merging two empty partials gave NaN: {got}"
    assert torch.equal(got[0, 0, 0], torch.zeros(4)) and got_lse[0, 0, 0] == -math.inf, "an empty row stays 0, -inf"
    assert torch.allclose(got[0, 0, 1], torch.ones(4)) and got_lse[0, 0, 1] == 0.5, "a row seen once keeps its values"
