"""Paged KV storage and the attention that reads it through block tables.

Token p of a sequence lives in physical block block_table[p // block_size] at offset p % block_size,
i.e. in "slot" block_table[p // block_size] * block_size + p % block_size of the flattened pool.
"""

import torch

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
        raise NotImplementedError("stage04: PagedKVCache.write — see lab.ipynb §2")

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
    raise NotImplementedError("stage04: slot_mapping — see lab.ipynb §2")


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
    raise NotImplementedError("stage04: paged_attention — see lab.ipynb §2")
