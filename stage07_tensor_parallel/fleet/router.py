"""The fleet's front: one OpenAI-compatible endpoint over many replicas (given code).

    app = create_app(["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"], tokenizer, policy="cache_aware")
    python -m stage07_tensor_parallel.fleet.router --replica tcp://10.0.0.5:5555 --replica tcp://10.0.0.6:5555

Replicas are zmq addresses (replica.py), so they may run on this machine or others: start
`python -m stage07_tensor_parallel.fleet.replica --host 0.0.0.0 --port 5555` on each machine and name them
here. This file is the HTTP side; router_state.py holds the replicas, the open requests and their moves,
handoff.py the prefill/decode hand-off, messages.py what goes over zmq; TRIP.md follows one request.

Routes: POST /v1/completions and /v1/chat/completions (stream=true: server-sent events), GET /v1/models,
/health, /fleet/stats. The router tokenizes, applies the chat template, asks the policy for a worker and
forwards the token ids; tokens stream back and are detokenized here. The OpenAI `user` field is the
session id that SessionAffinity keys on. A bad request gets a 400 naming the field; a client that
disconnects aborts its request on the replica (its slots go back at once); on shutdown uvicorn lets every
accepted request finish, and any still open after that gets an error, so none is dropped silently.

Faults (lab3.ipynb §4-§5): a replica that falls silent is dead and its requests move (migration.py);
`breaker` (a factory of breaker.CircuitBreaker) and `admission` (admission.AdmissionControl, a 429 with
Retry-After when no replica can start a request within its TTFT SLO) are off unless given.
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

from labkit.serving import until_disconnected

from .api import ChatCompletion, Completion, chat_template, error, plain_chat, read_body, sse
from .books import Flight, Lost
from .kv_index import KVAware, KVIndex
from .messages import Abort, Error, Token
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

    def token_ids(self, req, chat: bool) -> list[int] | Response:
        """The prompt's token ids, or the 400 that says why there are none."""
        param = "messages" if chat else "prompt"
        if chat:
            try:
                text = self.render_chat([m.model_dump() for m in req.messages])
            except (TemplateError, ValueError) as e:
                return error(400, f"the chat template refused the messages: {e}", param)
            ids = self.tokenizer.encode(text).ids
        elif isinstance(req.prompt, str):
            ids = self.tokenizer.encode(req.prompt).ids
        else:
            ids = req.prompt
            vocab = self.fleet.vocab_size
            if max(ids) >= vocab:
                return error(400, f"prompt: token id {max(ids)} is outside the vocabulary of {vocab} tokens", param)
        if not ids:
            return error(400, f"the {param} is empty after tokenizing", param)
        if len(ids) + req.max_tokens > self.fleet.max_len:
            return error(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the {self.fleet.max_len} tokens "
                "a replica holds; shorten the prompt or lower max_tokens",
                param,
            )
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
        stop = [] if req.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        params = {"temperature": req.temperature, "seed": req.seed, "stop_token_ids": stop}
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
        body = dict(id=rid, created=int(time.time()), model=req.model or self.model_name)
        if req.stream:
            return StreamingResponse(self.stream(flight, body, chat), media_type="text/event-stream")
        try:
            last = await until_disconnected(request, self.final(flight))
            if last is not None and getattr(last, "status", None) != 504:
                flight.ended = True  # finished or refused on the replica: nothing to abort
        finally:
            await self.close(flight)
        if last is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        if isinstance(last, Error):
            return error(last.status or 400, last.message)
        return self.completion(flight, body, last, chat)

    def completion(self, flight: Flight, body: dict, last: Token, chat: bool) -> JSONResponse:
        ids, tokens = flight.prompt, flight.tokens
        text = self.tokenizer.decode(tokens)
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**body, "object": kind, "choices": [choice], "usage": usage})

    async def close(self, flight: Flight) -> None:
        """The request ended (finished, failed, or its client left): free its slots on its replica unless it
        already ended there, then close the router's books on it, once."""
        if not flight.ended:
            flight.ended = True
            await flight.worker.send(Abort(flight.rid))
        if self.fleet.flights.pop(flight.rid, None) is not None:
            self.fleet.release(flight)

    async def next_message(self, flight: Flight) -> Token | Error:
        """The flight's next token or error. A replica that died hands its requests on (fleet.move)."""
        fleet = self.fleet
        while True:
            try:
                msg, via = await asyncio.wait_for(flight.queue.get(), self.request_timeout)
            except TimeoutError:
                fleet.failed(flight.worker)
                return Error(flight.rid, f"no token from the replica for {self.request_timeout} s", status=504)
            if via is not None and via is not flight.worker:
                continue  # queued by a replica this request moved away from (a slow one taken for dead)
            if isinstance(msg, Lost):
                if await fleet.move(flight):
                    continue
                return Error(flight.rid, status=503, message=(
                    f"replica {msg.worker} died after {len(flight.tokens)} tokens of this request and no healthy "
                    "replica is left to continue it; retry later"))  # fmt: skip
            if isinstance(msg, Error) and (msg.status or 500) >= 500:
                fleet.failed(flight.worker)
            elif isinstance(msg, Token):
                if msg.token_id is not None:
                    flight.tokens.append(msg.token_id)
                if msg.finished and flight.worker.breaker is not None:
                    flight.worker.breaker.record_success(time.monotonic())
            return msg

    async def final(self, flight: Flight) -> Token | Error:
        while True:
            msg = await self.next_message(flight)
            if isinstance(msg, Error) or msg.finished:
                return msg

    async def stream(self, flight: Flight, body: dict, chat: bool):
        """SSE chunks of the new text as tokens arrive; closing it (the client left) aborts the request."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent = ""
        try:
            while True:
                msg = await self.next_message(flight)
                if isinstance(msg, Error):
                    if msg.status != 504:
                        flight.ended = True
                    status = msg.status or 500
                    yield sse({"error": {"message": msg.message, "type": "server_error", "code": status}})
                    break
                text = self.tokenizer.decode(flight.tokens)
                if text.endswith("\ufffd") and not msg.finished:
                    continue  # half a UTF-8 character: wait for the rest
                delta, sent = text[len(sent) :], text
                choice = {"index": 0, "finish_reason": msg.finish_reason, "logprobs": None}
                choice |= {"delta": {"role": "assistant", "content": delta}} if chat else {"text": delta}
                if msg.finished:
                    flight.ended = True
                yield sse({**body, "object": kind, "choices": [choice]})
                if msg.finished:
                    break
            yield "data: [DONE]\n\n"
        finally:
            await self.close(flight)


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
