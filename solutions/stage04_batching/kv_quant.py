"""A KV cache stored at one byte per element (part 3, lab5.ipynb): vLLM's `--kv-cache-dtype fp8_e4m3 | int8`.

A decode step reads every cached key and value of the batch, so at long context the pool's bytes are
the step's cost and the pool's size is how many chats fit. One byte per element instead of float32's
four holds 4x the tokens in the same memory. The values are rounded on the way in (quantize-on-write,
in QuantizedKVCache.write) and widened back to float32 for the attention that reads them
(dequantize-on-read, in QuantizedKVCache.read).

    fp8_e4m3  float8 e4m3 (4 exponent bits, 3 mantissa bits, largest 448) times a float32 scale per
              layer and kv head (or one per layer: per_head=False), fixed at the layer's first write
              as vLLM's calculate_kv_scales does; a float keeps ~2 significant digits whatever the size.
    int8      round(x / scale) in [-127, 127], one scale per token and kv head (absmax / 127): exact
              steps of scale, so one outlier channel coarsens every other channel of its token and head.
"""

import torch

from labkit.model import Config

from .paged_attention import PagedKVCache

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127  # symmetric: -127 .. 127, so that -x rounds to -round(x)
# The fp8 scale is fixed at a layer's first write (a prompt); later tokens may be larger. e4m3 keeps its
# relative precision down to 2^-6 * scale, so 2x of room costs only the tiniest values' precision.
FP8_HEADROOM = 2.0


def fp8_scale(x: torch.Tensor, per_head: bool = True) -> torch.Tensor:
    """The float8 e4m3 scale that maps x's largest magnitude onto FP8_MAX.

    x:       (N, n_kv_heads, head_dim) float32, keys or values of N tokens
    returns  (n_kv_heads,) float32: absmax(x[:, h]) / FP8_MAX for each kv head h, or with per_head=False
             the absmax over every head, the same scale repeated for each head (a per-tensor scale).
             A scale of 0 (all-zero x) is returned as 1.0, so that dividing by it stays finite.
    """
    amax = x.abs().amax(dim=(0, 2))  # (n_kv,)
    if not per_head:
        amax = amax.max().expand_as(amax).clone()
    scale = amax / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to float8 e4m3 (round to nearest even), saturating at +-FP8_MAX.

    x:       (N, n_kv_heads, head_dim) float32
    scale:   (n_kv_heads,) float32, one per kv head (fp8_scale)
    returns  (N, n_kv_heads, head_dim) torch.float8_e4m3fn: dequantize(q, scale) ~= x, each element within
             half a step of e4m3 (a relative 2^-4) of x once x / scale is inside +-FP8_MAX
    """
    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per token and kv head.

    x:       (N, n_kv_heads, head_dim) float32
    returns  q (N, n_kv_heads, head_dim) int8 = round(x / scale) (round half to even, torch.round),
             scale (N, n_kv_heads) float32 = absmax over head_dim / INT8_MAX (1.0 where that absmax is 0):
             every element of dequantize(q, scale) within scale / 2 of x
    """
    amax = x.abs().amax(dim=-1)  # (N, n_kv)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of quantized codes: q times its scale.

    q:       (..., n_kv_heads, head_dim) float8_e4m3fn or int8
    scale:   (n_kv_heads,) for fp8 (one per head), or q's shape without head_dim for int8 (one per token and head)
    returns  (..., n_kv_heads, head_dim) float32
    """
    return q.to(torch.float32) * scale[..., None]


def bytes_per_token(config: Config, kv_cache_dtype: str = "auto") -> int:
    """Pool bytes one cached token takes over all layers, keys and values, scales included (float32 for auto)."""
    n_kv, d = config.num_key_value_heads, config.head_dim
    per_layer = {"auto": 4 * n_kv * d, "fp8_e4m3": n_kv * d, "int8": n_kv * d + 4 * n_kv}[kv_cache_dtype]
    return 2 * config.num_hidden_layers * per_layer


class QuantizedKVCache(PagedKVCache):
    """PagedKVCache's pools at one byte per element: quantized on write, widened to the model's dtype on read. Given code.

    k[layer], v[layer]:   (num_blocks, block_size, n_kv_heads, head_dim) float8_e4m3fn or int8
    int8:  k_scales[layer], v_scales[layer] (num_blocks, block_size, n_kv_heads) float32, one per token and head
    fp8:   k_scale[layer], v_scale[layer] (n_kv_heads,) float32, set by the layer's first write (None before;
           set them yourself before the first step to fix them, as a checkpoint's calibrated scales are)
    """

    def __init__(
        self, config: Config, num_blocks: int, block_size: int, kv_cache_dtype: str, per_head: bool = True, dtype=None
    ):
        if kv_cache_dtype not in ("fp8_e4m3", "int8"):
            raise ValueError(f"QuantizedKVCache stores fp8_e4m3 or int8, not {kv_cache_dtype!r}")
        self.kv_cache_dtype, self.per_head = kv_cache_dtype, per_head
        self.dtype = dtype or torch.float32  # the model's: what read() widens to
        L, shape = config.num_hidden_layers, (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        store = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.int8
        self.k = [torch.zeros(shape, dtype=store) for _ in range(L)]
        self.v = [torch.zeros(shape, dtype=store) for _ in range(L)]
        self.k_scale: list[torch.Tensor | None] = [None] * L
        self.v_scale: list[torch.Tensor | None] = [None] * L
        if kv_cache_dtype == "int8":
            self.k_scales = [torch.ones(shape[:-1]) for _ in range(L)]
            self.v_scales = [torch.ones(shape[:-1]) for _ in range(L)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """PagedKVCache.write's contract, each value rounded to the pool's format on the way in."""
        n_kv, d = k.shape[1:]
        for x, pool, scales, fixed in (
            (k, self.k, getattr(self, "k_scales", None), self.k_scale),
            (v, self.v, getattr(self, "v_scales", None), self.v_scale),
        ):
            if self.kv_cache_dtype == "int8":
                codes, scales[layer].view(-1, n_kv)[slot_mapping] = quantize_int8(x)
            else:
                if fixed[layer] is None:
                    fixed[layer] = fp8_scale(x, self.per_head) * FP8_HEADROOM
                codes = quantize_fp8(x, fixed[layer])
            pool[layer].view(-1, n_kv, d)[slot_mapping] = codes

    def read(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks `block_tables` lists, dequantized (to the model's dtype), and the tables renumbered into them:
        paged_attention then runs on float32 as it does on the float32 pool. A fused kernel (vLLM's,
        FlashInfer's) widens each block in registers instead of through this copy."""
        used, tables = torch.unique(block_tables, return_inverse=True)
        if self.kv_cache_dtype == "int8":
            k = dequantize(self.k[layer][used], self.k_scales[layer][used])
            v = dequantize(self.v[layer][used], self.v_scales[layer][used])
        else:
            k = dequantize(self.k[layer][used], self.k_scale[layer])
            v = dequantize(self.v[layer][used], self.v_scale[layer])
        return k.to(self.dtype), v.to(self.dtype), tables

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: the codes and, for int8, their scales."""
        super().copy_block(src, dst)
        for pool in (*getattr(self, "k_scales", []), *getattr(self, "v_scales", [])):
            pool[dst] = pool[src]


def make_cache(config: Config, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto", dtype=torch.float32):
    """The engine's pool for `--kv-cache-dtype`: PagedKVCache in the model's dtype for auto, else QuantizedKVCache."""
    if kv_cache_dtype == "auto":
        return PagedKVCache(config, num_blocks, block_size, dtype)
    return QuantizedKVCache(config, num_blocks, block_size, kv_cache_dtype, dtype=dtype)
