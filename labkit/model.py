"""The reference Llama-style decoder every stage runs on: RMSNorm, RoPE, GQA, SwiGLU.

One readable file in the spirit of nanoGPT. Module names mirror Hugging Face's `LlamaForCausalLM`,
so `model.state_dict()` has exactly HF's keys and its logits match HF's on the same weights
(tests/meta/test_labkit.py checks this). It has an optional contiguous KV cache that can be
truncated, which stages 04, 06 and 07 build on; stage 02 is where the learner writes one.
"""

import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint


@dataclass
class Config:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    @classmethod
    def from_hf(cls, hf: dict) -> "Config":
        """From a Llama config.json dict (5.x keeps θ in rope_parameters; 4.x at the top level)."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in hf.items() if k in known and v is not None}
        kw.setdefault("num_key_value_heads", hf["num_attention_heads"])
        kw.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise checkpoint.CheckpointError(
                f"rope_type={rope['rope_type']!r} scaling is not implemented by labkit.model; "
                "use a checkpoint with default RoPE."
            )
        kw["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", cls.rope_theta))
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    def to_hf(self) -> dict:
        """A config.json dict that transformers reads as a LlamaForCausalLM."""
        d = asdict(self)
        theta = d.pop("rope_theta")
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            torch_dtype="bfloat16",
        )
        return d


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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos, sin of shape (*positions.shape, head_dim) for the half-split (NeoX/HF) pairing."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
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
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # rotate before caching
        if cache is not None:
            k, v = cache.write(layer, k, v)
        n_rep = c.num_attention_heads // c.num_key_value_heads
        y = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Llama(nn.Module):
    """model(input_ids (B, T) int64, cache=None) -> logits (B, T, vocab) in the weights' dtype."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        # Query i sits at absolute position start + i and sees keys 0 .. start + i.
        mask = None
        if T > 1:
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.length += T
        return self.lm_head(self.model.norm(x))

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

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            shapes.pop("lm_head.weight")  # save_pretrained drops the tied copy
        return shapes


def init_weights(model: Llama, seed: int = 0, std: float = 0.02) -> Llama:
    """Normal(0, std) linears and embeddings, ones for norms; residual outputs scaled by depth."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            nn.init.ones_(p)
        else:
            scale = (
                std / math.sqrt(2 * model.config.num_hidden_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Llama:
    """Load a Llama-family HF folder (the tiny assets, or any real checkpoint with default RoPE)."""
    config = Config.from_hf(checkpoint.read_config(path, family="llama"))
    model = Llama(config)
    state = checkpoint.load_state_dict(path)
    checkpoint.check_shapes(state, model.expected_shapes(), path)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False)
    return model.to(dtype).eval()


def save(model: Llama, path: str | os.PathLike, extra_files=(), dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `model` as an HF folder that `AutoModelForCausalLM.from_pretrained` loads."""
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    checkpoint.save(path, hf, state, extra_files)
