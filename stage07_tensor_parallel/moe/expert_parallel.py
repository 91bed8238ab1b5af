"""Expert parallelism: E experts spread over the ranks of a process group, tokens sent to the rank
that holds their expert and the answers sent back, both with one all-to-all (lab8.ipynb §3).

Every rank holds its own tokens, the whole router and shared expert, and a contiguous slice of the
experts (`owned_experts`). A capacity factor bounds how many of its pairs a rank may send to one
expert; the pairs past it are dropped (their token keeps its other experts, and the residual
stream), counted, and reported. Every collective runs under the group's timeout
(labkit.distributed.launch sets it), so a dead rank is an error, not a hang.

    shard = ExpertShard.of(block, rank, world)           # this rank's slice of a MoEBlock
    y, dropped = ep_forward(shard, x, capacity_factor=1.25)
    launch(run_rank, 4, block, xs, 1.25)                 # labkit.distributed: xs[r] on rank r, (y, dropped) back
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .block import MoEBlock
from .experts import grouped_experts, sort_by_expert  # noqa: F401 (dispatch sorts with it)


def owned_experts(num_experts: int, rank: int, world: int) -> range:
    """The experts rank `rank` holds: contiguous, the first num_experts % world ranks one more."""
    bounds = [len(part) for part in torch.arange(num_experts).tensor_split(world)]
    start = sum(bounds[:rank])
    return range(start, start + bounds[rank])


def capacity(n_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs one rank may send to one expert: the balanced share n_tokens·k/E times the factor (GShard)."""
    return math.ceil(capacity_factor * n_tokens * k / num_experts)


def capacity_keep(topk_idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which (token, expert) pairs fit their expert's capacity.

    topk_idx: (N, k) int64 chosen experts
    capacity: pairs each expert accepts from this batch
    returns   (N, k) bool. Priority as GShard gives it: every token's first choice (column 0) before
              any second choice, and within a column earlier tokens first; an expert keeps its first
              `capacity` pairs in that order and drops the rest. Nothing is dropped when no expert
              gets more than `capacity` pairs.
    """
    raise NotImplementedError("stage07: capacity_keep — see lab8.ipynb §3")


@dataclass
class Plan:
    """What combine needs to send the answers back: the kept pairs in the order they were sent
    (positions in topk_idx.flatten()), rows sent to each rank and rows received from each."""

    order: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]


def dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, keep: torch.Tensor, num_experts: int, group=None
) -> tuple[torch.Tensor, torch.Tensor, Plan]:
    """Send every kept (token, expert) pair's token row to the rank that owns the expert.

    x:        (N, D) float32 this rank's tokens; topk_idx (N, k) int64; keep (N, k) bool
    returns   recv_x (M, D): the rows other ranks (this one included) sent here, grouped by source rank;
              recv_expert (M,) int64: each row's expert as an index into this rank's owned_experts;
              the Plan for combine. Two all_to_all_single calls carry the counts and then the rows
              (with the expert ids): each row crosses once, only to its expert's owner (the test
              counts the bytes), and nothing is gathered to every rank.
    """
    raise NotImplementedError("stage07: dispatch — see lab8.ipynb §3")


def combine(y_recv: torch.Tensor, plan: Plan, topk_weights: torch.Tensor, group=None) -> torch.Tensor:
    """Send each computed row back to its token's rank and sum it into the token, weighted.

    y_recv:       (M, D) the local experts' outputs, in recv_x's order
    topk_weights: (N, k) float32 this rank's routing weights
    returns       (N, D): out[t] = Σ over t's kept pairs of weight · expert output; dropped pairs add 0.
                  One all_to_all_single, the dispatch's splits reversed.
    """
    raise NotImplementedError("stage07: combine — see lab8.ipynb §3")


@dataclass
class ExpertShard:
    """One rank's part of a MoEBlock: the whole block for routing and the shared expert, and its experts."""

    block: MoEBlock
    experts: range
    gate_up: torch.Tensor  # (len(experts), 2I, D)
    down: torch.Tensor  # (len(experts), D, I)

    @classmethod
    def of(cls, block: MoEBlock, rank: int, world: int) -> "ExpertShard":
        mine = owned_experts(block.num_experts, rank, world)
        sl = slice(mine.start, mine.stop)
        return cls(block, mine, block.gate_up.data[sl].clone(), block.down.data[sl].clone())


@torch.no_grad()
def ep_forward(shard: ExpertShard, x: torch.Tensor, capacity_factor: float | None = None, group=None):
    """This rank's tokens x (N, D) through the expert-parallel block -> (y (N, D), pairs dropped here)."""
    block = shard.block
    weights, idx = block.route(x)
    keep = torch.ones_like(idx, dtype=torch.bool)
    if capacity_factor is not None:
        keep = capacity_keep(idx, block.num_experts, capacity(len(x), block.k, block.num_experts, capacity_factor))
    recv_x, recv_expert, plan = dispatch(x, idx, keep, block.num_experts, group)
    ones = torch.ones(len(recv_x), 1, dtype=x.dtype)
    y_recv = grouped_experts(recv_x, recv_expert[:, None], ones, shard.gate_up, shard.down)
    y = combine(y_recv, plan, weights.to(x.dtype), group)
    if block.shared is not None:
        y = y + block.shared(x)
    return y, int((~keep).sum())


def run_rank(block: MoEBlock, xs: list[torch.Tensor], capacity_factor: float | None = None):
    """A worker for labkit.distributed.launch: rank r's tokens xs[r] through its shard -> (y, pairs dropped)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return ep_forward(ExpertShard.of(block, rank, world), xs[rank], capacity_factor)
