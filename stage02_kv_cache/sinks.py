"""A KV cache of fixed size that runs past the model's context: attention sinks and H2O eviction.

The cache holds at most `budget` tokens. When it is full, a policy names the token to evict:
- SinkWindow(n_sink): keep the first n_sink tokens (the "attention sinks" of StreamingLLM,
  Xiao et al. 2023) and a sliding window of the most recent ones; n_sink=0 is window-only;
- H2O(n_recent): keep the n_recent most recent tokens and, of the rest, the "heavy hitters" with
  the highest attention accumulated so far (Zhang et al. 2023).

Positions are StreamingLLM's: keys are cached before RoPE and rotated by their rank inside the
cache at every step (kept tokens get 0, 1, 2, ... in original order, the query comes next), so
no position ever exceeds the budget, however long the text. Batch size is 1: each sequence
evicts different tokens.
"""

import math  # noqa: F401

import torch

from labkit.model import Attention, Llama, apply_rope, repeat_kv, rope_cos_sin  # noqa: F401

from .kv_cache import LayerStack


class SinkWindow:
    """Evict the oldest token that is not one of the first n_sink (StreamingLLM)."""

    def __init__(self, n_sink: int):
        self.n_sink = n_sink

    def victim(self, pos: torch.Tensor, score: torch.Tensor) -> int:
        """The slot to overwrite in a full cache.

        pos: (budget,) int64 original position of the token in each slot; score: (budget,) float32
        accumulated attention (unused here). Returns the slot of the smallest position >= n_sink.
        """
        raise NotImplementedError("stage02: SinkWindow.victim — see lab2.ipynb §6")


class H2O:
    """Evict, outside the n_recent most recent tokens, the one with the least accumulated attention."""

    def __init__(self, n_recent: int):
        self.n_recent = n_recent

    def victim(self, pos: torch.Tensor, score: torch.Tensor) -> int:
        """The slot to overwrite in a full cache (budget > n_recent).

        pos: (budget,) int64 original positions; score: (budget,) float32 attention each token has
        received, summed over heads and steps. The n_recent largest positions are protected; of
        the others, the lowest score goes (ties: the oldest).
        """
        raise NotImplementedError("stage02: H2O.victim — see lab2.ipynb §8")


class StreamingLayerCache:
    """Pre-RoPE k, v (1, n_kv_heads, budget, head_dim) of the kept tokens, in any slot order.

    pos (budget,) int64: original position of each slot's token (-1 = empty);
    score (budget,) float32: attention each kept token has received so far (H2O's statistic);
    length: tokens ever stored. Memory is allocated once: it never grows with the text.
    """

    def __init__(self, n_kv_heads: int, budget: int, head_dim: int, policy, dtype=torch.float32):
        self.k = torch.zeros(1, n_kv_heads, budget, head_dim, dtype=dtype)
        self.v = torch.zeros(1, n_kv_heads, budget, head_dim, dtype=dtype)
        self.pos = torch.full((budget,), -1, dtype=torch.long)
        self.score = torch.zeros(budget)
        self.policy = policy
        self.budget = budget
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def kept(self) -> torch.Tensor:
        """Slots of the kept tokens in original order, (n,) int64: rank i gets RoPE position i."""
        raise NotImplementedError("stage02: StreamingLayerCache.kept — see lab2.ipynb §6")

    def store(self, k: torch.Tensor, v: torch.Tensor, score: float) -> None:
        """Keep the newest token: k, v (1, n_kv_heads, 1, head_dim) before RoPE, `score` the
        attention it has received so far. It takes the first empty slot or, when the cache is
        full, the slot policy.victim(pos, score) names. Its position is `length`."""
        raise NotImplementedError("stage02: StreamingLayerCache.store — see lab2.ipynb §6")


def streaming_attention(attn: Attention, x: torch.Tensor, cache: StreamingLayerCache) -> torch.Tensor:
    """T new tokens through one layer, one after another: x (1, T, hidden) normalised -> (1, T, hidden).

    Token t attends over the tokens kept when it arrives, in original order, then itself: key i is
    rotated to position i and the query to position n (the number kept), StreamingLLM's positions.
    Every key's softmax weight, summed over query heads, is added to its score; then token t is
    stored, before token t + 1 attends. No projection depends on the cache: do those for all T at once.
    """
    raise NotImplementedError("stage02: streaming_attention — see lab2.ipynb §7")


class StreamingCache(LayerStack):
    """One StreamingLayerCache per layer, each evicting on its own (given)."""

    def __init__(self, config, budget: int, policy, dtype=torch.float32):
        self.layers = [
            StreamingLayerCache(config.num_key_value_heads, budget, config.head_dim, policy, dtype)
            for _ in range(config.num_hidden_layers)
        ]


@torch.no_grad()
def forward_streaming(model: Llama, input_ids: torch.Tensor, cache: StreamingCache) -> torch.Tensor:
    """Logits (1, T, vocab) of input_ids (1, T), each token seeing the cache as it was when it came (given).

    Layer by layer, not token by token: each layer's cache evicts on its own, so what a layer gives
    token t depends only on that layer's inputs up to t. A layer can then take all T tokens at
    once and only its attention walks them in order; the projections, MLP and lm_head become
    matrix products that read each weight once per call, not once per token.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"a streaming cache serves one sequence; got a batch of {input_ids.shape[0]}")
    x = model.model.embed_tokens(input_ids)
    for layer, layer_cache in zip(model.model.layers, cache.layers, strict=True):
        x = x + streaming_attention(layer.self_attn, layer.input_layernorm(x), layer_cache)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))
