"""The router's state: its replicas, its open requests and their books, the KV index, and moving a request
off a replica that died (given code; router.py is the HTTP front over it, migration.py what happens when
a replica dies, handoff.py the P/D hand-off).

At start the router says hello to each replica (learning its name, page size, context and PUB port),
subscribes to its KV events and asks for a snapshot of its cache. One task per replica reads its replies
(tokens and errors go to their request's queue), one reads every replica's KV events into the index, and
one watches for silence: a replica that sends nothing (not even its heartbeat) for `dead_after` seconds is
dead and its requests move (migration.py). TRIP.md follows one request through all of it.
"""

import asyncio
import contextlib
import logging
import random
import time

import zmq
import zmq.asyncio

from . import handoff
from .books import Flight, Worker
from .kv_index import KVIndex
from .messages import (
    AskSnapshot,
    AskStats,
    Error,
    Generate,
    Hello,
    HelloReply,
    MessageError,
    Snapshot,
    Token,
    Transfer,
    decode_event,
    decode_reply,
    encode,
)
from .migration import Migration
from .policies import Policy, RoutedRequest, WorkerState
from .replica_engine import page_hashes

log = logging.getLogger(__name__)


class RouterState(Migration):
    """The router's live state: workers, open requests, the KV index and the policy (Migration: what it does
    when a replica falls silent)."""

    def __init__(self, addresses, make_policy, drop_events, seed, ctx, breaker=None, admission=None,
                 dead_after=3.0, probe_timeout=2.0):  # fmt: skip
        # make_policy(index, page_size) -> the routing policy, built once the replicas' page size is known
        self.addresses, self.make_policy = list(addresses), make_policy
        self.ctx, self.index = ctx, KVIndex()
        self.drop_events, self.rng = drop_events, random.Random(seed)  # drop_events: a lossy network, for tests
        self.workers: dict[str, Worker] = {}  # worker name -> Worker
        self.flights: dict[str, Flight] = {}  # request id -> the open request
        self.snapshot_asked: set[str] = set()
        self.tasks: list[asyncio.Task] = []
        self.policy: Policy | None = None
        self.dropped = 0
        self.breaker, self.admission = breaker, admission  # a CircuitBreaker factory; an AdmissionControl
        self.dead_after, self.probe_timeout = dead_after, probe_timeout
        self.moved = self.rejected = 0  # requests moved off a dead replica; requests answered 429
        self.prefills: dict[str, tuple[Worker, asyncio.Future]] = {}  # request id -> its prefill leg's reply
        self.broken_pairs: set[tuple[str, str]] = set()  # (prefill, decode) pairs whose channel is closed
        self.transfer_faults: list[str] = []  # test hook: "garble" or "drop" breaks the next transfer
        # seconds a decode replica waits for a prompt's KV before computing it: its loop serves nothing else
        # meanwhile, so well under dead_after (a transfer on one machine takes milliseconds)
        self.transfer_timeout = dead_after / 2
        self.transfers = {"ok": 0, "failed": 0}  # as the decode replicas report them

    async def start(self, timeout: float = 30.0) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for address in self.addresses:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            await sock.send_json(encode(Hello()))
            if not await sock.poll(timeout * 1000):
                raise RuntimeError(f"replica {address} did not answer hello within {timeout} s; is it running?")
            hello: HelloReply = decode_reply(await sock.recv_json())
            if hello.worker in self.workers:
                raise ValueError(f"two replicas are named {hello.worker!r} ({address}); start each with its own --name")
            worker = Worker(address, sock, WorkerState(hello.worker), hello.page_size, hello.max_len,
                            role=hello.role, rank=hello.rank)  # fmt: skip
            worker.breaker = self.breaker() if self.breaker else None
            self.workers[hello.worker] = worker
            sub.connect(f"{address.rsplit(':', 1)[0]}:{hello.pub_port}")
        page_sizes = {w.page_size for w in self.workers.values()}
        if len(page_sizes) > 1:
            raise ValueError(f"replicas use different page sizes {sorted(page_sizes)}; start them alike")
        self.page_size = page_sizes.pop()
        roles = {w.role for w in self.workers.values()}
        if "prefill" in roles and "decode" not in roles:
            raise ValueError("the fleet has prefill replicas but no decode replica to send their KV to")
        self.max_len = min(w.max_len for w in self.workers.values())
        self.vocab_size = hello.vocab_size  # the model's, which may exceed the tokenizer's
        self.policy = self.make_policy(self.index, self.page_size)
        self.sub = sub
        self.tasks = [asyncio.ensure_future(self.read(w)) for w in self.workers.values()]
        self.tasks.append(asyncio.ensure_future(self.read_events()))
        self.tasks.append(asyncio.ensure_future(self.watch()))
        for name in self.workers:
            await self.ask_snapshot(name)

    async def ask_snapshot(self, name: str) -> None:
        if name not in self.snapshot_asked:
            self.snapshot_asked.add(name)
            await self.workers[name].send(AskSnapshot())

    async def read(self, worker: Worker) -> None:
        """One replica's replies: tokens and errors to their request's queue, snapshots to the index."""
        while True:
            body = await worker.sock.recv_json()
            worker.last_seen = time.monotonic()
            try:
                msg = decode_reply(body)
            except MessageError as e:  # a reply this router does not know: not worth the reader
                log.warning("replica %s sent %s: %s", worker.state.name, body, e)
                continue
            leg = self.prefills.get(getattr(msg, "request_id", None))
            if isinstance(msg, (Token, Error)) and leg is not None and leg[0] is worker:
                if not leg[1].done():
                    leg[1].set_result(msg)
            elif isinstance(msg, Transfer):
                handoff.on_transfer(self, msg)
            elif isinstance(msg, (Token, Error)):
                flight = self.flights.get(msg.request_id)
                if flight is not None and flight.worker is worker:  # not a replica it has moved away from
                    self.first_token(flight)
                    flight.queue.put_nowait((msg, worker))
            elif isinstance(msg, Snapshot):
                self.snapshot_asked.discard(msg.worker)
                with self.guard("KVIndex.apply_snapshot"):
                    if not self.index.apply_snapshot(msg.worker, msg.seq, msg.block_hashes):
                        await self.ask_snapshot(msg.worker)
            elif msg.type in worker.replies:
                worker.replies.pop(msg.type).set_result(msg)

    async def read_events(self) -> None:
        """KV events (and heartbeats) from every replica into the index; a gap asks for a snapshot."""
        while True:
            msg = await self.sub.recv_json()
            name = msg.get("worker")
            if name not in self.workers:
                continue
            self.workers[name].last_seen = time.monotonic()  # the lossy network below loses content, not liveness
            if self.drop_events and self.rng.random() < self.drop_events:
                self.dropped += 1
                continue
            event = decode_event(msg)
            if event.kind == "heartbeat" and event.steps != self.workers[name].steps:
                self.workers[name].steps, self.workers[name].progressed = event.steps, time.monotonic()
            if event.kind == "heartbeat":
                if event.seq > self.index.seq[name] and name not in self.index.needs_snapshot():
                    await self.ask_snapshot(name)  # the latest events were lost (or this router is new)
                continue
            with self.guard("KVIndex.apply"):
                if not self.index.apply(name, event.seq, event.kind, event.block_hashes):
                    await self.ask_snapshot(name)

    @contextlib.contextmanager
    def guard(self, what: str):
        """An error in the index must not stop the reader that also carries every request's tokens."""
        try:
            yield
        except Exception:  # noqa: BLE001
            log.exception("%s failed; the KV index may be out of date", what)

    def first_token(self, flight: Flight) -> None:
        """Its replica answered: the prompt no longer waits for prefill there (admission's estimate)."""
        if flight.waiting_first:
            flight.waiting_first = False
            flight.worker.state.queued_prefill_tokens -= len(flight.routed.token_ids)

    def dispatch_to(self, flight: Flight, worker: Worker, routed: RoutedRequest) -> Generate:
        """Book `flight` on `worker` and return the Generate message for it."""
        self.policy.on_dispatch(routed, worker.state)  # first: if it raises, nothing is booked
        flight.worker, flight.routed, flight.waiting_first, flight.ended = worker, routed, True, False
        flight.booked = True
        worker.state.outstanding += 1
        worker.served += 1
        worker.state.active_tokens += len(routed.token_ids) + routed.max_tokens
        worker.state.queued_prefill_tokens += len(routed.token_ids)
        return Generate(flight.rid, routed.token_ids, routed.max_tokens, **flight.params)

    def release(self, flight: Flight) -> None:
        """Undo dispatch_to's books on the flight's current worker (once)."""
        if not flight.booked:
            return
        flight.booked = False
        w, routed = flight.worker, flight.routed
        self.first_token(flight)
        w.state.outstanding -= 1
        w.state.active_tokens -= len(routed.token_ids) + routed.max_tokens
        self.policy.on_finish(routed, w.state)

    async def route(self, flight: Flight, exclude: Worker | None = None) -> bool:
        """Send `flight` (its prompt plus the tokens it received, for what is left of max_tokens) to the
        worker the policy picks among the candidates; False when there is none."""
        workers = self.candidates(exclude)
        prefill = [w for w in workers if w.role == "prefill"]
        workers = [w for w in workers if w.role != "prefill"]
        if not workers:
            return False
        ids = flight.prompt + flight.tokens
        routed = RoutedRequest(flight.rid, ids, flight.session, flight.max_tokens - len(flight.tokens),
                               page_hashes(ids, self.page_size))  # fmt: skip
        worker = workers[self.policy.choose(routed, [w.state for w in workers])]
        msg = self.dispatch_to(flight, worker, routed)
        if prefill and exclude is None:  # a new request; one that moves is recomputed where it lands
            await handoff.prefill_leg(self, flight, prefill, worker, msg)
        await worker.send(msg)
        return True

    async def stats(self, worker: Worker, timeout: float = 10.0) -> dict:
        future = worker.replies.setdefault("stats", asyncio.get_running_loop().create_future())
        await worker.send(AskStats())
        return (await asyncio.wait_for(asyncio.shield(future), timeout)).stats

    async def report(self) -> dict:
        """GET /fleet/stats: each replica as the router sees it, with its engine's own stats."""
        fleet, out = self, []
        for name, w in fleet.workers.items():
            s = w.state
            try:
                engine = await fleet.stats(w, timeout=fleet.probe_timeout) if w.alive else None
            except TimeoutError:
                engine = None  # stuck or just died: the watch will tell
            out.append(
                {"name": name, "address": w.address, "served": w.served, "outstanding": s.outstanding, "active_tokens": s.active_tokens,
                 "engine": engine, "index_blocks": len(fleet.index.blocks.get(name, ())),
                 "index_seq": fleet.index.seq.get(name, 0), "index_stale": name in fleet.index.needs_snapshot(),
                 "alive": w.alive, "breaker": w.breaker.state if w.breaker else None, "role": w.role}
            )  # fmt: skip
        return {"policy": fleet.policy.name, "dropped_events": fleet.dropped, "moved": fleet.moved,
                "rejected": fleet.rejected, "kv_transfers": fleet.transfers, "workers": out}  # fmt: skip

    async def stop(self) -> None:
        for rid, flight in list(self.flights.items()):  # still open after uvicorn's graceful wait: fail, never drop
            flight.queue.put_nowait((Error(rid, "the router is shutting down"), None))
        await asyncio.sleep(0)
        for task in self.tasks:
            task.cancel()
        for w in self.workers.values():
            w.sock.close(0)
        self.sub.close(0)
