"""One pipeline stage: a contiguous run of the model's units, with a KV cache of its own layers only.

Stage s of p holds units bounds[s] (partition.py: unit 0 the embedding, 1 .. L the layers, L + 1 the final
norm and LM head). The first stage turns token ids into hidden states; every other stage receives the hidden
states (B, T, hidden) from the stage before; the last stage turns them into logits. A stage's KV cache holds
its own layers' keys and values, so the cache is split across stages as the weights are. lab6.ipynb §2.
"""

from dataclasses import replace

import torch
from torch import nn

from labkit.model import KVCache, Llama, causal_mask, rope_cos_sin

from .partition import check_partition


class PipelineStage(nn.Module):
    """Units [start, end) of `model`, sharing its modules (no copy): stage `index` of len(bounds)."""

    def __init__(self, model: Llama, bounds: list[tuple[int, int]], index: int):
        super().__init__()
        c = model.config
        check_partition(bounds, c.num_hidden_layers + 2, len(bounds))
        if not 0 <= index < len(bounds):
            raise ValueError(f"stage index {index} is outside a pipeline of {len(bounds)} stages")
        self.config, self.index, self.num_stages = c, index, len(bounds)
        start, end = bounds[index]
        self.is_first, self.is_last = start == 0, end == c.num_hidden_layers + 2
        self.embed_tokens = model.model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(model.model.layers[max(start, 1) - 1 : min(end, c.num_hidden_layers + 1) - 1])
        self.norm = model.model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        # the tables, not model.rope: a bound method would keep the whole model (every stage's weights) alive
        self.rope_cos, self.rope_sin = model.rope_cos, model.rope_sin

    def layer_inputs(self, start: int, T: int):
        """cos, sin (T, head_dim) and the causal mask (T, start + T) (None for one token) of positions start .. start + T - 1."""
        c = self.config
        if start + T <= self.rope_cos.shape[0]:
            cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        else:
            cos, sin = rope_cos_sin(torch.arange(start, start + T), c.head_dim, c.rope_theta, scaling=c.rope_scaling)
        return cos, sin, causal_mask(start, T, self.config.sliding_window, cos.device)

    def new_cache(self, batch_size: int = 1, max_seq_len: int | None = None) -> KVCache:
        """A KV cache for this stage's layers only: len(self.layers) layers of (B, n_kv, max_seq_len, head_dim)."""
        local = replace(self.config, num_hidden_layers=len(self.layers))
        p = self.rope_cos
        return KVCache(local, batch_size, max_seq_len or self.config.max_position_embeddings, p.dtype, p.device)

    def hidden_shape(self, batch: int, T: int) -> tuple[int, int, int]:
        """The shape of the activation that crosses between stages for T positions: (batch, T, hidden)."""
        return (batch, T, self.config.hidden_size)

    def forward(self, x: torch.Tensor, start: int = 0, cache: KVCache | None = None, logits_to_keep: int = 0):
        """Run this stage's units on positions start .. start + T - 1.

        x: (B, T) int64 token ids on the first stage, else (B, T, hidden) float32 from the stage before.
        With a cache, layer i of this stage reads and writes layer i of `cache` (new_cache's), and the cache's
        length advances by T once every layer has written. Returns (B, T, hidden) float32 for the next stage, or
        on the last stage the logits (B, T, vocab) (the last logits_to_keep positions' if it is not 0), equal to
        the whole model's forward on the same positions.
        """
        raise NotImplementedError("stage07: PipelineStage.forward — see lab6.ipynb §2")
