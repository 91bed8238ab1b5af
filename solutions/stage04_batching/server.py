"""An OpenAI-compatible HTTP server on the continuous-batching engine.

    python -m stage04_batching.serve            # the tiny target on http://127.0.0.1:8000

One background task owns the engine and runs engine.step() in a worker thread, so every HTTP client
shares the same batch. Each request gets its outputs through its own asyncio.Queue; streaming
responses send them as server-sent events (`data: {...}` chunks, then `data: [DONE]`).
"""

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field

from .engine import LLMEngine, RequestOutput
from .sequence import SamplingParams


class QueueFull(Exception):
    pass


class CompletionRequest(BaseModel):
    model: str | None = None
    prompt: str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # a vLLM extension that load tests use for fixed output lengths


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(CompletionRequest):
    prompt: str = ""
    messages: list[ChatMessage] = Field(min_length=1)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llm_requests", "Requests by final status", ["status"], registry=r)
        self.running = Gauge("llm_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("llm_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_blocks = Gauge("llm_kv_blocks_in_use", "KV-cache blocks owned by sequences", registry=r)
        self.tokens = Counter("llm_generation_tokens", "Output tokens generated", registry=r)
        self.ttft = Histogram("llm_time_to_first_token_seconds", "Time to first token", registry=r)
        self.itl = Histogram("llm_inter_token_latency_seconds", "Time between two output tokens", registry=r)


class AsyncEngine:
    """Owns the engine. Handlers call submit/abort from the event loop; the loop task applies them
    between steps, so the engine itself is only ever touched by one step at a time."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 64):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = Metrics()
        self.queues: dict[str, asyncio.Queue] = {}
        self.pending: list[tuple[list[int], SamplingParams, str]] = []
        self.aborts: list[str] = []
        self.wakeup = asyncio.Event()
        self.last_token: dict[str, float] = {}
        self.task: asyncio.Task | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + len(self.pending)

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Graceful shutdown: abort whatever is in flight, tell its handlers, stop the loop."""
        for request_id in list(self.queues):
            self.abort(request_id, notify=True)
        self.wakeup.set()
        await asyncio.sleep(0)
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Admission control: raise QueueFull when max_waiting requests already wait, else queue the
        request for the loop and return its id and the queue its outputs will arrive on."""
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (max {self.max_waiting})")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        self.pending.append((prompt_ids, params, request_id))
        self.wakeup.set()
        return request_id, queue

    def abort(self, request_id: str, notify: bool = False) -> None:
        """Stop a request (client gone, timeout, shutdown); its blocks are freed before the next step."""
        queue = self.queues.pop(request_id, None)
        if queue is None:
            return
        self.aborts.append(request_id)
        self.metrics.requests.labels("abort").inc()
        if notify:
            queue.put_nowait(None)
        self.wakeup.set()

    async def _loop(self) -> None:
        """Forever: apply queued submits and aborts, sleep on `wakeup` while there is no work, otherwise
        run one engine.step() in a worker thread and put each output on its request's queue (dropping
        the queue once the request finishes)."""
        while True:
            for prompt_ids, params, request_id in self.pending:
                if request_id in self.queues:
                    self.engine.add_request(prompt_ids, params, request_id)
            for request_id in self.aborts:
                self.engine.abort(request_id)
                self.last_token.pop(request_id, None)
            self.pending, self.aborts = [], []
            self._observe()
            if not self.engine.has_unfinished_requests():
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            outputs = await asyncio.to_thread(self.engine.step)
            now = time.perf_counter()
            for out in outputs:
                self._record(out, now)
                queue = self.queues.get(out.request_id)
                if queue is None:  # aborted while the step ran; its abort is applied next iteration
                    continue
                queue.put_nowait(out)
                if out.finished:
                    del self.queues[out.request_id]
                    self.metrics.requests.labels(out.finish_reason).inc()

    def _record(self, out: RequestOutput, now: float) -> None:
        m = self.metrics
        m.tokens.inc()
        last = self.last_token.get(out.request_id)
        if last is None:
            m.ttft.observe(now - out.arrival_time)
        else:
            m.itl.observe(now - last)
        if out.finished:
            self.last_token.pop(out.request_id, None)
        else:
            self.last_token[out.request_id] = now

    def _observe(self) -> None:
        self.metrics.running.set(len(self.engine.scheduler.running))
        self.metrics.waiting.set(self.num_waiting)
        self.metrics.kv_blocks.set(self.engine.block_manager.num_used_blocks)


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


async def stream_events(
    core: AsyncEngine, request_id: str, queue: asyncio.Queue, chunk, timeout: float
) -> AsyncIterator[str]:
    """Server-sent events of one request: `data: <chunk(out)>` per output with text or a finish reason,
    then `data: [DONE]`. If the client disconnects (the generator is closed or cancelled) or a token takes
    longer than `timeout`, the request is aborted so its KV blocks are freed."""
    finished = False
    try:
        while not finished:
            out = await asyncio.wait_for(queue.get(), timeout)
            if out is None:  # server shutting down
                break
            finished = out.finished
            if out.delta_text or finished:
                yield f"data: {json.dumps(chunk(out))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            core.abort(request_id)


def create_app(
    engine: LLMEngine,
    tokenizer,
    model_name: str = "tiny-target",
    max_waiting: int = 64,
    request_timeout: float = 60.0,
) -> FastAPI:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    core: AsyncEngine | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal core
        core = AsyncEngine(engine, max_waiting)
        app.state.core = core
        core.start()
        yield
        await core.stop()

    app = FastAPI(title="stage04 inference server", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return error(400, f"{field}: {first['msg']}" if field else first["msg"], field)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "course"}]}

    @app.get("/metrics")
    async def metrics():
        core._observe()
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def serve(req: CompletionRequest, prompt: str, chat: bool):
        ids = tokenizer.encode(prompt).ids
        if not ids:
            return error(400, "the prompt is empty", "prompt")
        if len(ids) + req.max_tokens > engine.max_model_len:
            return error(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context of "
                f"{engine.max_model_len} tokens",
                "messages" if chat else "prompt",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        params = SamplingParams(req.max_tokens, req.temperature, 0, req.top_p, req.seed, stop, req.ignore_eos)
        try:
            request_id, queue = core.submit(ids, params)
        except QueueFull as e:
            return error(429, f"server busy: {e}; retry later", headers={"Retry-After": "1"})
        created, name = int(time.time()), req.model or model_name

        def usage(out: RequestOutput) -> dict:
            n = len(out.token_ids)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        def chunk(out: RequestOutput) -> dict:
            reason = out.finish_reason if out.finished else None
            if chat:
                choice = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": out.delta_text},
                    "finish_reason": reason,
                }
            else:
                choice = {"index": 0, "text": out.delta_text, "logprobs": None, "finish_reason": reason}
            kind = "chat.completion.chunk" if chat else "text_completion"
            body = {"id": request_id, "object": kind, "created": created, "model": name, "choices": [choice]}
            if out.finished and (req.stream_options or {}).get("include_usage"):
                body["usage"] = usage(out)
            return body

        if req.stream:
            events = stream_events(core, request_id, queue, chunk, request_timeout)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            out = await asyncio.wait_for(_last(queue), request_timeout)
        except TimeoutError:
            core.abort(request_id)
            return error(504, f"request timed out after {request_timeout} s")
        finally:
            core.abort(request_id)  # no-op once finished; frees the blocks if the handler was cancelled
        if out is None:
            return error(503, "server is shutting down")
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None}
        choice["finish_reason"] = out.finish_reason
        kind = "chat.completion" if chat else "text_completion"
        return {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": name,
            "choices": [choice],
            "usage": usage(out),
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await serve(req, req.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        prompt = "".join(f"{m.role}: {m.content}\n" for m in req.messages) + "assistant:"
        return await serve(req, prompt, chat=True)

    return app


async def _last(queue: asyncio.Queue) -> RequestOutput | None:
    while True:
        out = await queue.get()
        if out is None or out.finished:
            return out
