"""Micro-batches through a pipeline: the fill / steady / drain schedule, its bubble, and running it for real.

With one request in flight, p stages take turns and p - 1 of them idle at any moment. Split the work into m
micro-batches and stage s can work on micro-batch j while stage s + 1 works on j - 1. A clock tick is one
stage's work on one micro-batch; the schedule is a table of ticks by stages. lab6.ipynb §4–§5 derive the
fraction of idle slots (the bubble) from the table and measure it on processes.
"""

import time  # noqa: F401 (the TODOs use it)

import torch
import torch.distributed as dist  # noqa: F401 (the TODOs use it)

from labkit import distributed  # noqa: F401 (the TODOs use it)

from .stage import PipelineStage


def fill_drain_schedule(num_microbatches: int, num_stages: int) -> list[list[int | None]]:
    """The schedule of one forward pass of m = num_microbatches micro-batches through p = num_stages stages,
    as a table of clock ticks: table[t][s] is the micro-batch stage s works on at tick t, or None where it idles.

    Micro-batch j enters stage 0 at tick j and moves one stage a tick, so the table has m + p - 1 rows of p
    entries: the fill (stages waiting for their first micro-batch), the steady state (every stage busy, only
    when m >= p) and the drain. Each stage runs every micro-batch exactly once, in order 0 .. m - 1.
    Raises ValueError when m < 1 or p < 1.
    """
    raise NotImplementedError("stage07: fill_drain_schedule — see lab6.ipynb §4")


def bubble_fraction(table: list[list[int | None]]) -> float:
    """The fraction of the table's stage-tick slots that are idle (None): the pipeline's bubble."""
    raise NotImplementedError("stage07: bubble_fraction — see lab6.ipynb §4")


@torch.no_grad()
def run_microbatches(stage: PipelineStage, prompts: list[list[int]], timeout_s: float = 30.0) -> dict:
    """Prefill m = len(prompts) prompts, one micro-batch each, through the pipeline (rank == stage.index of
    stage.num_stages ranks; every rank gets the same prompts), in the order fill_drain_schedule(m, p) gives.

    At each tick where the table gives this stage micro-batch j: receive j's activation
    (1, len(prompts[j]), hidden) from rank - 1 (the first stage embeds prompts[j] instead), run the stage
    (no cache: each micro-batch is a whole prompt from position 0), send the output on to rank + 1 through
    labkit.distributed (isend; recv and wait with timeout_s). Every rank starts after one dist.barrier and
    stops after another, once its sends are done, so all ranks time the same span.
    Returns {"logits": [(vocab,) float32 last-position logits of micro-batch j, j = 0 .. m - 1] on the last
    stage, [] on the others; "busy_s": seconds this stage spent inside stage(...); "wall_s": seconds between
    the two barriers}.
    """
    raise NotImplementedError("stage07: run_microbatches — see lab6.ipynb §5")
