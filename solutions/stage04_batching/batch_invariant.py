"""Batch invariance: a token's logits that do not depend on who else shares its forward pass.

    engine = LLMEngine(model, tokenizer, batch_invariant=True)    # or: serve.py --batch-invariant

In the default engine a request's logits change in their last bits with the batch around it: the
BLAS picks a different matmul kernel for a different number of rows, and attention reduces over a
differently shaped key range. Rounding then differs, and a greedy continuation can fork at a near-tie.
Here every reduction a token's result passes through runs in an order fixed by that token alone:

- linear_tiled: every matmul call gets exactly `tile` rows, so the BLAS sees one shape, whatever the batch;
- split_kv_attention: keys are reduced in fixed splits of `split` positions counted from position 0,
  one product per query, the splits merged in order (FlashDecoding's split-KV with a fixed split size);
- RMSNorm and the softmax of the logprobs already reduce each row on its own on a CPU (lab4.ipynb §1
  measures it), so forward_invariant keeps labkit's.

forward_invariant (given) is engine.forward_paged with those pieces.
"""

import torch
import torch.nn.functional as F

from labkit.model import Llama, apply_rope

from .paged_attention import PagedKVCache

TILE = 16  # rows per matmul call: a decode batch of 16 fills one tile
SPLIT = 128  # key positions per attention split


def linear_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: int = TILE):
    """F.linear(x, weight, bias), computed in calls of exactly `tile` rows each.

    x:      (N, in_features) float32, any N >= 1
    weight: (out_features, in_features); bias: (out_features,) or None
    returns (N, out_features): row i depends on x[i] only, bit for bit: every matmul call this makes has
            `tile` rows (the last tile padded with zero rows), so the BLAS runs the same kernel for it
            whether N is 1 or 500.
    """
    N = len(x)
    padded = F.pad(x, (0, 0, 0, -N % tile))  # (N rounded up to a multiple of tile, in)
    tiles = [F.linear(padded[i : i + tile], weight, bias) for i in range(0, len(padded), tile)]
    return torch.cat(tiles)[:N]


def split_kv_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    split: int = SPLIT,
) -> torch.Tensor:
    """paged_attention's contract (same arguments, same result up to rounding), in an order fixed per query.

    q (N, n_heads, head_dim); k_pool, v_pool (num_blocks, block_size, n_kv_heads, head_dim);
    block_tables (B, max_blocks) int64; context_lens, query_lens (B,) int64 -> (N, n_heads, head_dim).

    Keys are taken in splits of `split` positions, [0, split), [split, 2 split), ..., whatever the batch.
    For each split, each query gets its own score product, its n_rep = n_heads // n_kv_heads heads
    against that split's keys: (n_rep, head_dim) @ (head_dim, split), then (n_rep, split) @ (split, head_dim)
    for the values, so every product has one shape. Keys past the query's position are masked (-inf).
    The splits are merged in order with the online softmax (running max m, denominator l, output acc,
    rescaled by exp(m_old - m_new)), and a split none of whose keys a query sees leaves that query's
    m, l and acc untouched. Scale 1/sqrt(head_dim); GQA head h reads kv head h // n_rep.
    """
    N, H, D = q.shape
    block_size, n_kv = k_pool.shape[1], k_pool.shape[2]
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)  # (N,) each query's sequence
    first = torch.cumsum(query_lens, 0) - query_lens  # (B,) row of each sequence's first query
    pos = (context_lens - query_lens)[seq] + torch.arange(N) - first[seq]  # (N,) each query's position
    tables = block_tables[seq]  # (N, max_blocks)
    k_slots, v_slots = k_pool.view(-1, n_kv, D), v_pool.view(-1, n_kv, D)
    qh = q.view(N, n_kv, H // n_kv, D) * D**-0.5
    m = q.new_full((N, n_kv, H // n_kv, 1), -torch.inf)
    l = q.new_zeros((N, n_kv, H // n_kv, 1))
    acc = q.new_zeros((N, n_kv, H // n_kv, D))
    heads = torch.arange(n_kv)[None, :, None]
    for start in range(0, int(pos.max()) + 1, split):
        live = pos >= start  # the queries that see at least one key of this split
        rows = slice(None) if bool(live.all()) else live.nonzero().flatten()
        keys = start + torch.arange(split)  # (split,) absolute positions
        block = (keys // block_size).clamp(max=tables.shape[1] - 1)  # keys past every context are masked below
        slots = (tables[rows][:, block] * block_size + keys % block_size)[:, None]  # (R, 1, split)
        # Gathered straight into (R, n_kv, split, D), contiguous: a strided view takes another BLAS path for R = 1
        k, v = k_slots[slots, heads], v_slots[slots, heads]
        s = (qh[rows] @ k.mT).masked_fill(
            (keys > pos[rows, None])[:, None, None], -torch.inf
        )  # (R, n_kv, n_rep, split)
        m_new = torch.maximum(m[rows], s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m[rows] - m_new)  # 0 on the first split (m = -inf)
        l[rows] = l[rows] * alpha + p.sum(-1, keepdim=True)
        acc[rows] = acc[rows] * alpha + p @ v
        m[rows] = m_new
    return (acc / l).view(N, H, D)


@torch.inference_mode()
def forward_invariant(
    model: Llama,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """engine.forward_paged (same arguments, same result up to rounding) with every matmul through linear_tiled
    and attention through split_kv_attention: each token's logits are the same bits in any batch."""
    c = model.config
    N = len(input_ids)
    x = model.model.embed_tokens(input_ids)  # (N, hidden)
    cos, sin = model.rope_cos[positions, None], model.rope_sin[positions, None]  # (N, 1, head_dim)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = layer.input_layernorm(x)
        q = linear_tiled(h, attn.q_proj.weight, attn.q_proj.bias).view(N, c.num_attention_heads, c.head_dim)
        k = linear_tiled(h, attn.k_proj.weight, attn.k_proj.bias).view(N, c.num_key_value_heads, c.head_dim)
        v = linear_tiled(h, attn.v_proj.weight, attn.v_proj.bias).view(N, c.num_key_value_heads, c.head_dim)
        q, k = attn.norm_qk(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(i, k, v, slots)
        y = split_kv_attention(q, cache.k[i], cache.v[i], block_tables, context_lens, query_lens)
        x = x + linear_tiled(y.reshape(N, -1), attn.o_proj.weight, attn.o_proj.bias)
        h = layer.post_attention_layernorm(x)
        gate = linear_tiled(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        # SiLU written out: F.silu's vectorized and scalar loops round differently (lab4 §1), and which one a
        # row's last elements take depends on where the tensor ends; exp, division and products do not.
        act = gate / (1 + torch.exp(-gate)) * linear_tiled(h, mlp.up_proj.weight, mlp.up_proj.bias)
        x = x + linear_tiled(act, mlp.down_proj.weight, mlp.down_proj.bias)
    if keep is not None:
        x = x[keep]
    elif N > len(query_lens):
        x = x[torch.cumsum(query_lens, 0) - 1]
    return linear_tiled(model.model.norm(x), model.lm_head.weight).float()
