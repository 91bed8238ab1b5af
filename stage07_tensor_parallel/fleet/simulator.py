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
    reps = [_Replica(cache_tokens // page_size, role) for role in roles]
    front = [k for k, role in enumerate(roles) if role != "decode"]  # the replicas the policy routes to
    workers = [WorkerState(f"replica-{k}") for k in front]
    routed: dict[int, RoutedRequest] = {}
    n = len(trace)
    result = SimResult([r.timestamp for r in trace], [[] for _ in trace], [-1] * n, [0] * n, [], [-1] * n, [0.0] * n)
    steps: list[tuple[float, int]] = []  # heap of (end time, replica) of the steps in flight
    arriving: list[tuple[float, int, int]] = []  # heap of (arrival time, trace index, decode replica) of KV in transit
    in_transit: dict[int, _Seq] = {}

    def start_step(k: int, now: float) -> None:
        rep = reps[k]
        while rep.waiting and len(rep.running) < max_num_seqs:  # admission, as the engine's _admit
            seq = rep.waiting.popleft()
            rep.running.append(seq)
            if rep.role == "decode":  # its prompt's KV arrived whole
                continue
            usable = (seq.prompt - 1) // page_size  # the last prompt token is always computed
            hit = 0
            while hit < usable and seq.hash_ids[hit] in rep.cache:
                rep.cache.move_to_end(seq.hash_ids[hit])
                hit += 1
            seq.cached = seq.computed = hit * page_size
            result.cached_tokens[seq.index] = seq.cached
            rep.cached_tokens += seq.cached
        budget, rep.batch = max_num_batched_tokens, []
        for seq in rep.running:  # each running request's next chunk within the budget, as _schedule
            want = seq.prompt - seq.computed if seq.computed < seq.prompt else 1
            chunk = min(want, budget)
            if chunk:
                rep.batch.append((seq, chunk))
                budget -= chunk
        if rep.batch:
            cost = step_cost.ragged([(c, s.computed + c) for s, c in rep.batch])
            rep.busy_s += cost
            heapq.heappush(steps, (now + cost, k))

    def finish_step(k: int, now: float) -> None:
        rep = reps[k]
        for seq, chunk in rep.batch:
            prefilling = seq.computed < seq.prompt
            if prefilling:
                rep.prefill_tokens += chunk
            seq.computed += chunk
            if seq.computed < seq.prompt:
                continue  # more prompt to come
            if prefilling:  # the prompt's full pages are cached as its prefill ends, as the engine does
                for h in seq.hash_ids[: seq.prompt // page_size]:
                    rep.cache[h] = None
                    rep.cache.move_to_end(h)
                while len(rep.cache) > rep.cache_pages:
                    rep.cache.popitem(last=False)
            result.token_times[seq.index].append(now)
            seq.generated += 1
            done, handoff = seq.generated == seq.output, rep.role == "prefill"
            if not (done or handoff):
                continue
            rep.running.remove(seq)
            rep.assigned -= 1
            if rep.role != "decode":  # the request leaves the replicas the router places: its counters drop
                request, worker = routed.pop(seq.index), workers[front.index(k)]
                worker.outstanding -= 1
                worker.active_tokens -= len(request.token_ids) + request.max_tokens
                policy.on_finish(request, worker)
            if handoff and not done:
                send(seq, now)
        rep.batch = []
        start_step(k, now)

    def send(seq: _Seq, now: float) -> None:
        """Ship a prefilled request's KV to the decode replica with the fewest requests."""
        d = min((k for k, rep in enumerate(reps) if rep.role == "decode"), key=lambda k: (reps[k].assigned, k))
        reps[d].assigned += 1
        result.decoder[seq.index], result.transfer_s[seq.index] = d, transfer(seq.prompt)
        in_transit[seq.index] = seq
        heapq.heappush(arriving, (now + result.transfer_s[seq.index], seq.index, d))

    def advance(until: float) -> None:
        """Run every step end and KV arrival up to `until`, earliest first."""
        while steps or arriving:
            t_step = steps[0][0] if steps else math.inf
            t_kv = arriving[0][0] if arriving else math.inf
            if min(t_step, t_kv) > until:
                return
            if t_step <= t_kv:
                end, k = heapq.heappop(steps)
                finish_step(k, end)
            else:
                t, i, d = heapq.heappop(arriving)
                reps[d].waiting.append(in_transit.pop(i))
                if not reps[d].batch:
                    start_step(d, t)

    for i, r in enumerate(trace):
        advance(r.timestamp)
        tokens = prompt_tokens(r, page_size, vocab_size)
        session = None if r.session_id is None else str(r.session_id)
        request = RoutedRequest(str(i), tokens, session, r.output_length, page_hashes(tokens, page_size))
        w = policy.choose(request, workers)
        policy.on_dispatch(request, workers[w])
        workers[w].outstanding += 1
        workers[w].active_tokens += len(tokens) + r.output_length
        k = front[w]
        routed[i], result.replica[i] = request, k
        reps[k].assigned += 1
        reps[k].waiting.append(_Seq(i, r.input_length, r.output_length, r.hash_ids))
        if not reps[k].batch:  # an idle replica starts at once
            start_step(k, r.timestamp)
    advance(math.inf)
    result.replicas = [
        {"role": rep.role, "requests": result.replica.count(k) + result.decoder.count(k),
         "prefill_tokens": rep.prefill_tokens, "cached_tokens": rep.cached_tokens, "busy_s": rep.busy_s}
        for k, rep in enumerate(reps)
    ]  # fmt: skip
    return result
