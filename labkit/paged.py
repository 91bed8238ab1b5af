"""A small paged KV store and a ragged batched forward of labkit.model's Llama over it.

Stage 06 part 2 runs speculative decoding inside a batching engine without depending on stage 04:
this module is the given part of such an engine. KV lives in fixed-size blocks of one pool; each
sequence owns a block table (its blocks, in order) and a length. A sequence's positions
[0, length) sit in its blocks, position p at slot block_table[p // block_size] * block_size +
p % block_size. Shortening a sequence (rejected drafts) frees the blocks it no longer needs, so
"blocks in use" is always exactly what the cached tokens need: a leak is checkable.

This is deliberately the plain version: no prefix sharing, no scheduling, no eviction policy
(stage 04 is where those are built). forward() packs the batch's new tokens into one matrix for the
linear layers and gathers each sequence's K/V from its slots for attention, a copy a fused paged kernel
avoids.
"""

import torch

from .model import Llama, apply_rope, grouped_attention, refuse_extras, rope_cos_sin


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

    The batch is packed, not padded: its N = sum(T_i) new tokens go through every linear layer as one
    (N, hidden) matrix, so a 512-token prefill chunk beside 15 decodes costs 527 rows, not 16 x 512.
    Attention is the only per-sequence part (batch_attention).
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
    starts = [store.length(s) for s in seq_ids]  # cached before this pass
    sizes = [len(t) for t in chunks]
    N = sum(sizes)
    ids = torch.tensor([[t for chunk in chunks for t in chunk]], device=dev)  # (1, N): every new token, packed
    positions = torch.cat([torch.arange(a, a + n, device=dev) for a, n in zip(starts, sizes, strict=True)])[None]
    reads = [slots(store, s, a + n) for s, a, n in zip(seq_ids, starts, sizes, strict=True)]  # each (start + T_i,)
    write_slots = torch.cat([r[a:] for r, a in zip(reads, starts, strict=True)])  # (N,): the new positions' slots
    attention = batch_attention(store, reads, starts, sizes)

    x = model.model.embed_tokens(ids)  # (1, N, hidden)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    cos, sin = cos[:, None], sin[:, None]  # (1, 1, N, D)
    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn
        h = block.input_layernorm(x)
        q = attn.q_proj(h).view(1, N, c.num_attention_heads, c.head_dim).transpose(1, 2)  # (1, H, N, D)
        k = attn.k_proj(h).view(1, N, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(1, N, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = attn.norm_qk(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store.k[layer][write_slots] = k[0].transpose(0, 1)  # (N, n_kv, D)
        store.v[layer][write_slots] = v[0].transpose(0, 1)
        y = attention(layer, q)  # (1, H, N, D)
        x = x + attn.o_proj(y.transpose(1, 2).reshape(1, N, -1))
        x = x + block.mlp(block.post_attention_layernorm(x))
    for s, a, n in zip(seq_ids, starts, sizes, strict=True):
        store.lengths[s] = a + n
    logits = model.lm_head(model.model.norm(x))[0].float()  # (N, vocab)
    return list(logits.split(sizes))


def slots(store: PagedKVStore, seq_id: int, length: int) -> torch.Tensor:
    """(length,) the slots of positions [0, length) of a sequence, from its block table."""
    table = torch.tensor(store.block_tables[seq_id], device=store.k[0].device)
    p = torch.arange(length, device=table.device)
    return table[p // store.block_size] * store.block_size + p % store.block_size


def batch_attention(store: PagedKVStore, reads: list[torch.Tensor], starts: list[int], sizes: list[int]):
    """attention(layer, q) -> y for forward: q, y (1, H, N, D) with the sequences' tokens packed in order.

    A sequence of several new tokens (a prefill chunk, drafts) attends alone, causally, over its own slots.
    The one-token sequences (decodes) attend together, their keys gathered into one (B, n_kv, L, D) tensor
    padded to the longest context and masked: one call for all of them instead of one each.
    """
    dev = store.k[0].device
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    one = [i for i, n in enumerate(sizes) if n == 1]
    rows = torch.tensor([offsets[i] for i in one], device=dev)  # the decodes' rows among the N
    width = max((len(reads[i]) for i in one), default=0)
    padded = torch.zeros(len(one), width, dtype=torch.long, device=dev)  # padding reads slot 0, masked out
    for j, i in enumerate(one):
        padded[j, : len(reads[i])] = reads[i]
    key_pad = torch.arange(width, device=dev) < torch.tensor([len(reads[i]) for i in one], device=dev)[:, None]
    key_pad = key_pad[:, None, None, :]  # (B, 1, 1, L)
    causal = {  # query t of a chunk sits at position start + t and sees keys [0, start + t]
        i: torch.arange(a + n, device=dev)[None, :] <= torch.arange(a, a + n, device=dev)[:, None]
        for i, (a, n) in enumerate(zip(starts, sizes, strict=True))
        if n > 1
    }

    def attention(layer: int, q: torch.Tensor) -> torch.Tensor:
        k, v = store.k[layer], store.v[layer]
        y = torch.empty_like(q)
        if one:
            keys, values = (t[padded].permute(0, 2, 1, 3) for t in (k, v))  # (B, n_kv, L, D)
            y[0, :, rows] = grouped_attention(q[0, :, rows, None].transpose(0, 1), keys, values, key_pad)[
                :, :, 0
            ].transpose(0, 1)
        for i, mask in causal.items():
            o, n = offsets[i], sizes[i]
            keys, values = (t[reads[i]].transpose(0, 1)[None] for t in (k, v))  # (1, n_kv, L_i, D)
            y[:, :, o : o + n] = grouped_attention(q[:, :, o : o + n], keys, values, mask)
        return y

    return attention
