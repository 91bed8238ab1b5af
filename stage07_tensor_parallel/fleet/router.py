"""The fleet's front: one OpenAI-compatible endpoint over many replicas (given code).

    app = create_app(["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"], tokenizer, policy="cache_aware")
    python -m stage07_tensor_parallel.fleet.router --replica tcp://10.0.0.5:5555 --replica tcp://10.0.0.6:5555

Replicas are zmq addresses (replica.py), so they may run on this machine or others: start
`python -m stage07_tensor_parallel.fleet.replica --host 0.0.0.0 --port 5555` on each machine and name them
here. This file is the HTTP side; router_state.py holds the replicas, the open requests and their moves,
handoff.py the prefill/decode hand-off, messages.py what goes over zmq; TRIP.md follows one request.

Routes: POST /v1/completions and /v1/chat/completions (stream=true: server-sent events), GET /v1/models,
/health, /metrics (Prometheus, metrics.py), /fleet/stats. The router tokenizes, applies the chat template,
asks the policy for a worker and forwards the token ids; tokens stream back and are detokenized here, where
stop strings end the output (the replica's request is aborted). The fields are stage 04's server's where a
replica can serve them (api.py). The OpenAI `user` field is the session id that SessionAffinity keys on.
A bad request gets a 400 naming the field; a client that
disconnects aborts its request on the replica (its slots go back at once); on shutdown uvicorn lets every
accepted request finish, and any still open after that gets an error, so none is dropped silently.

Faults (lab3.ipynb §4-§5). A replica that falls silent for `dead_after` seconds is dead and its requests
move (migration.py); it beats from a thread of its own, so a long engine step is not silence. With no
healthy replica left the client gets an error, never a hang. `breaker` (a
factory of breaker.CircuitBreaker) gives each replica a circuit breaker fed by its failures (timeouts,
replica errors, death); a replica whose breaker is not closed is out of the candidates, and a stats request
is the half-open probe. `admission` (admission.AdmissionControl) answers 429 with Retry-After when no
healthy replica can start a new request within its TTFT SLO. Both are off unless given.
"""

import argparse
import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST

from labkit.serving import RequestRefused, check_request, until_disconnected

from .api import ChatCompletion, Completion, chat_template, error, held_back, plain_chat, read_body, sse, stop_at
from .books import Flight, Lost
from .kv_index import KVAware, KVIndex
from .messages import Abort, Error, Token
from .metrics import RouterMetrics
from .policies import CacheAware, LeastOutstanding, Policy, PowerOfTwo, RoundRobin, SessionAffinity
from .router_state import RouterState

log = logging.getLogger(__name__)
POLICIES = {p.name: p for p in (RoundRobin, LeastOutstanding, PowerOfTwo, SessionAffinity, CacheAware, KVAware)}


def make_policy(name: str, index: KVIndex, page_size: int, **options) -> Policy:
    """A policy by name (round_robin, least_outstanding, power_of_two, session_affinity, cache_aware, kv_aware)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; pick one of {', '.join(POLICIES)}")
    if name == "kv_aware":
        return KVAware(index, page_size, **options)
    return POLICIES[name](**options)


def unfinished(e: NotImplementedError) -> JSONResponse:
    """The request reached learner code that is still a TODO: an OpenAI error that names it (the router's
    console says it too), instead of a bare 500."""
    log.error("a request reached unfinished code: %s", e)
    return error(501, f"the fleet reached code that is not written yet: {e}")


class Front:
    """The OpenAI endpoints over a RouterState: a request in, a Flight out to a replica, tokens back."""

    def __init__(self, fleet: RouterState, tokenizer, render_chat, eos_token_id, model_name, request_timeout):
        self.fleet, self.tokenizer, self.render_chat = fleet, tokenizer, render_chat
        self.eos_token_id, self.model_name, self.request_timeout = eos_token_id, model_name, request_timeout
        self.metrics = RouterMetrics(fleet, model_name)

    def token_ids(self, req, chat: bool) -> list[int] | Response:
        """The prompt's token ids, or the 400 that says why there are none."""
        param = "messages" if chat else "prompt"
        if chat:
            try:
                text = self.render_chat([m.model_dump() for m in req.messages])
            except (TemplateError, ValueError) as e:
                return error(400, f"the chat template refused the messages: {e}", param)
            ids = self.tokenizer.encode(text).ids
        else:
            ids = self.tokenizer.encode(req.prompt).ids if isinstance(req.prompt, str) else req.prompt
        try:  # the checks stage 04's server makes, against what every replica holds
            check_request(ids, req.max_tokens, max_model_len=self.fleet.max_len, vocab_size=self.fleet.vocab_size,
                          prompt_param=param)  # fmt: skip
        except RequestRefused as e:
            return error(400, str(e), e.param)
        return ids

    def refuse(self, ids: list[int]) -> Response | None:
        """503 when no replica is healthy; 429 when admission control says the fleet is over its SLO."""
        fleet = self.fleet
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
        return None

    async def create(self, request: Request, chat: bool) -> Response:
        req = await read_body(request, ChatCompletion if chat else Completion)
        if isinstance(req, Response):
            return req
        ids = self.token_ids(req, chat)
        if isinstance(ids, Response):
            return ids
        try:
            if (refused := self.refuse(ids)) is not None:
                return refused
        except NotImplementedError as e:  # admission control or a breaker is a TODO still
            return unfinished(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stop_ids = [] if req.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        params = {"temperature": req.temperature, "seed": req.seed, "stop_token_ids": stop_ids}
        flight = self.fleet.flights[rid] = Flight(rid, ids, req.max_tokens, params, req.user, asyncio.Queue())
        try:
            routed = await self.fleet.route(flight)
        except NotImplementedError as e:  # the policy is a TODO still: say which, and keep no books on it
            self.fleet.flights.pop(rid)
            self.fleet.release(flight)
            return unfinished(e)
        if not routed:  # only prefill replicas are left
            self.fleet.flights.pop(rid)
            return error(
                503, "no healthy decode replica: every one is dead or has its circuit breaker open; retry later"
            )
        self.metrics.routed(len(ids))
        body = dict(id=rid, created=int(time.time()), model=req.model or self.model_name)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(
                self.stream(flight, body, chat, req.stops(), usage), media_type="text/event-stream"
            )
        last = None
        try:
            last = await until_disconnected(request, self.final(flight, req.stops()))
        finally:
            await self.close(flight, "abort" if last is None else "error" if isinstance(last, Error) else last)
        if last is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        if isinstance(last, Error):
            return error(last.status or 400, last.message)
        text, _ = self.output(flight, req.stops())
        choice = {"index": 0, "finish_reason": last, "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**body, "object": kind, "choices": [choice], "usage": self.usage(flight)})

    def output(self, flight: Flight, stops: list[str]) -> tuple[str, bool]:
        """The text of the tokens received so far, up to the first stop string, and whether it holds one."""
        text = self.tokenizer.decode(flight.tokens)
        cut = stop_at(text, stops)
        return (text, False) if cut is None else (text[:cut], True)

    def usage(self, flight: Flight) -> dict:
        prompt, out = len(flight.prompt), len(flight.tokens)
        cached = {"cached_tokens": flight.num_cached_tokens or 0}
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                "prompt_tokens_details": cached}  # fmt: skip

    async def close(self, flight: Flight, reason: str) -> None:
        """The request ended (finished, failed, stopped by a stop string, or its client left): free its slots on
        its replica unless it already ended there, then close the router's books on it, once."""
        if not flight.ended:
            flight.ended = True
            await flight.worker.send(Abort(flight.rid))
        if self.fleet.flights.pop(flight.rid, None) is not None:
            self.fleet.release(flight)
            self.metrics.finished(flight.arrival, reason)

    async def next_message(self, flight: Flight) -> Token | Error:
        """The flight's next token or error. A replica that died hands its requests on (fleet.move)."""
        fleet = self.fleet
        while True:
            try:
                msg, via = await asyncio.wait_for(flight.queue.get(), self.request_timeout)
            except TimeoutError:
                if time.monotonic() - flight.worker.progressed < self.request_timeout:
                    continue  # its replica is stepping (other requests' prefills, on a loaded machine): queued
                fleet.failed(flight.worker)
                return Error(flight.rid, f"no token and no engine step for {self.request_timeout} s", status=504)
            if via is not None and via is not flight.worker:
                continue  # queued by a replica this request moved away from (a slow one taken for dead)
            if isinstance(msg, Lost):
                if await fleet.move(flight):
                    continue
                return Error(flight.rid, status=503, message=(
                    f"replica {msg.worker} died after {len(flight.tokens)} tokens of this request and no healthy "
                    "replica is left to continue it; retry later"))  # fmt: skip
            flight.ended = isinstance(msg, Error) or msg.finished  # it ended on the replica: nothing to abort
            if isinstance(msg, Error) and (msg.status or 500) >= 500:
                fleet.failed(flight.worker)
            elif isinstance(msg, Token):
                if flight.num_cached_tokens is None:
                    flight.num_cached_tokens = msg.num_cached_tokens
                if msg.token_id is not None:
                    flight.tokens.append(msg.token_id)
                    self.metrics.token(flight.arrival, first=len(flight.tokens) == 1)
                if msg.finished and flight.worker.breaker is not None:
                    flight.worker.breaker.record_success(time.monotonic())
            return msg

    async def final(self, flight: Flight, stops: list[str]) -> str | Error:
        """The finish reason once the request is done ("stop" when a stop string ends it), or its error."""
        while True:
            msg = await self.next_message(flight)
            if isinstance(msg, Error):
                return msg
            if self.output(flight, stops)[1]:
                return "stop"
            if msg.finished:
                return msg.finish_reason

    async def stream(self, flight: Flight, body: dict, chat: bool, stops: list[str], usage: bool):
        """SSE chunks of the new text as tokens arrive (text that may begin a stop string waits for the next
        token), then the usage chunk if asked for; closing it (the client left) aborts the request."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent, reason = 0, "abort"
        try:
            while True:
                msg = await self.next_message(flight)
                if isinstance(msg, Error):
                    reason = "error"
                    yield sse({"error": {"message": msg.message, "type": "server_error", "code": msg.status or 500}})
                    break
                text, stopped = self.output(flight, stops)
                finished = stopped or msg.finished
                end = len(text) if finished else len(text) - held_back(text, stops)
                if not finished and (text.endswith("\ufffd") or end <= sent):
                    continue  # half a UTF-8 character, or text that may begin a stop string: wait for the rest
                choice = {"index": 0, "finish_reason": None, "logprobs": None}
                choice |= (
                    {"delta": {"role": "assistant", "content": text[sent:end]}} if chat else {"text": text[sent:end]}
                )
                sent = end
                if finished:
                    reason = choice["finish_reason"] = "stop" if stopped else msg.finish_reason
                yield sse({**body, "object": kind, "choices": [choice]})
                if finished:
                    break
            if usage and reason != "error":
                yield sse({**body, "object": kind, "choices": [], "usage": self.usage(flight)})
            yield "data: [DONE]\n\n"
        finally:
            await self.close(flight, reason)


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
    while its replica completes no step (heartbeats count them) before a request fails with 504; drop_events: the fraction of KV events to drop (a lossy network);
    breaker: () -> a breaker.CircuitBreaker for each replica (None: no breaker); admission: an
    admission.AdmissionControl (None: every request is queued); dead_after: seconds of silence after which
    a replica is dead and its requests move.
    """
    ctx = zmq.asyncio.Context.instance()
    policy_for = functools.partial(make_policy, policy, **(policy_options or {}))  # (index, page_size) -> policy
    fleet = RouterState(replicas, policy_for, drop_events, seed, ctx, breaker, admission, dead_after)
    front = Front(fleet, tokenizer, render_chat or plain_chat, eos_token_id, model_name, request_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await fleet.start()
        yield
        await fleet.stop()

    app = FastAPI(title="stage07 fleet router", lifespan=lifespan)
    app.state.fleet = fleet

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.create(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await front.create(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "course"}]}

    @app.get("/health")
    async def health():
        healthy = len(fleet.candidates())
        return {"status": "ok" if healthy else "unavailable", "replicas": len(fleet.workers), "healthy": healthy}

    @app.get("/metrics")
    async def metrics():
        return Response(front.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/fleet/stats")
    async def fleet_stats():
        return await fleet.report()

    return app


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
