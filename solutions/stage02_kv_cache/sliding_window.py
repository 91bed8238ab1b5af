"""Extension: a sliding-window cache (Mistral-style) kept in a ring buffer of `window` slots.

With sliding-window attention a query at position p sees only keys in (p - window, p], so the
cache never needs more than `window` slots: position p lives in slot p % window and overwrites
the key that just left the window. Memory stays constant however long the generation runs.
"""

import torch

from labkit.model import Llama

from .cached_llama import attention_mask, decoder, token_positions


class RingLayerCache:
    """K, V (B, n_kv_heads, window, head_dim) of one layer; `slot_pos` (window,) holds the
    position stored in each slot (-1 = empty) and `length` counts every token ever appended."""

    def __init__(self, batch: int, n_kv_heads: int, window: int, head_dim: int, dtype: torch.dtype = torch.float32):
        self.k = torch.zeros(batch, n_kv_heads, window, head_dim, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, window, head_dim, dtype=dtype)
        self.slot_pos = torch.full((window,), -1, dtype=torch.long)
        self.window = window
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values for attention, then remember the newest ones.

        k, v: (B, n_kv_heads, T, head_dim), the tokens at positions [length, length + T).
        returns (B, n_kv_heads, window + T, head_dim): the ring as it was before this call, then the
        T new keys (the caller masks by position: slot_pos before the call, then the new positions).
        Afterwards position p is in slot p % window for the last min(T, window) new positions.
        """
        T = k.shape[2]
        keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        keep = min(T, self.window)
        pos = torch.arange(self.length + T - keep, self.length + T)
        slots = pos % self.window
        self.k[:, :, slots] = k[:, :, T - keep :]
        self.v[:, :, slots] = v[:, :, T - keep :]
        self.slot_pos[slots] = pos
        self.length += T
        return keys, values


class SlidingWindowCache:
    """One RingLayerCache per layer (given)."""

    def __init__(self, config, batch: int, window: int, dtype: torch.dtype = torch.float32):
        self.layers = [
            RingLayerCache(batch, config.num_key_value_heads, window, config.head_dim, dtype)
            for _ in range(config.num_hidden_layers)
        ]
        self.window = window

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def nbytes(self) -> int:
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)


@torch.no_grad()
def forward_sliding(model: Llama, input_ids: torch.Tensor, cache: "SlidingWindowCache") -> torch.Tensor:
    """Logits (1, T, vocab) of input_ids (1, T) under sliding-window attention, reading and
    updating `cache`. The keys attention sees are the ring then the new tokens, so their
    positions are the ring's slot positions then the new positions."""
    T = input_ids.shape[1]
    q_pos = token_positions(cache.length, T)
    k_pos = torch.cat([cache.layers[0].slot_pos[None], q_pos], dim=1)
    mask = attention_mask(q_pos, k_pos, cache.window)
    return decoder(model, input_ids, q_pos, mask, cache)
