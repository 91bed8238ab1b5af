"""The two collectives tensor parallelism needs, wrapped so every call is counted (given, no TODO).

The layers call `all_reduce` and `all_gather` from here rather than torch.distributed directly,
so `STATS` knows how many collectives a forward pass made and how many bytes each rank put in.
Without a process group (a plain `python` session) the world has one rank and both are no-ops,
which is what lets the notebook run a single shard in-process.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0  # payload per rank: the bytes of the tensor being summed
    all_gather_calls: int = 0
    all_gather_bytes: int = 0  # payload per rank: the bytes of the local shard being gathered

    def reset(self) -> None:
        self.all_reduce_calls = self.all_reduce_bytes = self.all_gather_calls = self.all_gather_bytes = 0


STATS = CommStats()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over all ranks, in place; every rank gets the same result."""
    if world_size() == 1:
        return x
    STATS.all_reduce_calls += 1
    STATS.all_reduce_bytes += x.numel() * x.element_size()
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along `dim`, in rank order."""
    if world_size() == 1:
        return x
    STATS.all_gather_calls += 1
    STATS.all_gather_bytes += x.numel() * x.element_size()
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
