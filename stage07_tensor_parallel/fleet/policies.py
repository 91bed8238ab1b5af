"""Routing policies: which replica serves the next request.

The router calls `choose(request, workers)` with the live workers and sends the request to
`workers[i]`; then `on_dispatch(request, worker)`, and `on_finish(request, worker)` when it ends. The
router keeps each WorkerState's counters up to date; a policy only reads them and keeps its own
memory (a cursor, session bindings, approximate trees) in the hooks.

    RoundRobin        each worker in turn
    LeastOutstanding  the worker with the fewest requests in flight
    PowerOfTwo        two distinct workers sampled at random, the less loaded of them
    SessionAffinity   a session stays on the worker it started on (its conversation's KV is there)
    CacheAware        SGLang's: the worker whose approximate radix tree matches the longest prefix,
                      unless the load is out of balance (then the least loaded)

lab3.ipynb §1 motivates each; kv_index.KVAware is a sixth, fed by the engines' own KV events (§2).
"""

import random
from dataclasses import dataclass, field

from .radix_cache import RadixCache


@dataclass
class RoutedRequest:
    """What the router knows of a request when it routes it."""

    request_id: str
    token_ids: list[int]  # the prompt, tokenized at the front
    session_id: str | None = None  # the OpenAI `user` field; None: no session
    max_tokens: int = 16
    block_hashes: list[int] = field(default_factory=list)  # replica_engine.page_hashes of the prompt


@dataclass
class WorkerState:
    """One replica as the router sees it. `name` is stable (its address); the list's order is not."""

    name: str
    outstanding: int = 0  # requests dispatched to it and not finished
    active_tokens: int = 0  # prompt + max_tokens of those requests: the KV they will hold (decode load)
    queued_prefill_tokens: int = 0  # prompt tokens sent to it whose first token has not come back (lab3 §5)


class Policy:
    """The interface every policy implements. Hooks default to doing nothing."""

    name = "policy"

    def choose(self, request: RoutedRequest, workers: list[WorkerState]) -> int:
        """The index in `workers` (non-empty) of the worker that serves `request`."""
        raise NotImplementedError

    def on_dispatch(self, request: RoutedRequest, worker: WorkerState) -> None:
        """`request` was sent to `worker` (the one choose picked)."""

    def on_finish(self, request: RoutedRequest, worker: WorkerState) -> None:
        """`request` ended on `worker` (finished, aborted or failed)."""

    def remove_worker(self, name: str) -> None:
        """The worker called `name` left the fleet: forget what is kept about it."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self.next = 0  # how many requests were routed so far

    def choose(self, request, workers):
        """workers[0], workers[1], ..., workers[n-1], workers[0], ... on successive calls."""
        raise NotImplementedError("stage07: RoundRobin.choose — see lab3.ipynb §1")


def least_loaded(workers: list[WorkerState]) -> int:
    """The index of the worker with the fewest outstanding requests; ties go to the earliest in the list."""
    raise NotImplementedError("stage07: least_loaded — see lab3.ipynb §1")


class LeastOutstanding(Policy):
    name = "least_outstanding"

    def choose(self, request, workers):
        """The worker with the fewest outstanding requests; ties go to the earliest in the list."""
        return least_loaded(workers)


class PowerOfTwo(Policy):
    """Mitzenmacher's power of two choices: nearly the balance of LeastOutstanding while reading only two
    workers' loads, which matters when loads are stale or costly to read."""

    name = "power_of_two"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def choose(self, request, workers):
        """Two distinct workers drawn uniformly with self.rng; the one with fewer outstanding requests
        (the first drawn on a tie). One worker: it."""
        raise NotImplementedError("stage07: PowerOfTwo.choose — see lab3.ipynb §1")


class SessionAffinity(Policy):
    """A session's turns go to one worker, where its earlier turns' KV may still be cached."""

    name = "session_affinity"

    def __init__(self):
        self.sessions: dict[str, str] = {}  # session id -> worker name

    def choose(self, request, workers):
        """The worker the session is bound to if it is still among `workers`; otherwise (a new session, or
        its worker left) the least loaded, which on_dispatch binds. No session id: the least loaded."""
        raise NotImplementedError("stage07: SessionAffinity.choose — see lab3.ipynb §1")

    def on_dispatch(self, request, worker):
        if request.session_id is not None:
            self.sessions[request.session_id] = worker.name

    def remove_worker(self, name):
        self.sessions = {s: w for s, w in self.sessions.items() if w != name}


class CacheAware(Policy):
    """SGLang router's cache-aware policy (sgl-router, policies/cache_aware.rs) on token ids.

    Each worker has an approximate RadixCache of the prompts routed to it (not what its engine really
    holds: the router never asks), bounded to max_tree_size tokens by LRU eviction. The defaults are
    sgl-router's, except max_tree_size, sized for a small fleet.
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 1 << 16,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.trees: dict[str, RadixCache] = {}  # worker name -> approximate tree

    def tree(self, name: str) -> RadixCache:
        return self.trees.setdefault(name, RadixCache())

    def is_imbalanced(self, workers: list[WorkerState]) -> bool:
        """Both thresholds crossed: max - min outstanding > balance_abs_threshold and
        max > min * balance_rel_threshold."""
        raise NotImplementedError("stage07: CacheAware.is_imbalanced — see lab3.ipynb §1")

    def choose(self, request, workers):
        """Imbalanced: the least loaded. Otherwise the worker whose tree matches the longest prefix of the
        prompt (the earliest on a tie) if that match is more than cache_threshold of the prompt; else the
        worker with the smallest tree (the most room), the earliest on a tie."""
        raise NotImplementedError("stage07: CacheAware.choose — see lab3.ipynb §1")

    def on_dispatch(self, request, worker):
        """Insert the prompt into the worker's tree, then evict least recently used tokens until the tree
        holds at most max_tree_size."""
        raise NotImplementedError("stage07: CacheAware.on_dispatch — see lab3.ipynb §1")

    def remove_worker(self, name):
        self.trees.pop(name, None)
