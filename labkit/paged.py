"""A small paged KV store and a ragged batched forward of labkit.model's Llama over it.

Stage 06 part 2 runs speculative decoding inside a batching engine without depending on stage 04:
this module is the given part of such an engine. KV lives in fixed-size blocks of one pool; each
sequence owns a block table (its blocks, in order) and a length. A sequence's positions
[0, length) sit in its blocks, position p at slot block_table[p // block_size] * block_size +
p % block_size. Shortening a sequence (rejected drafts) frees the blocks it no longer needs, so
"blocks in use" is always exactly what the cached tokens need: a leak is checkable.

This is deliberately the plain version: no prefix sharing, no scheduling, no eviction policy
(stage 04 is where those are built). forward() gathers each sequence's K/V into a padded
(B, n_kv, L, D) tensor and masks the padding, which costs a copy a fused paged kernel avoids.
"""

import torch
import torch.nn.functional as F

from .model import Llama, apply_rope, refuse_extras, repeat_kv, rope_cos_sin


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks; nothing was allocated (the caller may preempt and retry)."""


class PagedKVStore:
    """A block pool shared by many sequences, each with its own block table and length.

    k[layer], v[layer]: (num_blocks * block_size, n_kv_heads, head_dim) — one row per slot.
    """

    def __init__(self, model: Llama, num_blocks: int, block_size: int):
        c = model.config
        refuse_extras(
            c, "labkit.paged", supported=("attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "rope_scaling")
        )
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        p = next(model.parameters())
        shape = (num_blocks * block_size, c.num_key_value_heads, c.head_dim)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(c.num_hidden_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def blocks_needed(self, length: int) -> int:
        """Blocks that `length` cached positions occupy: ceil(length / block_size)."""
        return -(-length // self.block_size)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def length(self, seq_id: int) -> int:
        """Cached positions of a sequence (0 for one the store has not seen)."""
        return self.lengths.get(seq_id, 0)

    def grow(self, seq_id: int, length: int) -> None:
        """Make room for positions [0, length) of seq_id; OutOfBlocks (allocating nothing) if the pool is short."""
        table = self.block_tables.setdefault(seq_id, [])
        self.lengths.setdefault(seq_id, 0)
        missing = self.blocks_needed(length) - len(table)
        if missing > len(self.free_blocks):
            raise OutOfBlocks(f"sequence {seq_id} needs {missing} more blocks, {len(self.free_blocks)} are free")
        table += [self.free_blocks.pop() for _ in range(max(missing, 0))]

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget positions [length, ...) of seq_id and return the blocks they no longer need to the pool."""
        if not 0 <= length <= self.length(seq_id):
            raise ValueError(f"cannot truncate sequence {seq_id} of length {self.length(seq_id)} to {length}")
        table = self.block_tables[seq_id]
        keep = self.blocks_needed(length)
        self.free_blocks += reversed(table[keep:])
        del table[keep:]
        self.lengths[seq_id] = length

    def free(self, seq_id: int) -> None:
        """Drop a sequence and all its blocks (it finished, or it was preempted)."""
        if seq_id in self.block_tables:
            self.truncate(seq_id, 0)
            del self.block_tables[seq_id], self.lengths[seq_id]


@torch.inference_mode()
def forward(model: Llama, store: PagedKVStore, seq_ids: list[int], chunks: list[list[int]]) -> list[torch.Tensor]:
    """One forward pass over a ragged batch: sequence seq_ids[i] reads the new tokens chunks[i]
    after its cached positions, whose K/V are appended to the store.

    chunks[i]: a list of T_i >= 1 token ids (T_i may differ: a prefill, one decode token, drafts)
    returns    [logits (T_i, vocab) float32 for each sequence], equal to model(whole sequence)'s last T_i rows.
    Raises OutOfBlocks before computing anything if the pool cannot hold the new positions.
    """
    if len(seq_ids) != len(chunks) or any(len(t) == 0 for t in chunks):
        raise ValueError("forward needs one non-empty chunk of token ids per sequence id")
    missing = sum(
        store.blocks_needed(store.length(s) + len(t)) - len(store.block_tables.get(s, []))
        for s, t in zip(seq_ids, chunks, strict=True)
    )
    if missing > len(store.free_blocks):
        raise OutOfBlocks(f"this pass needs {missing} more blocks, {len(store.free_blocks)} are free")
    for sid, chunk in zip(seq_ids, chunks, strict=True):
        store.grow(sid, store.length(sid) + len(chunk))
    c, dev = model.config, store.k[0].device
    B, T = len(chunks), max(len(t) for t in chunks)
    starts = torch.tensor([store.length(s) for s in seq_ids], device=dev)  # (B,) cached before this pass
    sizes = torch.tensor([len(t) for t in chunks], device=dev)
    L = int((starts + sizes).max())
    ids = torch.tensor([t + [0] * (T - len(t)) for t in chunks], device=dev)  # (B, T), padded with token 0
    positions = starts[:, None] + torch.arange(T, device=dev)  # (B, T)
    real = torch.arange(T, device=dev) < sizes[:, None]  # (B, T): False on padding
    # (B, max blocks) block tables padded with block 0; a slot is table[p // block_size] * block_size + p % block_size
    tables = [store.block_tables[s] for s in seq_ids]
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)
    bs = store.block_size
    query_pos = positions.clamp(max=width * bs - 1)  # padded queries may point past the table; they are not written
    write_slots = (tables.gather(1, query_pos // bs) * bs + query_pos % bs)[real]  # (sum T_i,)
    key_pos = torch.arange(L, device=dev)
    read_slots = tables[:, key_pos // bs] * bs + key_pos % bs  # (B, L): past a sequence's end, masked
    mask = key_pos[None, None, :] <= positions[:, :, None]  # (B, T, L) causal; padded keys lie beyond every real query
    mask[:, :, 0] = True  # a padded query row would see nothing (NaN); it reads key 0 and is dropped
    mask = mask[:, None]  # (B, 1, T, L), broadcast over heads

    x = model.model.embed_tokens(ids)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn
        h = block.input_layernorm(x)
        q = attn.q_proj(h).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = attn.norm_qk(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store.k[layer][write_slots] = k.transpose(1, 2)[real]  # (sum T_i, n_kv, D), padding not written
        store.v[layer][write_slots] = v.transpose(1, 2)[real]
        keys = store.k[layer][read_slots].transpose(1, 2)  # (B, n_kv, L, D)
        values = store.v[layer][read_slots].transpose(1, 2)
        n_rep = c.num_attention_heads // c.num_key_value_heads
        y = F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask)
        x = x + attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        x = x + block.mlp(block.post_attention_layernorm(x))
    for s, e in zip(seq_ids, (starts + sizes).tolist(), strict=True):
        store.lengths[s] = e
    logits = model.lm_head(model.model.norm(x)).float()
    return [logits[i, : len(chunk)] for i, chunk in enumerate(chunks)]
