"""Precise KV-aware routing: an index of which worker's prefix cache holds which page, fed by the
engines' own events, and NVIDIA Dynamo's cost for choosing a worker with it.

Each replica publishes KVEvents (replica_engine) numbered 1, 2, 3, ... per worker: "stored" when pages
enter its cache, "removed" when they leave. The index applies them in order. Messages get lost (a PUB
socket drops them for a slow or late subscriber; a router restarts), so a number that skips ahead marks
the worker stale: the router asks that worker for a snapshot (its whole cache and the number of the last
event it reflects), and events that arrive meanwhile wait to be replayed on top of it. lab3.ipynb §2.
"""

from collections import defaultdict

from .policies import Policy, WorkerState


class KVIndex:
    """worker name -> the set of page hashes its cache holds, as far as the events say."""

    def __init__(self):
        self.blocks: dict[str, set[int]] = defaultdict(set)
        self.seq: dict[str, int] = defaultdict(int)  # the number of the last event applied (0: none)
        self.stale: set[str] = set()  # workers with a gap: waiting for a snapshot
        self.pending: dict[str, list[tuple[int, str, list[int]]]] = defaultdict(list)  # events held meanwhile

    def needs_snapshot(self) -> set[str]:
        """The workers whose events skipped a number since their last snapshot."""
        return set(self.stale)

    def apply(self, worker: str, seq: int, kind: str, block_hashes: list[int]) -> bool:
        """Apply event number `seq` of `worker`: "stored" adds its hashes, "removed" discards them.
        An event at or below the last applied number is old news (already in a snapshot): ignored. One that
        skips a number marks the worker stale. While stale, events are kept in self.pending, not applied.
        Returns False when the worker is stale after this call (the caller requests a snapshot)."""
        if kind not in ("stored", "removed"):
            raise ValueError(f"KV event kind {kind!r} is neither 'stored' nor 'removed'")
        if seq <= self.seq[worker]:
            return True
        # events arrive in order, so while stale every later event comes here too and waits
        if seq > self.seq[worker] + 1:
            self.stale.add(worker)
            self.pending[worker].append((seq, kind, block_hashes))
            return False
        if kind == "stored":
            self.blocks[worker].update(block_hashes)
        else:
            self.blocks[worker].difference_update(block_hashes)
        self.seq[worker] = seq
        return True

    def apply_snapshot(self, worker: str, seq: int, block_hashes: list[int]) -> bool:
        """The worker's whole cache as of its event `seq`: it replaces what the index held, then the pending
        events are replayed in order (those at or below `seq` are already in it). Returns False if the
        replay met another gap (the worker is stale again)."""
        self.blocks[worker] = set(block_hashes)
        self.seq[worker] = seq
        self.stale.discard(worker)
        pending = sorted(self.pending.pop(worker, []), key=lambda e: e[0])
        for event in pending:
            self.apply(worker, *event)
        return worker not in self.stale

    def overlap(self, worker: str, block_hashes: list[int]) -> int:
        """How many leading pages of a prompt (its page hashes, first page first) the worker holds: a page
        is only reusable after all the pages before it."""
        held = self.blocks.get(worker, set())
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n

    def remove_worker(self, worker: str) -> None:
        for table in (self.blocks, self.seq, self.pending):
            table.pop(worker, None)
        self.stale.discard(worker)


class KVAware(Policy):
    """Dynamo's KV router: cost = overlap_score_weight * prefill pages + active pages, the lowest wins.

    prefill pages: the prompt's pages minus the leading ones the worker's cache holds (the prefill it would
    compute); active pages: the worker's active_tokens / page_size (the KV its running requests hold, which
    each decode step reads). A higher weight favours cache hits (time to first token), a lower one spreads
    decode load (inter-token latency).
    """

    name = "kv_aware"

    def __init__(self, index: KVIndex | None = None, page_size: int = 16, overlap_score_weight: float = 1.0):
        self.index = index if index is not None else KVIndex()
        self.page_size = page_size
        self.overlap_score_weight = overlap_score_weight

    def cost(self, request, worker: WorkerState) -> float:
        """The worker's cost for `request` (request.block_hashes: the prompt's page hashes)."""
        prompt_pages = len(request.token_ids) / self.page_size
        prefill = prompt_pages - self.index.overlap(worker.name, request.block_hashes)
        return self.overlap_score_weight * prefill + worker.active_tokens / self.page_size

    def choose(self, request, workers):
        """The worker of the lowest cost; the earliest on a tie."""
        costs = [self.cost(request, w) for w in workers]
        return min(range(len(workers)), key=lambda i: costs[i])

    def remove_worker(self, name):
        self.index.remove_worker(name)
