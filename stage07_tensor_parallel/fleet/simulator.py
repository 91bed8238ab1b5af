"""A discrete-event simulator of a fleet of replica engines behind a router (lab4 §3).

Two cores cannot run four replicas at once and show what a fleet does under load. This file replays
instead: one engine step's cost is measured (step_costs.py: `measure_step_costs` times ReplicaEngine.step
on this machine; `StepCost.fit` fits it), and `simulate` runs a trace through N simulated replicas whose
scheduling copies replica_engine.ReplicaEngine: first come first served admission up to max_num_seqs,
each running request's next chunk within max_num_batched_tokens (a prefill chunk, or one decode
token), one packed forward per step. A routing policy from policies.py places every arrival, with the
counters the router keeps. Prefix-cache hits are page-level and come from the trace's hash ids (its
block size is the engine's page size): a replica holds the pages of the prompts it has prefilled, LRU-bounded.

Disaggregated (lab5 §4: `prefill_replicas=P`): the first P replicas only prefill, the other D = replicas - P
only decode. The policy places each arrival on a prefill replica, which computes the prompt (chunked as
above) and the first token; the KV then travels for `transfer(prompt tokens)` seconds (a `Transfer`: a fixed
latency plus bytes over a bandwidth, both measured) to the decode replica with the fewest requests, which
admits it like any arrival and produces one token per step from the second on. Colocated (P = 0), each
replica does both, and max_num_batched_tokens is Sarathi-Serve's chunked prefill: a long prompt shares each
step with the running decodes instead of stalling them for its whole length.

What it leaves out, on purpose: preemption (the pool holds every running request), the generated
tokens' pages (only prompts are cached), network and tokenizer time, and the router's own cost. In the
disaggregated mode also: the partial last page that a real decode engine recomputes (here the whole
prompt's KV travels), contention between transfers (each has the link to itself), decode-side prefix
reuse, and a transfer that fails.
"""

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .loadgen import TraceRequest, prompt_tokens
from .policies import Policy, RoutedRequest, WorkerState
from .replica_engine import page_hashes
from .step_costs import StepCost, Transfer, measure_step_costs, terms  # noqa: F401 (the handouts read them here)


@dataclass
class _Seq:
    index: int  # in the trace
    prompt: int
    output: int
    hash_ids: list[int]
    cached: int = 0
    computed: int = 0  # positions whose KV is written (the engine's store length)
    generated: int = 0


@dataclass
class _Replica:
    cache_pages: int
    role: str = "both"  # "both" (colocated), "prefill" or "decode"
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    cache: OrderedDict = field(default_factory=OrderedDict)  # page hash id -> None, least recently used first
    batch: list = field(default_factory=list)  # (seq, chunk) of the step in flight
    prefill_tokens: int = 0
    cached_tokens: int = 0
    busy_s: float = 0.0
    assigned: int = 0  # requests sent here and not finished (decode replicas: counting those in transit)


@dataclass
class SimResult:
    """What a simulated run produced: per trace request its send time, token times, replica and prefix-cache
    hit; per replica its prefill tokens computed, cached tokens and busy seconds. Disaggregated, `replica` is
    the prefill replica, `decoder` the decode one and `transfer_s` the KV's time in transit (colocated: -1, 0)."""

    sent: list[float]
    token_times: list[list[float]]
    replica: list[int]
    cached_tokens: list[int]
    replicas: list[dict]
    decoder: list[int] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)

    @property
    def duration(self) -> float:
        """From the first request sent to the last token (vLLM's benchmark duration)."""
        return max(t[-1] for t in self.token_times) - min(self.sent)


class _Simulation:
    """One replay in flight: the replicas, the router's view of those it places requests on, and the events
    pending (steps in flight, KV in transit), each handled as the engine and the router would."""

    def __init__(self, trace, policy, step_cost, roles, page_size, max_num_seqs, max_num_batched_tokens,
                 cache_tokens, vocab_size, transfer):  # fmt: skip
        self.policy, self.step_cost, self.transfer = policy, step_cost, transfer
        self.page_size, self.vocab_size = page_size, vocab_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.reps = [_Replica(cache_tokens // page_size, role) for role in roles]
        self.front = [k for k, role in enumerate(roles) if role != "decode"]  # the replicas the policy routes to
        self.workers = [WorkerState(f"replica-{k}") for k in self.front]
        self.routed: dict[int, RoutedRequest] = {}
        n = len(trace)
        self.result = SimResult(
            [r.timestamp for r in trace], [[] for _ in trace], [-1] * n, [0] * n, [], [-1] * n, [0.0] * n
        )
        self.steps: list[tuple[float, int]] = []  # heap of (end time, replica) of the steps in flight
        self.arriving: list[tuple[float, int, int]] = []  # heap of (arrival time, trace index, decode replica)
        self.in_transit: dict[int, _Seq] = {}

    def admit(self, rep: _Replica) -> None:
        """Admission, as the engine's _admit: waiting requests join the running ones up to max_num_seqs, each
        with the pages of its prompt the replica's cache holds."""
        while rep.waiting and len(rep.running) < self.max_num_seqs:
            seq = rep.waiting.popleft()
            rep.running.append(seq)
            if rep.role == "decode":  # its prompt's KV arrived whole
                continue
            usable = (seq.prompt - 1) // self.page_size  # the last prompt token is always computed
            hit = 0
            while hit < usable and seq.hash_ids[hit] in rep.cache:
                rep.cache.move_to_end(seq.hash_ids[hit])
                hit += 1
            seq.cached = seq.computed = hit * self.page_size
            self.result.cached_tokens[seq.index] = seq.cached
            rep.cached_tokens += seq.cached

    def start_step(self, k: int, now: float) -> None:
        rep = self.reps[k]
        self.admit(rep)
        budget, rep.batch = self.max_num_batched_tokens, []
        for seq in rep.running:  # each running request's next chunk within the budget, as _schedule
            want = seq.prompt - seq.computed if seq.computed < seq.prompt else 1
            chunk = min(want, budget)
            if chunk:
                rep.batch.append((seq, chunk))
                budget -= chunk
        if rep.batch:
            cost = self.step_cost.ragged([(c, s.computed + c) for s, c in rep.batch])
            rep.busy_s += cost
            heapq.heappush(self.steps, (now + cost, k))

    def finish_step(self, k: int, now: float) -> None:
        rep = self.reps[k]
        for seq, chunk in rep.batch:
            prefilling = seq.computed < seq.prompt
            if prefilling:
                rep.prefill_tokens += chunk
            seq.computed += chunk
            if seq.computed < seq.prompt:
                continue  # more prompt to come
            if prefilling:  # the prompt's full pages are cached as its prefill ends, as the engine does
                for h in seq.hash_ids[: seq.prompt // self.page_size]:
                    rep.cache[h] = None
                    rep.cache.move_to_end(h)
                while len(rep.cache) > rep.cache_pages:
                    rep.cache.popitem(last=False)
            self.result.token_times[seq.index].append(now)
            seq.generated += 1
            done, handoff = seq.generated == seq.output, rep.role == "prefill"
            if not (done or handoff):
                continue
            rep.running.remove(seq)
            rep.assigned -= 1
            if rep.role != "decode":  # the request leaves the replicas the router places: its counters drop
                request, worker = self.routed.pop(seq.index), self.workers[self.front.index(k)]
                worker.outstanding -= 1
                worker.active_tokens -= len(request.token_ids) + request.max_tokens
                self.policy.on_finish(request, worker)
            if handoff and not done:
                self.send(seq, now)
        rep.batch = []
        self.start_step(k, now)

    def send(self, seq: _Seq, now: float) -> None:
        """Ship a prefilled request's KV to the decode replica with the fewest requests."""
        reps, result = self.reps, self.result
        d = min((k for k, rep in enumerate(reps) if rep.role == "decode"), key=lambda k: (reps[k].assigned, k))
        reps[d].assigned += 1
        result.decoder[seq.index], result.transfer_s[seq.index] = d, self.transfer(seq.prompt)
        self.in_transit[seq.index] = seq
        heapq.heappush(self.arriving, (now + result.transfer_s[seq.index], seq.index, d))

    def advance(self, until: float) -> None:
        """Run every step end and KV arrival up to `until`, earliest first."""
        steps, arriving = self.steps, self.arriving
        while steps or arriving:
            t_step = steps[0][0] if steps else math.inf
            t_kv = arriving[0][0] if arriving else math.inf
            if min(t_step, t_kv) > until:
                return
            if t_step <= t_kv:
                end, k = heapq.heappop(steps)
                self.finish_step(k, end)
            else:
                t, i, d = heapq.heappop(arriving)
                self.reps[d].waiting.append(self.in_transit.pop(i))
                if not self.reps[d].batch:
                    self.start_step(d, t)

    def arrive(self, i: int, r: TraceRequest) -> None:
        """Trace request i arrives: the policy places it, with the counters the router keeps."""
        tokens = prompt_tokens(r, self.page_size, self.vocab_size)
        session = None if r.session_id is None else str(r.session_id)
        request = RoutedRequest(str(i), tokens, session, r.output_length, page_hashes(tokens, self.page_size))
        workers = self.workers
        w = self.policy.choose(request, workers)
        self.policy.on_dispatch(request, workers[w])
        workers[w].outstanding += 1
        workers[w].active_tokens += len(tokens) + r.output_length
        k = self.front[w]
        self.routed[i], self.result.replica[i] = request, k
        self.reps[k].assigned += 1
        self.reps[k].waiting.append(_Seq(i, r.input_length, r.output_length, r.hash_ids))
        if not self.reps[k].batch:  # an idle replica starts at once
            self.start_step(k, r.timestamp)


def simulate(
    trace: list[TraceRequest],
    policy: Policy,
    step_cost: StepCost,
    *,
    replicas: int = 4,
    page_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    cache_tokens: int = 4096,
    vocab_size: int = 2048,
    prefill_replicas: int = 0,
    transfer: Callable[[int], float] | None = None,
) -> SimResult:
    """Replay `trace` (hash ids of page_size-token blocks) on `replicas` simulated engines; `policy` routes
    each arrival (it sees the prompt's tokens rebuilt by loadgen.prompt_tokens, so CacheAware's trees work).
    prefill_replicas > 0 disaggregates: that many prefill replicas, the rest decode, `transfer` in between."""
    if not trace:
        raise ValueError("simulate needs a non-empty trace")
    if prefill_replicas and not (0 < prefill_replicas < replicas and transfer is not None):
        raise ValueError(
            f"disaggregated serving needs 0 < prefill_replicas < replicas and a transfer, got prefill_replicas="
            f"{prefill_replicas}, replicas={replicas}, transfer={transfer!r}: leave prefill_replicas=0 for colocated"
        )
    roles = (
        ["prefill"] * prefill_replicas + ["decode"] * (replicas - prefill_replicas)
        if prefill_replicas
        else ["both"] * replicas
    )
    sim = _Simulation(trace, policy, step_cost, roles, page_size, max_num_seqs, max_num_batched_tokens,
                      cache_tokens, vocab_size, transfer)  # fmt: skip
    for i, r in enumerate(trace):
        sim.advance(r.timestamp)
        sim.arrive(i, r)
    sim.advance(math.inf)
    result = sim.result
    result.replicas = [
        {"role": rep.role, "requests": result.replica.count(k) + result.decoder.count(k),
         "prefill_tokens": rep.prefill_tokens, "cached_tokens": rep.cached_tokens, "busy_s": rep.busy_s}
        for k, rep in enumerate(sim.reps)
    ]  # fmt: skip
    return result
