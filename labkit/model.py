"""The reference Llama-style decoder every stage runs on: RMSNorm, RoPE, GQA, SwiGLU.

One readable file in the spirit of nanoGPT. Module names mirror Hugging Face's `LlamaForCausalLM`,
so `model.state_dict()` has exactly HF's keys and its logits match HF's on the same weights
(tests/meta/test_labkit.py checks this). The relatives learners download add a few named extras
(Config: biases, qk_norm, sliding_window, rope_scaling), each read from config.json the way HF's
modeling file of that family reads it (labkit/model_config.py); anything else is refused
(tests/meta/test_model_families.py). It has an optional contiguous KV cache that can be
truncated, which stages 04, 06 and 07 build on; stage 02 is where the learner writes one.

A decode step does only the work it needs (issue 24): RoPE tables are computed once, a one-token
step builds no mask, the cache is written in place, and grouped-query attention reads the cache
without copying it per query head. q/k/v and gate/up stay separate Linears (HF's layout): stage 03
quantizes and rescales them one by one. The compiled, fused fast path lives beside this file, in
labkit/fast_decode.py.

Running layers one at a time (calibration, Medusa heads, tensor parallelism):

    x, cos, sin, mask = model.layer_inputs(ids)      # what forward hands the first layer
    for layer in model.model.layers:
        x = layer(x, cos, sin, mask)                 # Block.forward(x, cos, sin, mask=None, cache=None, layer=0)
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint
from .model_config import (  # noqa: F401  (read as labkit.model.Config, labkit.model.refuse_extras, ...)
    ARCHITECTURES,
    EXTRAS,
    LLAMA3_KEYS,
    ROPE_TYPES,
    Config,
    family_features,
    refuse_extras,
    rope_from_hf,
    unsupported,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the input dtype, as HF does, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The head_dim/2 rotation frequencies θ^(-2i/head_dim), stretched as `scaling` says.

    linear: every frequency divided by `factor` (position interpolation).
    llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided
    by `factor`, those shorter than ... / high_freq_factor are kept, and the band between is blended.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32, scaling=None):
    """cos, sin of shape (*positions.shape, head_dim) for the half-split (NeoX/HF) pairing.

    scaling: Config.rope_scaling (None for plain RoPE)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(positions.device)
    angles = positions.float()[..., None] * inv_freq  # (..., head_dim/2)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D) or (B, 1, T, D). Dimension i rotates with i + D/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, T, D) -> (B, n_kv * n_rep, T, D); query head h reads kv head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention for GQA without repeat_kv's copy of the cache (a full copy every step).

    The n_rep query heads that share kv head g are stacked as n_rep * T queries of that one head:
    query row r * T + t is query t of head g * n_rep + r, so the (T, S) mask is stacked n_rep times.
    q: (B, H, T, D); k, v: (B, n_kv, S, D); mask: (..., T, S) bool (True = attend) or None -> (B, H, T, D)
    """
    B, H, T, D = q.shape
    n_rep = H // k.shape[1]
    q = q.reshape(B, k.shape[1], n_rep * T, D)
    if mask is not None and n_rep > 1:
        mask = torch.cat([mask] * n_rep, dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(B, H, T, D)


class KVCache:
    """Contiguous per-layer K/V buffers of shape (B, n_kv_heads, max_seq_len, head_dim).

    `length` counts the cached positions; a forward pass writes its T new keys at
    [length, length + T) in every layer and then advances `length` by T.
    """

    def __init__(self, config: Config, batch_size: int, max_seq_len: int, dtype=torch.float32, device=None):
        shape = (batch_size, config.num_key_value_heads, max_seq_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.max_seq_len = max_seq_len
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, n_kv, T, D) after the cached prefix; return all keys/values so far."""
        end = self.length + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: {self.length} cached + {k.shape[2]} new > max_seq_len={self.max_seq_len}. "
                "Create the cache with a larger max_seq_len."
            )
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding rolls back rejected tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3 RMS-normalises every query and key head over head_dim, before RoPE; others pass through.

        q, k: (..., head_dim) in any head layout."""
        if not self.c.qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x: (B, T, hidden); cos, sin: (T, head_dim); mask: (T, S) bool or None; `layer` picks the
        cache's layer. -> (B, T, hidden)"""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = self.norm_qk(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # rotate before caching
        if cache is not None:
            k, v = cache.write(layer, k, v)
        y = grouped_attention(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """One decoder layer. x: (B, T, hidden); cos, sin, mask as Llama.layer_inputs returns them;
        with a cache, `layer` is this layer's index in it (the cache advances in Llama.forward)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def causal_mask(start: int, T: int, window: int | None = None, device=None) -> torch.Tensor | None:
    """(T, start + T) bool, True = attend: query i sits at position start + i and sees keys
    0 .. start + i, or with a sliding window only the last `window` of them. None when nothing is masked."""
    if T == 1 and (window is None or start < window):
        return None
    q = torch.arange(start, start + T, device=device)[:, None]
    k = torch.arange(start + T, device=device)[None, :]
    mask = k <= q
    return mask if window is None else mask & (k > q - window)


class Decoder(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Llama(nn.Module):
    """model(input_ids (B, T) int64, cache=None) -> logits (B, T, vocab) in the weights' dtype;
    model(..., logits_to_keep=n) -> only the last n positions' logits (B, n, vocab), as an engine's prefill
    needs (transformers' argument of the same name): on a 49,152-token vocabulary the LM head over every
    prompt position is a fifth of a 512-token prefill's FLOPs."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # RoPE tables for every position, computed once (not saved: HF checkpoints hold no tables).
        positions = torch.arange(config.max_position_embeddings)
        cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, scaling=config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_position_embeddings, head_dim)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, head_dim) for positions start .. start + T - 1, sliced from the tables.
        Past max_position_embeddings (which HF allows too) they are computed on the fly."""
        if start + T <= self.rope_cos.shape[0]:
            return self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        c = self.config
        positions = torch.arange(start, start + T, device=self.rope_cos.device)
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, self.rope_cos.dtype, c.rope_scaling)

    def layer_inputs(self, input_ids: torch.Tensor, start: int = 0):
        """What forward hands every decoder layer, for running layers one at a time:
        `x = layer(x, cos, sin, mask)` (add `cache, i` to write layer i of a KVCache).

        input_ids: (B, T) int64 at positions start .. start + T - 1 -> x (B, T, hidden) token
        embeddings, cos/sin (T, head_dim), mask (T, start + T) bool causal (and windowed), or None
        when nothing is masked (a one-token step)."""
        T = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(start, T)
        return x, cos, sin, causal_mask(start, T, self.config.sliding_window, x.device)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        T = input_ids.shape[1]
        x, cos, sin, mask = self.layer_inputs(input_ids, cache.length if cache is not None else 0)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.length += T
        return self.lm_head(self.model.norm(x[:, -logits_to_keep:] if logits_to_keep else x))

    def new_cache(self, batch_size: int = 1, max_seq_len: int | None = None) -> KVCache:
        p = next(self.parameters())
        max_seq_len = max_seq_len or self.config.max_position_embeddings
        return KVCache(self.config, batch_size, max_seq_len, p.dtype, p.device)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
        """Greedy decoding with the KV cache; returns only the new tokens."""
        cache = self.new_cache(1, len(prompt) + max_new_tokens)
        logits = self(torch.tensor([prompt]), cache)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if stop_at_eos and token == self.config.eos_token_id:
                break
            logits = self(torch.tensor([[token]]), cache)
        return out

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: Llama, seed: int = 0, std: float = 0.02) -> Llama:
    """Normal(0, std) linears and embeddings, ones for norms, zero biases; residual outputs scaled by depth."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        elif name.endswith(".bias"):
            nn.init.zeros_(p)
        else:
            scale = (
                std / math.sqrt(2 * model.config.num_hidden_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Llama:
    """Load an HF folder of a supported family (ARCHITECTURES), strictly: a config field the model
    does not implement, a missing tensor, a wrong shape, or a tensor nothing reads is an error."""
    config = Config.from_hf(checkpoint.read_config(path, family="llama"))
    checkpoint.check_fits(path, num_params(config), dtype)
    state = checkpoint.load_state_dict(path)
    model = Llama(config)  # first: the checks read its shapes (a meta build would cost a second, below)
    checkpoint.check_state(state, expected_shapes(config, model), config.tie_word_embeddings, path)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def expected_shapes(config: Config, model: Llama | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of `config` holds, with its shape, read off `model` (a Llama of
    `config`) or else one built on the meta device (no memory, but the embedding's normal_ on a meta
    tensor imports torch._dynamo: a second or two, once per process). A tied lm_head.weight is left
    out, as save_pretrained leaves it out."""
    if model is None:
        with torch.device("meta"):
            model = Llama(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def num_params(c: Config) -> int:
    """Parameter count implied by a Config, without building the model (for the memory check)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = c.hidden_size * (2 * q + 2 * kv) + (q + 2 * kv) * c.attention_bias + c.hidden_size * c.o_proj_bias
    mlp = 3 * c.hidden_size * c.intermediate_size + (2 * c.intermediate_size + c.hidden_size) * c.mlp_bias
    norms = 2 * c.hidden_size + 2 * c.head_dim * c.qk_norm
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * (attn + mlp + norms) + embeddings + c.hidden_size


def save(model: Llama, path: str | os.PathLike, extra_files=(), dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `model` as an HF folder that `AutoModelForCausalLM.from_pretrained` loads."""
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    checkpoint.save(path, hf, state, extra_files)
