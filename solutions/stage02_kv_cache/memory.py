"""KV-cache memory math: what the cache costs, how many requests fit, and why decode is memory-bound.

Every number is exact integer arithmetic on the model's shape; nothing here runs a model.
"""

import math


def kv_cache_bytes(
    n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1, dtype_bytes: float = 2
) -> int:
    """Bytes of K and V for `batch` requests of `seq_len` tokens each.

    Every layer stores one key and one value vector per KV head per token, hence the factor 2.
    dtype_bytes: 4 float32, 2 bf16/fp16, 1 fp8/int8, 0.5 int4. Returns an int (exact).
    """
    return math.ceil(2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes)


def kv_bytes_per_token(config, dtype_bytes: float = 2) -> int:
    """Bytes one more token adds to one request's cache.

    config: anything with num_hidden_layers, num_key_value_heads and head_dim
    (labkit.model.Config, transformers' LlamaConfig). Llama-3-8B in bf16: 131072 (128 KiB).
    """
    return kv_cache_bytes(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 1, 1, dtype_bytes)


def max_concurrent_requests(gpu_bytes: int, weight_bytes: int, config, seq_len: int, dtype_bytes: float = 2) -> int:
    """How many requests of `seq_len` tokens fit in the memory the weights leave free (0 if none).

    Ignores activations and fragmentation: it is the upper bound a contiguous cache can reach.
    """
    free = gpu_bytes - weight_bytes
    per_request = kv_bytes_per_token(config, dtype_bytes) * seq_len
    return max(0, free // per_request)


def decode_arithmetic_intensity(
    n_params: int, batch: int, kv_bytes_per_request: int = 0, weight_bytes_per_param: float = 2
) -> float:
    """FLOPs per byte moved by one decode step of `batch` requests.

    Each request does 2 FLOPs per parameter (a multiply and an add). The weights are read once
    per step and shared by the whole batch; each request also reads its own KV cache, which
    batching cannot share. Attention FLOPs are left out (small next to 2·n_params at these lengths).
    """
    flops = 2 * n_params * batch
    bytes_moved = n_params * weight_bytes_per_param + batch * kv_bytes_per_request
    return flops / bytes_moved
