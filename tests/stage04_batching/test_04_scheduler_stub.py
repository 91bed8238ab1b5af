"""§4 The scheduler on a stub block manager, so a scheduler bug is reported as a scheduler bug.

The stub says yes or no exactly when the test wants it to, which the real block manager cannot do
without a carefully sized pool; the scheduler only ever asks it can_allocate / allocate /
can_append / append_slot / free.
"""


class StubBlockManager:
    """Any request fits, except that the sequences in `full` cannot grow until something is freed."""

    def __init__(self):
        self.full: set[str] = set()
        self.freed: list[str] = []

    def can_allocate(self, seq) -> bool:
        return True

    def allocate(self, seq) -> None:
        pass

    def can_append(self, seq) -> bool:
        return seq.request_id not in self.full or bool(self.freed)

    def append_slot(self, seq):
        return None

    def free(self, seq) -> None:
        self.freed.append(seq.request_id)


def request(sq, request_id: str):
    return sq.Sequence(request_id, [1, 2, 3], sq.SamplingParams(max_tokens=8))


def test_no_waiting_sequence_is_admitted_in_a_step_that_preempted(impl):
    sq = impl("stage04_batching.sequence")
    sched_mod = impl("stage04_batching.scheduler")
    bm = StubBlockManager()
    scheduler = sched_mod.Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = request(sq, "a"), request(sq, "b")
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert [s.request_id for s in first.seqs] == ["a", "b"], "both prompts fit: both are admitted in step 1"
    for seq in (a, b):  # the engine's part: prefill done, one token sampled
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(7)
    c = request(sq, "c")
    scheduler.add(c)

    bm.full = {"a"}  # a needs a block and none is free: the last admitted (b) must make room
    out = scheduler.schedule()
    assert [s.request_id for s in out.preempted] == ["b"], (
        "a could not grow: the most recently admitted, b, is preempted"
    )
    assert [s.request_id for s in out.seqs] == ["a"], (
        "a step that preempted admits nobody from the waiting queue (b would only be evicted again, "
        f"and c would jump the line); scheduled {[s.request_id for s in out.seqs]}"
    )
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"], "b goes back to the front of the queue, before c"
    assert b.num_computed_tokens == 0, "recompute preemption forgets b's computed tokens"

    bm.full = set()
    nxt = scheduler.schedule()
    assert [s.request_id for s in nxt.seqs] == ["a", "b", "c"], "the step after, with room again, b then c are admitted"
