"""Batch invariance: a token's logits that do not depend on who else shares its forward pass.

    engine = LLMEngine(model, tokenizer, batch_invariant=True)    # or: serve.py --batch-invariant

In the default engine a request's logits change in their last bits with the batch around it: the
BLAS picks a different matmul kernel for a different number of rows, and attention reduces over a
differently shaped key range. Rounding then differs, and a greedy continuation can fork at a near-tie.
Here every reduction a token's result passes through runs in an order fixed by that token alone:

- linear_padded: every matmul has at least `min_rows` rows, so the BLAS runs the one kernel it keeps for
  four rows and more (lab4.ipynb §1 measures the classes), whatever the batch;
- split_kv_attention: keys are summed in fixed splits of `split` positions counted from position 0, the
  splits' partial sums added in order (FlashDecoding's split-KV with a fixed split size), each sequence's
  queries in products of at least `min_rows` rows;
- where the engine runs labkit's kernels (labkit/fast_paged.py), their float32 loop already sums each row
  in one order, one running sum per output, at any row count and thread count: forward_invariant takes
  them there (_linear), and linear_padded elsewhere;
- RMSNorm and the softmax of the logprobs already reduce each row on its own on a CPU (lab4.ipynb §1
  measures it), so forward_invariant keeps labkit's.

forward_invariant (given) is engine.forward_paged with those pieces.
"""

import torch

from labkit.model import Llama, apply_rope

from .paged_attention import PagedKVCache

MIN_ROWS = 8  # rows of the smallest matmul: lab4 §1 measured one BLAS kernel for every M >= 4 here
SPLIT = 64  # key positions per attention split: four blocks of 16


def linear_padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = MIN_ROWS):
    """F.linear(x, weight, bias) in one call of at least `min_rows` rows.

    x:      (N, in_features) float32, any N >= 1
    weight: (out_features, in_features); bias: (out_features,) or None
    returns (N, out_features): row i depends on x[i] only, bit for bit. Fewer than `min_rows` rows are
            padded with zero rows (dropped from the result), so the BLAS never takes the kernels it keeps
            for a few rows (a matrix-vector kernel for one, another for two or three) and every row is
            summed by the same kernel, in the same order, whether N is 1 or 500.
    """
    raise NotImplementedError("stage04: linear_padded — see lab4.ipynb §2")


def split_kv_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    split: int = SPLIT,
    min_rows: int = MIN_ROWS,
) -> torch.Tensor:
    """paged_attention's contract (same arguments, same result up to rounding), in an order fixed per query.

    q (N, n_heads, head_dim); k_pool, v_pool (num_blocks, block_size, n_kv_heads, head_dim);
    block_tables (B, max_blocks) int64; context_lens, query_lens (B,) int64 -> (N, n_heads, head_dim).

    Keys are cut into splits of `split` positions, [0, split), [split, 2 split), ..., whatever the batch.
    A sequence's rows are its n queries' n_rep = n_heads // n_kv_heads heads of each kv head, (n_kv, n * n_rep,
    head_dim), query-major; its keys of all S splits are gathered at once into one contiguous (n_kv, S, split,
    head_dim) tensor (a strided view can take another BLAS path), the block index clamped to the block table's
    last column where a split reaches past it (those keys are masked), so that one batched product takes every
    (kv head, split) pair: rows @ (head_dim, split) for the scores, then
    (rows, split) @ (split, head_dim) for the values. No product has fewer than `min_rows` rows (linear_padded's
    reason): sequences of `short` = ceil(min_rows / n_rep) queries or fewer (decodes) are batched together, each
    padded to `short` queries, and the longer chunks together, each padded to the longest of them (padding
    repeats a chunk's last query). Keys past a row's position are masked (-inf). Softmax: each row's max over all its splits at once (a max is exact
    in any order), then per split the sum of p = exp(s - max) and p @ v, each over exactly `split` keys; the
    splits' sums are added in order, split 0 first. A split that lies past a query (there because another
    sequence is longer) adds exact zeros, so it changes no bit. Scale 1/sqrt(head_dim); GQA head h reads kv
    head h // n_rep.
    """
    raise NotImplementedError("stage04: split_kv_attention — see lab4.ipynb §3")


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
    """engine.forward_paged (same arguments, same result up to rounding) with every matmul through linear_padded
    (or labkit's kernels, see _linear) and attention through split_kv_attention: each token's logits are the
    same bits in any batch."""
    c = model.config
    N = len(input_ids)
    x = model.model.embed_tokens(input_ids)  # (N, hidden)
    cos, sin = model.rope_cos[positions, None], model.rope_sin[positions, None]  # (N, 1, head_dim)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        # fast_paged's two C++ calls a layer, where every pass takes them: norms, RoPE and SwiGLU row by row
        # there too, so a row's bits are its own, and the step costs what the default engine's does
        fused = getattr(layer, "fused", None)
        fused = fused if fused is not None and fused.row_invariant else None
        qkv = fused and fused.qkv(x, cos, sin)
        if qkv is None:
            h = layer.input_layernorm(x)
            q = _linear(attn.q_proj, h).view(N, c.num_attention_heads, c.head_dim)
            k = _linear(attn.k_proj, h).view(N, c.num_key_value_heads, c.head_dim)
            v = _linear(attn.v_proj, h).view(N, c.num_key_value_heads, c.head_dim)
            q, k = attn.norm_qk(q, k)
            qkv = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        q, k, v = qkv
        cache.write(i, k, v, slots)
        y = split_kv_attention(q, cache.k[i], cache.v[i], block_tables, context_lens, query_lens)
        out = fused and fused.out(x, y)
        if out is None:
            x = x + _linear(attn.o_proj, y.reshape(N, -1))
            h = layer.post_attention_layernorm(x)
            gate = _linear(mlp.gate_proj, h)
            # SiLU written out: F.silu's vectorized and scalar loops round differently (lab4 §1), and which one a
            # row's last elements take depends on where the tensor ends; exp, division and products do not.
            act = gate / (1 + torch.exp(-gate)) * _linear(mlp.up_proj, h)
            out = x + _linear(mlp.down_proj, act)
        x = out
    if keep is not None:
        x = x[keep]
    elif N > len(query_lens):
        x = x[torch.cumsum(query_lens, 0) - 1]
    return _linear(model.lm_head, model.model.norm(x)).float()


def _linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) with each row's sums in one order whatever the batch: labkit's kernels already keep one (a
    layer the engine accelerated with row_invariant set: one running sum per output in input order, at any
    row count and thread count, and faster than padding a BLAS call), else linear_padded."""
    if getattr(layer, "row_invariant", False):
        return layer(x)
    return linear_padded(x, layer.weight, layer.bias)
