"""Micro-batches through a pipeline: the fill / steady / drain schedule, its bubble, and running it for real.

With one request in flight, p stages take turns and p - 1 of them idle at any moment. Split the work into m
micro-batches and stage s can work on micro-batch j while stage s + 1 works on j - 1. A clock tick is one
stage's work on one micro-batch; the schedule is a table of ticks by stages. lab6.ipynb §4–§5 derive the
fraction of idle slots (the bubble) from the table and measure it on processes.
"""

import time

import torch
import torch.distributed as dist

from labkit import distributed

from .stage import PipelineStage


def fill_drain_schedule(num_microbatches: int, num_stages: int) -> list[list[int | None]]:
    """The schedule of one forward pass of m = num_microbatches micro-batches through p = num_stages stages,
    as a table of clock ticks: table[t][s] is the micro-batch stage s works on at tick t, or None where it idles.

    Micro-batch j enters stage 0 at tick j and moves one stage a tick, so the table has m + p - 1 rows of p
    entries: the fill (stages waiting for their first micro-batch), the steady state (every stage busy, only
    when m >= p) and the drain. Each stage runs every micro-batch exactly once, in order 0 .. m - 1.
    Raises ValueError when m < 1 or p < 1.
    """
    if num_microbatches < 1 or num_stages < 1:
        raise ValueError(f"need at least one micro-batch and one stage, got m={num_microbatches}, p={num_stages}")
    m, p = num_microbatches, num_stages
    return [[t - s if 0 <= t - s < m else None for s in range(p)] for t in range(m + p - 1)]


def bubble_fraction(table: list[list[int | None]]) -> float:
    """The fraction of the table's stage-tick slots that are idle (None): the pipeline's bubble."""
    slots = sum(len(row) for row in table)
    return sum(j is None for row in table for j in row) / slots


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
    rank, m = stage.index, len(prompts)
    table = fill_drain_schedule(m, stage.num_stages)
    logits, pending, busy = [], [], 0.0
    dist.barrier()
    t0 = time.perf_counter()
    for row in table:
        j = row[rank]
        if j is None:
            continue
        T = len(prompts[j])
        if stage.is_first:
            x = torch.tensor([prompts[j]])
        else:
            x = distributed.recv(stage.hidden_shape(1, T), rank - 1, timeout_s, f"micro-batch {j} from rank {rank - 1}")
        t = time.perf_counter()
        out = stage(x, 0, None, logits_to_keep=1)
        busy += time.perf_counter() - t
        if stage.is_last:
            logits.append(out[0, -1])
        else:
            pending.append(distributed.isend(out, rank + 1))
    for work in pending:
        distributed.wait(work, timeout_s, f"a send from rank {rank}")
    dist.barrier()
    return {"logits": logits, "busy_s": busy, "wall_s": time.perf_counter() - t0}
