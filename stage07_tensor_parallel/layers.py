"""Megatron-style tensor-parallel layers: each rank holds a slice of a weight and the collectives
in `collectives` put the slices' results back together.

Convention (Megatron's): a dimension of size n split over p ranks gives rank r the contiguous
slice [r·n/p, (r+1)·n/p). `rank`/`world_size` default to the process group's; passing them lets
one process build any rank's shard (without a group the collectives are no-ops, so a layer
then returns its rank's partial result).

    ColumnParallelLinear   A (out, in) split by output rows: Y_r = X A_rᵀ, no communication
                           (or an all-gather of the Y_r with gather_output=True; that is the
                           vocab-parallel LM head)
    RowParallelLinear      A split by input columns: Y = Σ_r X_r A_rᵀ, one all-reduce, bias after
    VocabParallelEmbedding the table split by vocabulary rows: look up what you own, all-reduce
"""

import torch
import torch.nn.functional as F  # noqa: F401 (the TODOs use these)
from torch import nn

from . import collectives


def shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size slice of t along `dim` (a view).

    t: any shape; returns t with shape[dim] divided by world_size.
    Raises ValueError if world_size does not divide t.shape[dim].
    """
    raise NotImplementedError("stage07: shard — see lab.ipynb §1")


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A (out_features, in_features) split by output rows across ranks.

    weight: (out_features / world_size, in_features), bias: (out_features / world_size,) — this
    rank's rows. forward(x (..., in_features)) -> (..., out_features / world_size), or the full
    (..., out_features) on every rank with gather_output=True (one all-gather).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        gather_output: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        super().__init__()
        self.rank = collectives.rank() if rank is None else rank
        self.world_size = collectives.world_size() if world_size is None else world_size
        local = _divide(out_features, self.world_size, "out_features")
        self.weight = nn.Parameter(torch.zeros(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("stage07: ColumnParallelLinear.forward — see lab.ipynb §2")


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A (out_features, in_features) split by input columns across ranks.

    weight: (out_features, in_features / world_size); bias: (out_features,), not split.
    forward(x) takes this rank's slice x (..., in_features / world_size) when input_is_parallel,
    else the full x (..., in_features) and slices it; returns the full (..., out_features) on
    every rank after exactly one all-reduce, with the bias added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        super().__init__()
        self.rank = collectives.rank() if rank is None else rank
        self.world_size = collectives.world_size() if world_size is None else world_size
        local = _divide(in_features, self.world_size, "in_features")
        self.weight = nn.Parameter(torch.zeros(out_features, local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("stage07: RowParallelLinear.forward — see lab.ipynb §3")


class VocabParallelEmbedding(nn.Module):
    """Embedding table (num_embeddings, embedding_dim) split by vocabulary rows across ranks.

    weight: (num_embeddings / world_size, embedding_dim), the rows of ids
    [vocab_start, vocab_end). forward(ids (B, T) int64) -> (B, T, embedding_dim) on every rank:
    each rank looks up the ids it owns, writes zeros for the others, and one all-reduce sums them.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, rank: int | None = None, world_size: int | None = None):
        super().__init__()
        self.rank = collectives.rank() if rank is None else rank
        self.world_size = collectives.world_size() if world_size is None else world_size
        local = _divide(num_embeddings, self.world_size, "num_embeddings (vocabulary)")
        self.vocab_start, self.vocab_end = self.rank * local, (self.rank + 1) * local
        self.weight = nn.Parameter(torch.zeros(local, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("stage07: VocabParallelEmbedding.forward — see lab.ipynb §4")


def _divide(n: int, world_size: int, what: str) -> int:
    if n % world_size:
        raise ValueError(f"{what}={n} is not divisible by world_size={world_size}")
    return n // world_size
