"""A context-parallel prefill of labkit's Llama: each rank runs every layer on its own share of the positions.

Everything but attention is per position (embedding, norms, projections, MLP, LM head), so a rank computes it
for its positions alone. Attention is the one place positions meet: ring.ring_attention. Each rank keeps the
keys and values of its own positions, in every layer: its KV cache is 1/p of the prompt's.

    out = cp_prefill(model, ids, scheme="zigzag")    # on every rank of a process group
    out["positions"], out["logits"]                  # this rank's positions and their logits (T_r, vocab)
"""

import statistics
import time

import torch
import torch.distributed as dist

from labkit.model import Llama, apply_rope, from_pretrained, refuse_extras, rope_cos_sin

from . import ring

SUPPORTED = ("attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "rope_scaling")


def cp_attention(attn, x, cos, sin, positions, cache: list, timeout_s: float) -> torch.Tensor:
    """One layer's self-attention on this rank's positions. attn: a labkit Attention; x: (1, T_r, hidden) after
    the input norm; cos, sin: (T_r, head_dim) of this rank's positions. Appends (k, v) to `cache`."""
    B, T, _ = x.shape
    c = attn.c
    q = attn.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    q, k = attn.norm_qk(q, k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.append((k, v))
    y = ring.ring_attention(q, k, v, positions, timeout_s)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))


@torch.no_grad()
def cp_prefill(
    model: Llama, ids: torch.Tensor, scheme: str = "contiguous", timeout_s: float = 60.0, logits: bool = True
) -> dict:
    """This rank's share of a prefill of ids (T,) int64 over the process group's p ranks (every rank calls it).

    Returns {"positions": (T_r,) int64 this rank's positions (ring.split_positions), "logits": (T_r, vocab)
    float32 their logits (None when logits=False), "kv_bytes": bytes of the keys and values this rank keeps}.
    """
    c, T = model.config, ids.shape[0]
    refuse_extras(c, "stage07's context-parallel prefill", SUPPORTED, max_len=T)
    positions = ring.split_positions(T, dist.get_world_size(), scheme)
    mine = positions[dist.get_rank()]
    x = model.model.embed_tokens(ids[mine][None])  # (1, T_r, hidden)
    cos, sin = rope_cos_sin(mine, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    cache = []
    for layer in model.model.layers:
        x = x + cp_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, positions, cache, timeout_s)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    kv_bytes = sum(t.numel() * t.element_size() for kv in cache for t in kv)
    out = model.lm_head(model.model.norm(x))[0] if logits else None
    return {"positions": mine, "logits": out, "kv_bytes": kv_bytes}


def prefill_worker(folder: str, ids: torch.Tensor, scheme: str, repeats: int = 1, logits: bool = False) -> dict:
    """What the handout and the benchmark run on every rank: the model in `folder`, cp_prefill of ids `repeats`
    times after a warm-up. Returns cp_prefill's dict (the last run's) with "seconds" (the median run, between two
    barriers) and "sent_bytes" (what this rank's isends carried in one run)."""
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda self: None  # overwritten anyway
    model = from_pretrained(folder)
    sent, isend = [0], dist.isend

    def counted(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    dist.isend = counted
    times = []
    for _ in range(repeats + 1):
        sent[0] = 0
        dist.barrier()
        t0 = time.perf_counter()
        out = cp_prefill(model, ids, scheme, timeout_s=300, logits=logits)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {**out, "seconds": statistics.median(times[1:] or times), "sent_bytes": sent[0]}
