"""Multi-head Latent Attention (DeepSeek-V2/V3): cache one small latent per token, not per-head K and V.

Each token is compressed to a latent c_kv (kv_lora_rank wide, RMS-normalised) plus one RoPE key
k_pe (qk_rope_head_dim wide) shared by every head; those two vectors are all the cache holds.
The per-head keys and values are linear in c_kv (W_UK, W_UV = the two halves of kv_b_proj), so
decode can fold W_UK into the query and W_UV into the output and attend over the latent directly:
the "absorbed" form, which never builds per-head K or V.

The weights and the unchanged parts of the model (embeddings, RMSNorms, MLPs, lm_head) come from
a transformers `DeepseekV3ForCausalLM` (dense MLPs: first_k_dense_replace = num_hidden_layers);
the attention and its cache are yours. Shapes: B batch, T new tokens, S cached + new tokens,
H heads, r = kv_lora_rank, n = qk_nope_head_dim, p = qk_rope_head_dim, v = v_head_dim.
"""

import torch

from labkit.model import rope_cos_sin

from .kv_cache import LayerStack


def rope(x: torch.Tensor, positions: torch.Tensor, config) -> torch.Tensor:
    """Rotate x (..., T, p) by positions (T,) int64, DeepSeek's way (given).

    rope_interleave=True (DeepSeek's checkpoints) pairs dimensions (2i, 2i+1) and returns the
    rotated evens then the rotated odds, as transformers does; queries and keys get the same
    layout, so their dot products are those of the interleaved rotation. False: half-split pairing.
    """
    rope_params = config.rope_parameters or {}
    if rope_params.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_type={rope_params['rope_type']!r} (YaRN scaling) is not implemented here; "
            "use a config with rope_parameters={'rope_type': 'default', 'rope_theta': ...}."
        )
    cos, sin = rope_cos_sin(positions, x.shape[-1], rope_params.get("rope_theta", 10_000.0), x.dtype)
    if config.rope_interleave:
        half = x.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def split_kv_b(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight (H·(n + v), r) as W_UK (H, n, r) and W_UV (H, v, r) (given): views, no copy.

    Head h's key (no-RoPE part) is W_UK[h] @ c_kv and its value is W_UV[h] @ c_kv.
    """
    c = attn.config
    w = attn.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]


def project_q(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query path: x (B, T, hidden) -> q_nope (B, H, T, n), q_pe (B, H, T, p), before RoPE.

    With q_lora_rank set the query is low-rank: q_b_proj(q_a_layernorm(q_a_proj(x)));
    with q_lora_rank None it is one q_proj. Each head's n + p outputs are [nope | rope].
    """
    raise NotImplementedError("stage02: project_q — see lab2.ipynb §2")


def project_kv_latent(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed KV path: x (B, T, hidden) -> c_kv (B, T, r), k_pe (B, T, p), before RoPE.

    kv_a_proj_with_mqa outputs [latent | rope key]; the latent goes through kv_a_layernorm,
    the rope key (one for all heads, hence "with_mqa") does not.
    """
    raise NotImplementedError("stage02: project_kv_latent — see lab2.ipynb §3")


class MLALayerCache:
    """The latent cache of one layer: c_kv (B, max_seq_len, r) and k_pe (B, max_seq_len, p), `length` valid.

    Per token it holds r + p numbers, against 2·H·head_dim for multi-head attention.
    """

    def __init__(self, batch: int, max_seq_len: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype=torch.float32):
        self.c_kv = torch.zeros(batch, max_seq_len, kv_lora_rank, dtype=dtype)
        self.k_pe = torch.zeros(batch, max_seq_len, qk_rope_head_dim, dtype=dtype)
        self.max_seq_len = max_seq_len
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.c_kv.nbytes + self.k_pe.nbytes

    def append(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write c_kv (B, T, r) and the rotated k_pe (B, T, p) at slots [length, length + T).

        Returns the valid prefixes c_kv (B, S, r), k_pe (B, S, p), views of the buffers.
        Raises ValueError, before writing, if the T new tokens do not fit.
        """
        raise NotImplementedError("stage02: MLALayerCache.append — see lab2.ipynb §3")


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores (B, H, T, S), with mask (T, S) bool (True = attend) or None (given)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def attend_expanded(attn, q_nope, q_pe, c_kv, k_pe, mask) -> torch.Tensor:
    """Attention the naive way: expand the latent into per-head keys and values.

    q_nope (B, H, T, n), q_pe (B, H, T, p) rotated; c_kv (B, S, r); k_pe (B, S, p) rotated;
    mask (T, S) bool (True = attend) or None. Key of head h = [W_UK[h] c_kv | k_pe],
    value = W_UV[h] c_kv, scale attn.scaling. Returns (B, T, H·v), heads concatenated.
    """
    raise NotImplementedError("stage02: attend_expanded — see lab2.ipynb §4")


def attend_absorbed(attn, q_nope, q_pe, c_kv, k_pe, mask) -> torch.Tensor:
    """The same attention with W_UK folded into the query and W_UV into the output.

    q_nope·(W_UK c_kv) = (W_UKᵀ q_nope)·c_kv, so each head's query moves into the latent space
    (B, H, T, r) and scores against c_kv directly; the weighted sum of latents (B, H, T, r) then
    goes through W_UV. Same arguments and result as attend_expanded; nothing of size
    H × S × (n or v) is ever built (the structural test checks), nor an H-fold copy of c_kv,
    which `q_latent @ c_kv[:, None]` makes by broadcasting: contract with torch.einsum.
    """
    raise NotImplementedError("stage02: attend_absorbed — see lab2.ipynb §5")


def mla_block(attn, x: torch.Tensor, positions: torch.Tensor, mask, cache=None, absorbed: bool = False):
    """One MLA layer: x (B, T, hidden) normalised -> (B, T, hidden).

    positions (T,) int64 absolute positions; mask (T, S) bool or None; cache an MLALayerCache or None.
    q_pe and k_pe are rotated before k_pe is cached (a cached key is never rotated again);
    the cache stores only c_kv and k_pe. absorbed picks attend_absorbed over attend_expanded.
    """
    raise NotImplementedError("stage02: mla_block — see lab2.ipynb §4")


class MLACache(LayerStack):
    """One MLALayerCache per decoder layer (given)."""

    def __init__(self, config, batch: int, max_seq_len: int, dtype=torch.float32):
        self.layers = [
            MLALayerCache(batch, max_seq_len, config.kv_lora_rank, config.qk_rope_head_dim, dtype)
            for _ in range(config.num_hidden_layers)
        ]


@torch.no_grad()
def forward(model, input_ids: torch.Tensor, cache: MLACache | None = None, absorbed: bool = False) -> torch.Tensor:
    """Logits (B, T, vocab) of a transformers DeepseekV3ForCausalLM with your attention (given).

    input_ids (B, T) follow what `cache` holds. Query i sits at position start + i and sees keys
    0 .. start + i; a single decode query sees every cached key, so it needs no mask.
    """
    T = input_ids.shape[1]
    start = 0 if cache is None else cache.length
    positions = torch.arange(start, start + T)
    mask = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
    x = model.model.embed_tokens(input_ids)
    for i, layer in enumerate(model.model.layers):
        layer_cache = None if cache is None else cache.layers[i]
        x = x + mla_block(layer.self_attn, layer.input_layernorm(x), positions, mask, layer_cache, absorbed)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


def kv_bytes_per_token(config, dtype_bytes: float = 2) -> int:
    """Bytes one more token adds to one request's cache, for any of the four attention kinds.

    MLA (config has kv_lora_rank): every layer caches c_kv and k_pe, (r + p) numbers.
    MHA, GQA, MQA (num_key_value_heads = heads, fewer, 1): every layer caches K and V,
    2 · num_key_value_heads · head_dim numbers. DeepSeek-V3 in bf16: 61 · 576 · 2 = 70,272.
    """
    raise NotImplementedError("stage02: kv_bytes_per_token — see lab2.ipynb §1")


def expanded_bytes_per_token(config, dtype_bytes: float = 2) -> int:
    """Bytes per token if an MLA model cached its expanded per-head K and V instead of the latent.

    Each of the H heads caches a key of n + p and a value of v numbers in every layer.
    """
    raise NotImplementedError("stage02: expanded_bytes_per_token — see lab2.ipynb §1")
