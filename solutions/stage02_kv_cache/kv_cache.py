"""A contiguous KV cache: one preallocated K and V buffer per layer and a length counter.

The buffers are allocated once, at the largest size the request may reach, so a decode step
writes one slot instead of growing a tensor. That up-front reservation is exactly the memory
waste paging (stage 04) removes.
"""

import torch


class LayerCache:
    """K and V of one layer: `k`, `v` are (B, n_kv_heads, max_seq_len, head_dim), `length` slots are valid.

    Only the KV heads are stored (GQA): query heads share them at attention time.
    """

    def __init__(
        self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype = torch.float32
    ):
        self.k = torch.zeros(batch, n_kv_heads, max_seq_len, head_dim, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, max_seq_len, head_dim, dtype=dtype)
        self.max_seq_len = max_seq_len
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_heads, T, head_dim) at slots [length, length + T); advance length by T.

        Returns the valid prefix (B, n_kv_heads, length + T, head_dim) of K and of V: views of
        the buffers, no copy. Raises ValueError, before writing anything, if T new slots do not fit.
        """
        end = self.length + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: {self.length} cached + {k.shape[2]} new tokens > max_seq_len={self.max_seq_len}; "
                "allocate the cache for prompt + max_new_tokens"
            )
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def truncate(self, n: int) -> None:
        """Keep the first n positions and forget the rest (speculative decoding rolls back this way).

        The slots are not cleared: the next append overwrites them. Raises ValueError unless 0 <= n <= length.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache holding {self.length} tokens to {n}")
        self.length = n


class LayerStack:
    """What every per-layer cache in this stage shares: `layers` holds one cache per decoder layer.

    The layers advance together, so the stack's length is layer 0's; its memory is their sum.
    """

    layers: list

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class KVCache(LayerStack):
    """One `layer_type` cache per decoder layer, all advancing together.

    Each layer's `append` advances that layer's `length`; `KVCache.length` reads layer 0's. (The
    given labkit.model.KVCache keeps a single `length` instead, which its model advances once
    every layer has written.)
    """

    layer_type = LayerCache

    def __init__(self, config, batch: int, max_seq_len: int, dtype: torch.dtype = torch.float32):
        self.layers = [
            self.layer_type(batch, config.num_key_value_heads, max_seq_len, config.head_dim, dtype)
            for _ in range(config.num_hidden_layers)
        ]

    def truncate(self, n: int) -> None:
        for layer in self.layers:
            layer.truncate(n)
