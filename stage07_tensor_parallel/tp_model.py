"""labkit's Llama, tensor-parallel: every rank holds 1/world_size of each layer.

Per decoder layer (Megatron's placement, two all-reduces per layer in the forward pass):

    attention  q/k/v_proj column-parallel (each rank owns whole heads) -> attention on the local
               heads, no communication -> o_proj row-parallel: all-reduce #1
    MLP        gate/up_proj column-parallel -> silu(g)·u elementwise, local -> down_proj
               row-parallel: all-reduce #2

plus one all-reduce in the vocab-parallel embedding and one all-gather of the logits at the end.
RMSNorm weights are small and replicated. The KV cache holds only this rank's KV heads.

KV heads: if world_size divides num_key_value_heads, each rank gets its share. If instead
num_key_value_heads divides world_size (e.g. 2 KV heads at TP=4), each KV head is replicated on
world_size / num_key_value_heads ranks, as vLLM does: every rank's query heads belong to one KV
group, and that rank keeps a copy of the group's KV head. Anything else is a ValueError.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model import Config, KVCache, Llama, apply_rope, refuse_extras, repeat_kv

from . import collectives
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard  # noqa: F401 (the TODOs use these)


def local_head_counts(config: Config, world_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds at tensor-parallel size world_size.

    Raises ValueError naming the field when world_size does not divide num_attention_heads, or
    when neither of num_key_value_heads and world_size divides the other.
    """
    raise NotImplementedError("stage07: local_head_counts — see lab.ipynb §5")


def shard_state_dict(full_state: dict, rank: int, world_size: int, config: Config) -> dict:
    """The slice of a full labkit/HF Llama state dict that rank `rank` loads into its TPLlama.

    Same keys as the full state dict (lm_head.weight is added from the embedding if tied and
    absent). Column-parallel weights (q/k/v/gate/up_proj, embed_tokens, lm_head) keep their
    rank's rows, row-parallel ones (o_proj, down_proj) their rank's columns; k/v_proj keep the
    rows of this rank's KV heads (replicated when world_size > num_key_value_heads); norms are
    copied whole. Raises ValueError when heads, KV heads, vocabulary or MLP width do not divide.
    """
    raise NotImplementedError("stage07: shard_state_dict — see lab.ipynb §5")


class TPAttention(nn.Module):
    """Causal GQA self-attention over this rank's heads; o_proj's all-reduce sums the heads."""

    def __init__(self, c: Config, rank: int | None = None, world_size: int | None = None):
        super().__init__()
        ws = collectives.world_size() if world_size is None else world_size
        self.n_heads, self.n_kv_heads = local_head_counts(c, ws)
        self.head_dim = c.head_dim
        kw = dict(rank=rank, world_size=ws)
        # k/v_proj are split over a (possibly replicated) set of world_size * n_kv_heads heads.
        self.q_proj = ColumnParallelLinear(c.hidden_size, c.num_attention_heads * c.head_dim, **kw)
        self.k_proj = ColumnParallelLinear(c.hidden_size, ws * self.n_kv_heads * c.head_dim, **kw)
        self.v_proj = ColumnParallelLinear(c.hidden_size, ws * self.n_kv_heads * c.head_dim, **kw)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size, **kw)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        """x: (B, T, hidden) replicated -> (B, T, hidden) replicated, after one all-reduce."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, k, v)
        n_rep = self.n_heads // self.n_kv_heads
        y = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class TPMLP(nn.Module):
    """SwiGLU with the intermediate dimension split: gate/up column-, down row-parallel."""

    def __init__(self, c: Config, rank: int | None = None, world_size: int | None = None):
        super().__init__()
        kw = dict(rank=rank, world_size=world_size)
        self.gate_proj = ColumnParallelLinear(c.hidden_size, c.intermediate_size, **kw)
        self.up_proj = ColumnParallelLinear(c.hidden_size, c.intermediate_size, **kw)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, hidden) replicated -> (B, T, hidden) replicated, after one all-reduce."""
        raise NotImplementedError("stage07: TPMLP.forward — see lab.ipynb §5")


class TPLlama(Llama):
    """labkit's Llama with every layer swapped for its tensor-parallel version.

    Load it with `model.load_state_dict(shard_state_dict(full_state, rank, world_size, config))`.
    forward, generate and the block structure are labkit's: only the modules differ. Logits come
    back whole (vocab_size wide) on every rank, so every rank picks the same next token.
    """

    def __init__(self, config: Config, rank: int | None = None, world_size: int | None = None):
        # RoPE scaling and a sliding window come with labkit's forward; the sharded layers have no biases
        # and no qk-norm, so checkpoints that need them are refused.
        refuse_extras(config, "stage07's TPLlama", ("rope_scaling", "sliding_window"))
        super().__init__(config)  # builds full-size modules, replaced right away (fine at course scale)
        kw = dict(rank=rank, world_size=world_size)
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **kw)
        for block in self.model.layers:
            block.self_attn = TPAttention(config, **kw)
            block.mlp = TPMLP(config, **kw)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, gather_output=True, **kw)
        if config.tie_word_embeddings:  # both are split by vocabulary rows, so the shards match
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_heads_per_rank = self.model.layers[0].self_attn.n_kv_heads

    def new_cache(self, batch_size: int = 1, max_seq_len: int | None = None) -> KVCache:
        """A KV cache holding only this rank's KV heads: (B, kv_heads_per_rank, max_seq_len, head_dim)."""
        p = next(self.parameters())
        local = replace(self.config, num_key_value_heads=self.kv_heads_per_rank)
        return KVCache(local, batch_size, max_seq_len or self.config.max_position_embeddings, p.dtype, p.device)
