"""The router's answer to one OpenAI request (given code): read and check the body, tokenize, refuse what
no replica can start, route the Flight, then stream or collect the replica's tokens, detokenized here, where
stop strings end the output. router.py mounts it on the HTTP routes; TRIP.md follows one request through it."""

import asyncio
import logging
import math
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from labkit.serving import RequestRefused, check_request, until_disconnected

from .api import ChatCompletion, Completion, error, held_back, read_body, sse, stop_at
from .books import Flight, Lost
from .messages import Abort, Error, Token
from .metrics import RouterMetrics
from .router_state import RouterState

log = logging.getLogger(__name__)


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
