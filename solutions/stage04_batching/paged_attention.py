"""Paged KV storage and the attention that reads it through block tables.

Token p of a sequence lives in physical block block_table[p // block_size] at offset p % block_size,
i.e. in "slot" block_table[p // block_size] * block_size + p % block_size of the flattened pool.
"""

import torch
import torch.nn.functional as F

from labkit.model import Config


class PagedKVCache:
    """Per layer, a K pool and a V pool of shape (num_blocks, block_size, n_kv_heads, head_dim),
    allocated once; sequences own blocks of it through their block tables."""

    def __init__(self, config: Config, num_blocks: int, block_size: int, dtype=torch.float32):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]  # read from the pool itself, so it cannot disagree with the block manager's

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the K/V of N new tokens of one layer.

        k, v:         (N, n_kv_heads, head_dim), token i's keys and values
        slot_mapping: (N,) int64, the flat slot of token i (block_id * block_size + offset)
        """
        n_kv, d = k.shape[1:]
        self.k[layer].view(-1, n_kv, d)[slot_mapping] = k
        self.v[layer].view(-1, n_kv, d)[slot_mapping] = v

    def read(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool, block_tables) for paged_attention: the pools themselves here; a quantized cache
        (part 3, kv_quant.py) hands back its blocks widened to float32 instead."""
        return self.k[layer], self.v[layer], block_tables

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: duplicate block src into block dst in every layer."""
        for pool in (*self.k, *self.v):
            pool[dst] = pool[src]


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat slots of positions start .. end-1 of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
) -> torch.Tensor:
    """Causal attention for a batch of sequences of different lengths whose K/V live in the pool.

    q:            (N, n_heads, head_dim), the queries of B sequences packed back to back: sequence b owns
                  query_lens[b] rows, which are its LAST query_lens[b] positions out of context_lens[b]
    k_pool:       (num_blocks, block_size, n_kv_heads, head_dim), one layer's pool, already holding
                  this step's keys; v_pool the same for values
    block_tables: (B, max_blocks) int64, row b lists sequence b's blocks (padded with any valid id)
    context_lens: (B,) int64, tokens of sequence b with K/V in the pool, this step's included
    query_lens:   (B,) int64, sum(query_lens) == N
    returns       (N, n_heads, head_dim): the query at position p attends to keys 0 .. p of its sequence
                  (the scaled dot-product softmax, scale 1/sqrt(head_dim), GQA head h reads kv head
                  h // (n_heads // n_kv_heads))
    """
    if len(q) == len(query_lens):  # a pure decode step: one query per sequence, nothing to pad or scatter
        return _decode(q, k_pool, v_pool, block_tables, context_lens)
    if len(query_lens) == 1:  # one sequence's chunk: its rows are already a batch of one
        return _attend(q, k_pool, v_pool, block_tables, context_lens, query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    out = torch.empty_like(q)
    # Decodes are batched apart from prefill chunks, so a long chunk does not pad every decode.
    for group, attend in ((query_lens == 1, _decode), (query_lens > 1, _attend)):
        b = group.nonzero().flatten()
        if len(b) == 0:
            continue
        rows = torch.repeat_interleave(starts[b], query_lens[b]) + _offsets(query_lens[b])
        lens = (context_lens[b],) if attend is _decode else (context_lens[b], query_lens[b])
        out[rows] = attend(q[rows], k_pool, v_pool, block_tables[b], *lens)
    return out


def _attend(q, k_pool, v_pool, block_tables, context_lens, query_lens):
    """paged_attention for one group: queries padded to (B, Tq), keys gathered to (B, max_blocks * bs)."""
    B, n_heads, n_kv = len(query_lens), q.shape[1], k_pool.shape[2]
    Tq = int(query_lens.max())
    if B == 1:
        qp = q[None]
    else:
        seq = torch.repeat_interleave(torch.arange(B), query_lens)  # (N,) which sequence each row is
        col = _offsets(query_lens)  # (N,) index in its chunk
        qp = q.new_zeros(B, Tq, n_heads, q.shape[2])
        qp[seq, col] = q
    k = k_pool[block_tables].flatten(1, 2)  # (B, max_blocks * bs, n_kv, D)
    v = v_pool[block_tables].flatten(1, 2)
    pos = context_lens[:, None] - query_lens[:, None] + torch.arange(Tq)  # (B, Tq) absolute positions
    key = torch.arange(k.shape[1])
    mask = (key <= pos[:, :, None]) & (key < context_lens[:, None, None])  # (B, Tq, K)
    y = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], enable_gqa=n_heads != n_kv
    )  # (B, n_heads, Tq, D); query head h reads kv head h // (n_heads // n_kv)
    return y.transpose(1, 2)[0] if B == 1 else y.transpose(1, 2)[seq, col]


def _decode(q, k_pool, v_pool, block_tables, context_lens):
    """paged_attention when every sequence brings one query, the last of its context: no causal mask needed.

    Keys are gathered up to the longest context only, and the n_heads / n_kv query heads that share a
    kv head go in as rows of that head (labkit.model.grouped_attention's trick): one sequence alone
    then needs no mask at all, which is what keeps a batch of one as fast as the plain cached loop."""
    B, n_heads, D = q.shape
    n_kv, K = k_pool.shape[2], int(context_lens.max())
    blocks = block_tables.flatten()  # index_select: the cheapest gather of whole blocks on CPU
    k = k_pool.index_select(0, blocks).view(B, -1, n_kv, D)[:, :K].transpose(1, 2)  # (B, n_kv, K, D)
    v = v_pool.index_select(0, blocks).view(B, -1, n_kv, D)[:, :K].transpose(1, 2)
    mask = None if B == 1 else (torch.arange(K) < context_lens[:, None])[:, None, None]  # (B, 1, 1, K)
    y = F.scaled_dot_product_attention(q.view(B, n_kv, n_heads // n_kv, D), k, v, attn_mask=mask)
    return y.view(B, n_heads, D)  # query head h = kv head h // (n_heads // n_kv), row h % (n_heads // n_kv)


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    """[0..lens[0]), [0..lens[1]), ... concatenated."""
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
