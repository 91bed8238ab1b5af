"""§6–§7: split-K decode (FlashDecoding) over a contiguous and a paged cache, against SDPA."""

import pytest
import torch
import torch.nn.functional as F
from stage05_helpers import peaked

MODULE = "stage05_flashattention.flash_decoding"


def reference(q, k, v, seq_lens):
    """Per sequence: SDPA of its single query over its first seq_lens[b] keys."""
    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        kb, vb = k[b, :, :n].float(), v[b, :, :n].float()
        rows.append(F.scaled_dot_product_attention(q[b, :, None].float(), kb, vb, enable_gqa=True)[:, 0])
    return torch.stack(rows)


def decode_inputs(seed, H, H_kv, S, D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, H, D, generator=g).to(dtype)
    k, v = (torch.randn(3, H_kv, S, D, generator=g).to(dtype) for _ in range(2))
    seq_lens = torch.tensor([S, int(torch.randint(2, S, (1,), generator=g)), 1], dtype=torch.int32)
    return q, k, v, seq_lens


# seed, H, H_kv, num_splits: 8 splits of a 70-key cache leave some splits empty for the short rows
@pytest.mark.parametrize("seed,H,H_kv,num_splits", [(0, 2, 2, 1), (1, 4, 2, 3), (2, 4, 1, 8)])
def test_flash_decode_matches_sdpa(impl, seed, H, H_kv, num_splits):
    q, k, v, seq_lens = decode_inputs(seed, H, H_kv, 70, 32)
    got = impl(MODULE).flash_decode(q, k, v, seq_lens, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(
        got, reference(q, k, v, seq_lens), atol=1e-5, rtol=1e-5,
        msg=f"seed={seed}, H={H}, H_kv={H_kv}, num_splits={num_splits}, seq_lens={seq_lens.tolist()}",
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 2])
def test_flash_decode_keeps_the_running_max_across_tiles(impl, num_splits):
    q, k, v = peaked(4, 3, 4, 2, 64, 32)
    q, seq_lens = q[:, :, 0].contiguous(), torch.tensor([64, 40, 17], dtype=torch.int32)
    got = impl(MODULE).flash_decode(q, k, v, seq_lens, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(
        got, reference(q, k, v, seq_lens), atol=1e-5, rtol=1e-5, msg=f"seed=4 num_splits={num_splits}: max in tile 0"
    )


def test_flash_decode_matches_sdpa_fp16(impl):
    q, k, v, seq_lens = decode_inputs(3, 4, 2, 50, 64, torch.float16)
    got = impl(MODULE).flash_decode(q, k, v, seq_lens, num_splits=2, block_n=16)
    assert got.dtype == torch.float16, f"output dtype must follow q (float16), got {got.dtype}"
    torch.testing.assert_close(got.float(), reference(q, k, v, seq_lens), atol=1e-2, rtol=0, msg="seed=3")


def paged(seed, H, H_kv, D, page, max_blocks):
    """A pool whose unused slots hold NaN, random block tables, and the same K/V gathered densely."""
    g = torch.Generator().manual_seed(seed)
    B, num_blocks = 3, 3 * max_blocks + 4
    seq_lens = torch.tensor([max_blocks * page, page + 3, 1], dtype=torch.int32)
    block_tables = torch.randperm(num_blocks, generator=g)[: B * max_blocks].reshape(B, max_blocks).to(torch.int32)
    k_dense, v_dense = (torch.randn(B, max_blocks * page, H_kv, D, generator=g) for _ in range(2))
    k_pool, v_pool = (torch.full((num_blocks, page, H_kv, D), float("nan")) for _ in range(2))
    for b, n in enumerate(seq_lens.tolist()):
        for t in range(n):  # only real tokens are written; everything else stays NaN and must never be read
            k_pool[block_tables[b, t // page], t % page] = k_dense[b, t]
            v_pool[block_tables[b, t // page], t % page] = v_dense[b, t]
    q = torch.randn(B, H, D, generator=g)
    return q, k_pool, v_pool, block_tables, seq_lens, k_dense.transpose(1, 2), v_dense.transpose(1, 2)


# the last case has more splits than pages: three splits own no page at all
@pytest.mark.parametrize(
    "seed,H,H_kv,page,num_splits", [(0, 2, 2, 16, 1), (1, 4, 2, 8, 2), (2, 4, 1, 16, 3), (3, 4, 2, 8, 8)]
)
def test_paged_flash_decode_reads_kv_through_the_block_table(impl, seed, H, H_kv, page, num_splits):
    q, k_pool, v_pool, block_tables, seq_lens, k, v = paged(seed, H, H_kv, 32, page, max_blocks=5)
    got = impl(MODULE).paged_flash_decode(q, k_pool, v_pool, block_tables, seq_lens, num_splits=num_splits)
    where = f"seed={seed}, H={H}, H_kv={H_kv}, block_size={page}, num_splits={num_splits}, seq_lens={seq_lens.tolist()}"
    assert torch.isfinite(got).all(), f"NaN in the output: a pool slot outside the sequences was read ({where})"
    torch.testing.assert_close(got, reference(q, k, v, seq_lens), atol=1e-5, rtol=1e-5, msg=where)


BAD_DECODE = {
    "seq_lens int64": lambda q, k, v, n: (q, k, v, n.long()),
    "seq_lens past the cache": lambda q, k, v, n: (q, k, v, n + 100),
    "q with a time axis": lambda q, k, v, n: (q[:, :, None], k, v, n),
    "mixed dtypes": lambda q, k, v, n: (q.half(), k, v, n),
    "an empty sequence": lambda q, k, v, n: (q, k, v, n * torch.tensor([1, 0, 1], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_flash_decode_wrapper_rejects_bad_input(impl, case):
    with pytest.raises(ValueError):
        impl(MODULE).flash_decode(*BAD_DECODE[case](*decode_inputs(0, 2, 2, 20, 16)), num_splits=2, block_n=16)


def test_paged_flash_decode_wrapper_rejects_int64_block_tables(impl):
    q, k_pool, v_pool, block_tables, seq_lens, _, _ = paged(0, 2, 2, 16, 16, max_blocks=2)
    with pytest.raises(ValueError, match="block_tables"):
        impl(MODULE).paged_flash_decode(q, k_pool, v_pool, block_tables.long(), seq_lens)
