"""Continuous batching: every step picks which sequences run and how many tokens each computes.

Running sequences go first (their decodes and unfinished prefill chunks), then waiting ones are
admitted FCFS while the step has room: at most max_num_seqs running, at most max_num_batched_tokens
computed. When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it re-queues to be recomputed later.
"""

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per sequence
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, stopped or aborted) and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch: running sequences first, in order, then waiting ones FCFS.

        A running sequence gets append_slot (its copy-on-write pair, if any, goes to blocks_to_copy) and
        num_tokens - num_computed_tokens tokens, cut to the budget left; when it cannot append, the last
        running sequence is preempted (listed in preempted) until it can, or until it was the victim itself.
        An admitted sequence is allocated, set RUNNING and appended to running. Invariants:
        sum(num_tokens) <= max_num_batched_tokens, len(running) <= max_num_seqs, every scheduled sequence
        has blocks for all the tokens it computes, and no waiting sequence is admitted in a step that
        preempted."""
        raise NotImplementedError("stage04: Scheduler.schedule — see lab.ipynb §4")

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the sequence's blocks, forget its computed K/V, and put it back at
        the front of the waiting queue (it arrived before anything still waiting)."""
        raise NotImplementedError("stage04: Scheduler.preempt — see lab.ipynb §4")
