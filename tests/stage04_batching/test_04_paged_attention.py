"""Paged KV storage and paged attention against dense attention over the same keys and values."""

import pytest
import torch
import torch.nn.functional as F

from labkit.model import Config


def _random_layout(gen, num_blocks, block_size, lengths):
    """Random disjoint block tables covering each length, drawn from a shuffled pool."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lengths:
        k = -(-n // block_size)
        tables.append(perm[:k])
        perm = perm[k:]
    return tables


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slot_mapping_and_write_put_each_token_in_its_block(impl, seed):
    pa = impl("stage04_batching.paged_attention")
    gen = torch.Generator().manual_seed(seed)
    config = Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)
    cache = pa.PagedKVCache(config, num_blocks=12, block_size=4)
    n = int(torch.randint(5, 40, (1,), generator=gen))
    (table,) = _random_layout(gen, 12, 4, [n])
    start = int(torch.randint(0, n, (1,), generator=gen))
    slots = pa.slot_mapping(table, start, n, 4)
    k, v = torch.randn(n - start, 2, 8, generator=gen), torch.randn(n - start, 2, 8, generator=gen)
    cache.write(1, k, v, torch.tensor(slots, dtype=torch.long))
    for i, p in enumerate(range(start, n)):
        block, offset = table[p // 4], p % 4
        assert torch.equal(cache.k[1][block, offset], k[i]), f"seed={seed}: key of position {p} is not in its slot"
        assert torch.equal(cache.v[1][block, offset], v[i]), f"seed={seed}: value of position {p} is not in its slot"
    assert cache.k[0].abs().sum() == 0, f"seed={seed}: layer 0 must be untouched by a layer-1 write"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (5, 1)], ids=["mha", "gqa2", "gqa4", "mqa-odd"])
def test_paged_attention_equals_dense_attention(impl, seed, heads):
    pa = impl("stage04_batching.paged_attention")
    gen = torch.Generator().manual_seed(seed)
    n_heads, n_kv = heads
    D, bs, num_blocks, B = 16, 4, 64, 5
    context = torch.randint(1, 40, (B,), generator=gen)
    # mix decodes (1 query), prefill chunks and whole prompts
    query = torch.tensor(
        [int(torch.randint(1, int(c) + 1, (1,), generator=gen)) if b % 2 else 1 for b, c in enumerate(context)]
    )
    tables = _random_layout(gen, num_blocks, bs, context.tolist())
    k_pool = torch.randn(num_blocks, bs, n_kv, D, generator=gen)
    v_pool = torch.randn(num_blocks, bs, n_kv, D, generator=gen)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(int(query.sum()), n_heads, D, generator=gen)
    got = pa.paged_attention(q, k_pool, v_pool, block_tables, context, query)

    row = 0
    for b in range(B):
        c, t = int(context[b]), int(query[b])
        # dense K/V of sequence b, read position by position
        k = torch.stack([k_pool[tables[b][p // bs], p % bs] for p in range(c)])  # (c, n_kv, D)
        v = torch.stack([v_pool[tables[b][p // bs], p % bs] for p in range(c)])
        k = k.repeat_interleave(n_heads // n_kv, dim=1).transpose(0, 1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1).transpose(0, 1)
        qb = q[row : row + t].transpose(0, 1)  # (H, t, D)
        mask = torch.ones(t, c, dtype=torch.bool).tril(diagonal=c - t)
        expected = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(
            got[row : row + t], expected, atol=1e-5, rtol=1e-5, msg=lambda m, b=b: f"seed={seed}, sequence {b}: {m}"
        )
        row += t
