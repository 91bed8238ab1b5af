"""The fleet's front: one OpenAI-compatible endpoint over many replicas (given code).

    app = create_app(["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"], tokenizer, policy="cache_aware")
    python -m stage07_tensor_parallel.fleet.router --replica tcp://10.0.0.5:5555 --replica tcp://10.0.0.6:5555

Replicas are zmq addresses (replica.py), so they may run on this machine or others: start
`python -m stage07_tensor_parallel.fleet.replica --host 0.0.0.0 --port 5555` on each machine and name them
here. At start the router says hello to each (learning its name, page size, context and PUB port),
subscribes to its KV events and asks for a snapshot of its cache.

Routes: POST /v1/completions and /v1/chat/completions (stream=true: server-sent events), GET /v1/models,
/health, /fleet/stats. The router tokenizes, applies the chat template, asks the policy for a worker and
forwards the token ids; tokens stream back and are detokenized here. The OpenAI `user` field is the
session id that SessionAffinity keys on. A bad request gets a 400 naming the field; a client that
disconnects aborts its request on the replica (its slots go back at once); on shutdown uvicorn lets every
accepted request finish, and any still open after that gets an error, so none is dropped silently.

Faults (lab3.ipynb §4-§5). A replica that sends nothing (not even its heartbeat) for `dead_after` seconds
is dead: it leaves the policy's candidates, and each of its requests moves to a healthy replica as its
prompt plus the tokens already received, with max_tokens reduced by as many, so a greedy stream goes on
as if nothing happened (a sampled one goes on correctly but differently); with no healthy replica left
the client gets an error, never a hang. `breaker` (a factory of breaker.CircuitBreaker) gives each
replica a circuit breaker fed by its failures (timeouts, replica errors, death); a replica whose breaker
is not closed is out of the candidates, and a stats request is the half-open probe. `admission`
(admission.AdmissionControl) answers 429 with Retry-After when no healthy replica can start a new request
within its TTFT SLO. Both are off unless given.

Disaggregated prefill and decode (lab5.ipynb §2). When some replicas say hello with role "prefill", the
router runs each new request in two legs: the least-busy prefill replica computes the prompt (max_tokens 1)
and, as it finishes, sends the prompt's KV over torch.distributed to the decode replica the policy picked;
that replica is told to receive it ("kv_from"), loads it into its prefix cache and streams the whole answer
(the prefill's one token is computed again there from the cached prompt, as vLLM's P/D proxy does). The
transfer is honest about failure: a decode replica that gets a bad, short or late payload computes the
prompt itself, and a pair whose gloo channel closed (a timed-out receive) gets no more transfers: its
requests go straight to decode. A request that moves off a dead replica is recomputed, not transferred.
`RouterState.transfer_faults` is a test hook: each entry ("garble": a header no receiver accepts, "drop":
nothing sent) breaks the next transfer.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labkit.serving import until_disconnected

from .kv_index import KVAware, KVIndex
from .policies import (
    CacheAware,
    LeastOutstanding,
    Policy,
    PowerOfTwo,
    RoundRobin,
    RoutedRequest,
    SessionAffinity,
    WorkerState,
)
from .replica_engine import page_hashes

log = logging.getLogger(__name__)
POLICIES = {p.name: p for p in (RoundRobin, LeastOutstanding, PowerOfTwo, SessionAffinity, CacheAware, KVAware)}


def make_policy(name: str, index: KVIndex, page_size: int, **options) -> Policy:
    """A policy by name (round_robin, least_outstanding, power_of_two, session_affinity, cache_aware, kv_aware)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; pick one of {', '.join(POLICIES)}")
    if name == "kv_aware":
        return KVAware(index, page_size, **options)
    return POLICIES[name](**options)


class Sampling(BaseModel):
    """What both endpoints take. A field the fleet does not implement is a 400 that names it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    user: str | None = Field(None, max_length=256)  # the session id (SessionAffinity)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    ignore_eos: bool = False


class Completion(Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletion(Sampling):
    messages: list[Message] = Field(min_length=1)


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    kind = "rate_limit_exceeded" if status == 429 else kind
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status, headers=headers)


def plain_chat(turns: list[dict]) -> str:
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def chat_template(folder) -> Callable[[list[dict]], str]:
    """messages -> prompt text: the checkpoint's chat_template (tokenizer_config.json) in a sandbox, else
    `role: content` lines ending in `assistant:`."""
    file = Path(folder) / "tokenizer_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    if not isinstance(config.get("chat_template"), str):
        return plain_chat
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tokens = {k: config[k] for k in ("bos_token", "eos_token") if isinstance(config.get(k), str)}
    template = env.from_string(config["chat_template"], globals=tokens)
    return lambda turns: template.render(messages=turns, add_generation_prompt=True)


@dataclass
class Worker:
    address: str
    sock: zmq.asyncio.Socket
    state: WorkerState
    page_size: int = 16
    max_len: int = 0
    served: int = 0  # requests routed to it since the router started
    replies: dict[str, asyncio.Future] = field(default_factory=dict)  # "stats" -> the pending reply
    last_seen: float = field(default_factory=time.monotonic)  # when it last sent anything (heartbeats too)
    alive: bool = True  # heard from within dead_after seconds
    breaker: object = None  # a breaker.CircuitBreaker, or None (no breaker)
    role: str = "both"  # "prefill" replicas only compute prompts and send their KV to "decode" ones
    rank: int | None = None  # its rank in the P/D group (torch.distributed)


@dataclass
class Flight:
    """One open request: where it runs now and what it has received, so it can move to another replica."""

    rid: str
    prompt: list[int]
    max_tokens: int
    params: dict  # temperature, seed, stop_token_ids: sent again on a move
    session: str | None
    queue: asyncio.Queue
    worker: Worker | None = None
    routed: RoutedRequest | None = None  # what the policy saw when it placed the request on `worker`
    tokens: list[int] = field(default_factory=list)  # received so far, across replicas
    waiting_first: bool = False  # its prompt still counts in worker.state.queued_prefill_tokens
    ended: bool = False  # finished or refused on its replica: nothing to abort there
    booked: bool = False  # counted in its worker's WorkerState (dispatch_to until release)
    moves: int = 0
    pair: tuple[str, str] | None = None  # (prefill, decode) replica names while its KV transfer is pending


class RouterState:
    """The router's live state: workers, open requests, the KV index and the policy."""

    def __init__(self, addresses, policy, policy_options, drop_events, seed, ctx, breaker=None, admission=None,
                 dead_after=3.0, probe_timeout=2.0):  # fmt: skip
        self.addresses, self.policy_name, self.policy_options = list(addresses), policy, policy_options or {}
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
        # seconds a decode replica waits for a prompt's KV before computing it: it cannot heartbeat meanwhile,
        # so well under dead_after (a transfer on one machine takes milliseconds)
        self.transfer_timeout = dead_after / 2
        self.transfers = {"ok": 0, "failed": 0}  # as the decode replicas report them

    async def start(self, timeout: float = 30.0) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for address in self.addresses:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            await sock.send_json({"type": "hello"})
            if not await sock.poll(timeout * 1000):
                raise RuntimeError(f"replica {address} did not answer hello within {timeout} s; is it running?")
            hello = await sock.recv_json()
            name = hello["worker"]
            if name in self.workers:
                raise ValueError(f"two replicas are named {name!r} ({address}); start each with its own --name")
            worker = Worker(address, sock, WorkerState(name), hello["page_size"], hello["max_len"],
                            role=hello.get("role", "both"), rank=hello.get("rank"))  # fmt: skip
            worker.breaker = self.breaker() if self.breaker else None
            self.workers[name] = worker
            sub.connect(f"{address.rsplit(':', 1)[0]}:{hello['pub_port']}")
        page_sizes = {w.page_size for w in self.workers.values()}
        if len(page_sizes) > 1:
            raise ValueError(f"replicas use different page sizes {sorted(page_sizes)}; start them alike")
        self.page_size = page_sizes.pop()
        roles = {w.role for w in self.workers.values()}
        if "prefill" in roles and "decode" not in roles:
            raise ValueError("the fleet has prefill replicas but no decode replica to send their KV to")
        self.max_len = min(w.max_len for w in self.workers.values())
        self.vocab_size = hello["vocab_size"]  # the model's, which may exceed the tokenizer's
        self.policy = make_policy(self.policy_name, self.index, self.page_size, **self.policy_options)
        self.sub = sub
        self.tasks = [asyncio.ensure_future(self.read(w)) for w in self.workers.values()]
        self.tasks.append(asyncio.ensure_future(self.read_events()))
        self.tasks.append(asyncio.ensure_future(self.watch()))
        for name in self.workers:
            await self.ask_snapshot(name)

    async def ask_snapshot(self, name: str) -> None:
        if name not in self.snapshot_asked:
            self.snapshot_asked.add(name)
            await self.workers[name].sock.send_json({"type": "snapshot"})

    async def read(self, worker: Worker) -> None:
        """One replica's replies: tokens and errors to their request's queue, snapshots to the index."""
        while True:
            msg = await worker.sock.recv_json()
            worker.last_seen = time.monotonic()
            kind = msg.get("type")
            leg = self.prefills.get(msg.get("request_id"))
            if kind in ("token", "error") and leg is not None and leg[0] is worker:
                if not leg[1].done():
                    leg[1].set_result(msg)
            elif kind == "transfer":
                flight = self.flights.get(msg.get("request_id"))
                self.transfers["ok" if msg["ok"] else "failed"] += 1
                if not msg["ok"]:
                    log.warning(
                        "KV transfer for %s failed, decode computes the prompt: %s", msg["request_id"], msg["error"]
                    )
                if msg["broken"] and flight is not None and flight.pair is not None:
                    self.broken_pairs.add(flight.pair)
            elif kind in ("token", "error"):
                flight = self.flights.get(msg.get("request_id"))
                if flight is not None and flight.worker is worker:  # not a replica it has moved away from
                    self.first_token(flight)
                    flight.queue.put_nowait({**msg, "via": worker})
            elif kind == "snapshot":
                self.snapshot_asked.discard(msg["worker"])
                with self.guard("KVIndex.apply_snapshot"):
                    if not self.index.apply_snapshot(msg["worker"], msg["seq"], msg["block_hashes"]):
                        await self.ask_snapshot(msg["worker"])
            elif kind in worker.replies:
                worker.replies.pop(kind).set_result(msg)

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
            if msg["kind"] == "heartbeat":
                if msg["seq"] > self.index.seq[name] and name not in self.index.needs_snapshot():
                    await self.ask_snapshot(name)  # the latest events were lost (or this router is new)
                continue
            with self.guard("KVIndex.apply"):
                if not self.index.apply(name, msg["seq"], msg["kind"], msg["block_hashes"]):
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

    def candidates(self, exclude: Worker | None = None) -> list[Worker]:
        """The workers a request may go to: alive, and with a closed breaker. A breaker whose cooldown has
        passed lets its probe go here (a stats request), never a client's request."""
        out, now = [], time.monotonic()
        for w in self.workers.values():
            if not w.alive or w is exclude:
                continue
            if w.breaker is None:
                out.append(w)
            elif w.breaker.allow(now):
                if w.breaker.state == "closed":
                    out.append(w)
                else:  # it just turned half-open
                    self.tasks.append(asyncio.ensure_future(self.probe(w)))
        return out

    async def probe(self, worker: Worker) -> None:
        try:
            await self.stats(worker, self.probe_timeout)
        except TimeoutError:
            worker.breaker.record_failure(time.monotonic())
        else:
            worker.breaker.record_success(time.monotonic())

    def failed(self, worker: Worker) -> None:
        if worker.breaker is not None:
            worker.breaker.record_failure(time.monotonic())

    async def watch(self, period: float = 0.1) -> None:
        """Every `period`: a replica silent for dead_after seconds is dead (its requests are told to move)
        and each such check is a failure for its breaker; one heard from again is alive (and back in the
        candidates once its breaker's probe has closed it); breakers due for a probe get it."""
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for name, w in self.workers.items():
                silent = now - w.last_seen > self.dead_after
                if silent:
                    self.failed(w)  # each check counts: the breaker opens, and its probes tell when it is back
                if w.alive and silent:
                    log.warning("replica %s (%s) sent nothing for %.1f s: dead", name, w.address, self.dead_after)
                    w.alive = False
                    for worker, future in self.prefills.values():
                        if worker is w and not future.done():
                            future.set_result({"type": "lost", "worker": name})
                    for flight in self.flights.values():
                        if flight.worker is w:
                            flight.queue.put_nowait({"type": "lost", "worker": name})
                elif not w.alive and not silent:
                    log.warning("replica %s (%s) is back", name, w.address)
                    w.alive = True
            self.tasks = [t for t in self.tasks if not t.done()]
            self.candidates()

    def dispatch_to(self, flight: Flight, worker: Worker, routed: RoutedRequest) -> dict:
        """Book `flight` on `worker` and return the generate message for it."""
        flight.worker, flight.routed, flight.waiting_first, flight.ended = worker, routed, True, False
        flight.booked = True
        self.policy.on_dispatch(routed, worker.state)
        worker.state.outstanding += 1
        worker.served += 1
        worker.state.active_tokens += len(routed.token_ids) + routed.max_tokens
        worker.state.queued_prefill_tokens += len(routed.token_ids)
        return {"type": "generate", "request_id": flight.rid, "prompt": routed.token_ids,
                "max_tokens": routed.max_tokens, **flight.params}  # fmt: skip

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
            await self.prefill_leg(flight, prefill, worker, msg)
        await worker.sock.send_json(msg)
        return True

    async def prefill_leg(self, flight: Flight, prefill: list[Worker], decode: Worker, msg: dict,
                          timeout: float = 60.0) -> None:  # fmt: skip
        """Run the prompt on a prefill replica, which then sends its KV to `decode`; on success tell the
        decode side to receive it (msg["kv_from"]). Whatever fails here, `decode` computes the prompt."""
        worker = min(prefill, key=lambda w: w.state.outstanding)
        if (worker.state.name, decode.state.name) in self.broken_pairs:
            return
        future = asyncio.get_running_loop().create_future()
        self.prefills[flight.rid] = (worker, future)
        worker.state.outstanding += 1
        fault = self.transfer_faults.pop(0) if self.transfer_faults else None
        body = {**msg, "max_tokens": 1, "kv_to": decode.rank, "fault": fault}
        reply = None
        try:
            await worker.sock.send_json(body)
            reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            with contextlib.suppress(zmq.Again):
                await worker.sock.send_json({"type": "abort", "request_id": flight.rid}, zmq.NOBLOCK)
        finally:
            self.prefills.pop(flight.rid, None)
            worker.state.outstanding -= 1
        # the prefill replica sends exactly when its request finished this way: the decode side must receive
        if reply and reply["type"] == "token" and reply["finished"] and reply["finish_reason"] in ("stop", "length"):
            msg["kv_from"], msg["timeout"] = worker.rank, self.transfer_timeout
            flight.pair = (worker.state.name, decode.state.name)

    async def move(self, flight: Flight) -> bool:
        """Its replica died: continue it elsewhere from the tokens received so far."""
        old = flight.worker
        self.release(flight)
        with contextlib.suppress(zmq.Again):  # a stuck replica that wakes up must not finish it too
            await old.sock.send_json({"type": "abort", "request_id": flight.rid}, zmq.NOBLOCK)
        if not await self.route(flight, exclude=old):
            flight.ended = True  # nothing runs it any more
            return False
        flight.moves += 1
        self.moved += 1
        log.warning("request %s moved from %s to %s after %d tokens", flight.rid, old.state.name,
                    flight.worker.state.name, len(flight.tokens))  # fmt: skip
        return True

    async def stats(self, worker: Worker, timeout: float = 10.0) -> dict:
        future = worker.replies.setdefault("stats", asyncio.get_running_loop().create_future())
        await worker.sock.send_json({"type": "stats"})
        return (await asyncio.wait_for(asyncio.shield(future), timeout))["stats"]

    async def stop(self) -> None:
        for rid, flight in list(self.flights.items()):  # still open after uvicorn's graceful wait: fail, never drop
            flight.queue.put_nowait({"type": "error", "request_id": rid, "message": "the router is shutting down"})
        await asyncio.sleep(0)
        for task in self.tasks:
            task.cancel()
        for w in self.workers.values():
            w.sock.close(0)
        self.sub.close(0)


def create_app(
    replicas: list[str],
    tokenizer,
    *,
    policy: str = "cache_aware",
    policy_options: dict | None = None,
    model_name: str = "tiny-target",
    render_chat=None,
    eos_token_id: int | None = None,
    request_timeout: float = 60.0,
    drop_events: float = 0.0,
    seed: int = 0,
    breaker: Callable[[], object] | None = None,
    admission=None,
    dead_after: float = 3.0,
) -> FastAPI:
    """The FastAPI app of a router over `replicas` (zmq addresses of replica.py's ROUTER sockets).

    tokenizer: a tokenizers.Tokenizer; render_chat: turns -> prompt (chat_template(folder));
    eos_token_id: a stop token unless a request sets ignore_eos; request_timeout: seconds without a token
    before a request fails with 504; drop_events: the fraction of KV events to drop (a lossy network);
    breaker: () -> a breaker.CircuitBreaker for each replica (None: no breaker); admission: an
    admission.AdmissionControl (None: every request is queued); dead_after: seconds of silence after which
    a replica is dead and its requests move.
    """
    ctx = zmq.asyncio.Context.instance()
    fleet = RouterState(replicas, policy, policy_options, drop_events, seed, ctx, breaker, admission, dead_after)
    render_chat = render_chat or plain_chat

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await fleet.start()
        yield
        await fleet.stop()

    app = FastAPI(title="stage07 fleet router", lifespan=lifespan)
    app.state.fleet = fleet

    async def read_body(request: Request, schema):
        try:
            return schema.model_validate(json.loads(await request.body()))
        except ValidationError as e:
            first = e.errors()[0]
            name = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("str", "list[")))
            if first["type"] == "extra_forbidden":
                return error(400, f"{name}: this router does not implement this field; leave it out", name)
            return error(400, f"{name}: {first['msg']}", name or None)
        except ValueError as e:
            return error(400, f"the body is not valid JSON: {e}")

    async def create(request: Request, chat: bool) -> Response:
        req = await read_body(request, ChatCompletion if chat else Completion)
        if isinstance(req, Response):
            return req
        param = "messages" if chat else "prompt"
        if chat:
            try:
                text = render_chat([m.model_dump() for m in req.messages])
            except (TemplateError, ValueError) as e:
                return error(400, f"the chat template refused the messages: {e}", param)
            ids = tokenizer.encode(text).ids
        elif isinstance(req.prompt, str):
            ids = tokenizer.encode(req.prompt).ids
        else:
            ids = req.prompt
            vocab = fleet.vocab_size
            if max(ids) >= vocab:
                return error(400, f"prompt: token id {max(ids)} is outside the vocabulary of {vocab} tokens", param)
        if not ids:
            return error(400, f"the {param} is empty after tokenizing", param)
        if len(ids) + req.max_tokens > fleet.max_len:
            return error(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the {fleet.max_len} tokens a "
                "replica holds; shorten the prompt or lower max_tokens",
                param,
            )
        if not fleet.candidates():
            return error(503, "no healthy replica: every replica is dead or has its circuit breaker open; retry later")
        if fleet.admission is not None:
            admit, ttft = fleet.admission.decide([w.state for w in fleet.candidates()], len(ids))
            if not admit:
                fleet.rejected += 1
                wait = max(1, math.ceil(ttft - fleet.admission.ttft_slo))
                return error(
                    429,
                    f"the fleet is over its SLO: the least loaded replica would start this request in {ttft:.2f} s, "
                    f"past the time-to-first-token SLO of {fleet.admission.ttft_slo} s; retry after {wait} s",
                    headers={"Retry-After": str(wait)},
                )  # fmt: skip
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stop = [] if req.ignore_eos or eos_token_id is None else [eos_token_id]
        params = {"temperature": req.temperature, "seed": req.seed, "stop_token_ids": stop}
        flight = fleet.flights[rid] = Flight(rid, ids, req.max_tokens, params, req.user, asyncio.Queue())
        if not await fleet.route(flight):  # only prefill replicas are left
            fleet.flights.pop(rid)
            return error(
                503, "no healthy decode replica: every one is dead or has its circuit breaker open; retry later"
            )

        def done() -> None:
            """The request ended (finished, failed, or its client left): the router's books close once."""
            if fleet.flights.pop(rid, None) is not None:
                fleet.release(flight)

        async def abort() -> None:
            """Free the request's slots on its replica, unless it already ended there."""
            if not flight.ended:
                flight.ended = True
                await flight.worker.sock.send_json({"type": "abort", "request_id": rid})

        body = dict(id=rid, created=int(time.time()), model=req.model or model_name)
        if req.stream:
            return StreamingResponse(stream(flight, body, chat, done, abort), media_type="text/event-stream")
        try:
            last = await until_disconnected(request, final(flight))
            if last is not None and last.get("status") != 504:
                flight.ended = True  # finished or refused on the replica: nothing to abort
        finally:
            await abort()
            done()
        if last is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        if last["type"] == "error":
            return error(last.get("status", 400), last["message"])
        tokens = flight.tokens
        text = tokenizer.decode(tokens)
        choice = {"index": 0, "finish_reason": last["finish_reason"], "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**body, "object": kind, "choices": [choice], "usage": usage})

    async def next_message(flight: Flight) -> dict:
        """The flight's next token or error. A replica that died hands its requests on (fleet.move)."""
        while True:
            try:
                msg = await asyncio.wait_for(flight.queue.get(), request_timeout)
            except TimeoutError:
                fleet.failed(flight.worker)
                return {"type": "error", "status": 504, "message": f"no token from the replica for {request_timeout} s"}
            if msg.get("via", flight.worker) is not flight.worker:
                continue  # queued by a replica this request moved away from (a slow one taken for dead)
            if msg["type"] == "lost":
                if await fleet.move(flight):
                    continue
                return {"type": "error", "status": 503, "message": (
                    f"replica {msg['worker']} died after {len(flight.tokens)} tokens of this request and no healthy "
                    "replica is left to continue it; retry later")}  # fmt: skip
            if msg["type"] == "error" and msg.get("status", 500) >= 500:
                fleet.failed(flight.worker)
            elif msg["type"] == "token":
                if msg["token_id"] is not None:
                    flight.tokens.append(msg["token_id"])
                if msg["finished"] and flight.worker.breaker is not None:
                    flight.worker.breaker.record_success(time.monotonic())
            return msg

    async def final(flight: Flight) -> dict:
        while True:
            msg = await next_message(flight)
            if msg["type"] == "error" or msg["finished"]:
                return msg

    async def stream(flight, body, chat, done, abort):
        """SSE chunks of the new text as tokens arrive; closing it (the client left) aborts the request."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent = ""
        try:
            while True:
                msg = await next_message(flight)
                if msg["type"] == "error":
                    if msg.get("status") != 504:
                        flight.ended = True
                    status = msg.get("status", 500)
                    yield sse({"error": {"message": msg["message"], "type": "server_error", "code": status}})
                    break
                text = tokenizer.decode(flight.tokens)
                if text.endswith("\ufffd") and not msg["finished"]:
                    continue  # half a UTF-8 character: wait for the rest
                delta, sent = text[len(sent) :], text
                choice = {"index": 0, "finish_reason": msg["finish_reason"], "logprobs": None}
                choice |= {"delta": {"role": "assistant", "content": delta}} if chat else {"text": delta}
                if msg["finished"]:
                    flight.ended = True
                yield sse({**body, "object": kind, "choices": [choice]})
                if msg["finished"]:
                    break
            yield "data: [DONE]\n\n"
        finally:
            await abort()
            done()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "course"}]}

    @app.get("/health")
    async def health():
        healthy = len(fleet.candidates())
        return {"status": "ok" if healthy else "unavailable", "replicas": len(fleet.workers), "healthy": healthy}

    @app.get("/fleet/stats")
    async def fleet_stats():
        out = []
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

    return app


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def main(argv=None) -> None:
    from labkit import checkpoint

    ap = argparse.ArgumentParser(description="The fleet's OpenAI-compatible router over running replicas.")
    ap.add_argument("--replica", action="append", required=True, help="a replica's zmq address (repeat)")
    ap.add_argument("--policy", default="cache_aware", choices=sorted(POLICIES))
    ap.add_argument("--model", default=None, help="the folder of the replicas' model, for its tokenizer")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dead-after", type=float, default=3.0, help="seconds of silence after which a replica is dead")
    args = ap.parse_args(argv)
    import uvicorn

    folder = args.model or checkpoint.model_folder()
    config = checkpoint.read_config(folder)
    app = create_app(
        args.replica, checkpoint.load_tokenizer(folder), policy=args.policy, render_chat=chat_template(folder),
        eos_token_id=config.get("eos_token_id"), model_name=Path(folder).name, dead_after=args.dead_after,
    )  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
