"""The HTTP routes of the OpenAI-compatible server (given code; vLLM: entrypoints/openai/api_server.py).

    app = create_app(engine, tokenizer)    # python -m stage04_batching.serve runs it with uvicorn

/v1/completions and /v1/chat/completions (streaming or not), /v1/models, /health, /metrics. A completions
prompt may be a batch (text or token ids each): every prompt is its own engine request, and choice p * n + i
is sample i of prompt p. With a LoRAEngine, `"model": "tiny-target:zoe"` (or vLLM's bare adapter name, `"zoe"`)
picks the adapter. A request is checked before it costs anything: its body size before parsing, every field
against what the engine can take, its length against the context after tokenizing (in a worker thread, so a
large prompt does not stall other clients' streams; labkit.serving.check_request, which the engine also
calls). A client that disconnects, streaming or not, aborts its request.

Front answers one request (read, check, tokenize, constrain, submit, stream or collect); create_app mounts it
on the routes, as the fleet's router.py mounts its front.py.
"""

import asyncio
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import Template, TemplateError
from pydantic import ValidationError

from labkit.serving import RequestRefused, check_request, until_disconnected

from .async_engine import AsyncEngine, EngineError, QueueFull, stream_events
from .byte_dfa import compile_regex
from .engine import LLMEngine
from .lora_engine import LoRAEngine
from .metrics import CONTENT_TYPE
from .protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    SamplingRequest,
    error,
    error_body,
    render_chat,
    sse,
    validation_error,
)
from .sequence import RequestOutput, sibling_ids


def _compile_worker(server_pid: int) -> None:
    """The compile process's start: low priority, and gone once the server is (a killed server skips the
    pool's shutdown, and a worker blocked on its queue would otherwise live on)."""
    os.nice(10)

    def watch() -> None:
        while os.getppid() == server_pid:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="server-watch").start()


class Front:
    """The OpenAI endpoints over an AsyncEngine: a request in, checked, tokenized and constrained off the event
    loop, one engine request per prompt out, their outputs back as one reply (streamed or whole)."""

    def __init__(self, core: AsyncEngine, engine: LLMEngine, tokenizer, model_name, request_timeout, chat_template):
        self.core, self.engine, self.tokenizer = core, engine, tokenizer
        self.model_name, self.request_timeout, self.chat_template = model_name, request_timeout, chat_template
        self.adapters = sorted(engine.registry.paths) if isinstance(engine, LoRAEngine) else []
        # No prompt the context can hold takes more bytes than this, even with every byte JSON-escaped (\u00XX).
        longest_token = max(len(token) for token in tokenizer.get_vocab())
        self.max_body_bytes = 6 * longest_token * engine.max_model_len + 16_384
        # One tokenizing thread: large prompts queue for one core instead of taking every core from the engine.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # The vocabulary's trie and each pattern's first row: never on the tokenizing thread.
        self.mask_pool = ThreadPoolExecutor(1, thread_name_prefix="mask")
        # Constraints compile in another process, at low priority: a pattern's second of pure-Python CPU would
        # hold the GIL that tokenization, the engine's steps and /health need (vLLM compiles grammars in a
        # background pool too). One worker leaves a core to serving; spawn, not fork: this process runs threads.
        self.compile_pool = ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_compile_worker, initargs=(os.getpid(),)
        )

    async def start(self) -> None:
        self.core.start()
        # Start the compile worker now: spawning it costs a fraction of a second of CPU, not a client's.
        await asyncio.wrap_future(self.compile_pool.submit(compile_regex, "warm"))

    async def stop(self) -> None:
        await self.core.stop()
        self.tokenize_pool.shutdown(wait=False)
        self.compile_pool.shutdown(wait=True, cancel_futures=True)  # at most one compile, within its budget
        self.mask_pool.shutdown(wait=False)

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); LookupError if none matches."""
        model_name, adapters = self.model_name, self.adapters
        if model is None or model == model_name:
            return None
        name = model.removeprefix(f"{model_name}:")
        if name in adapters:
            return name
        if adapters or ":" in model:
            served = ", ".join([model_name, *(f"{model_name}:{a}" for a in adapters)])
            raise LookupError(f"the model {model!r} does not exist; this server serves {served}")
        return None  # a server without adapters answers whatever model name a client sends

    async def compile_constraint(self, pattern: str | bytes) -> None:
        """Put a guided pattern's token index in the engine's cache (ValueError past a budget of
        byte_dfa's) and compute its first row, so the engine's step does not pay for it."""
        loop, engine = asyncio.get_running_loop(), self.engine
        if engine.guided_backend is not None:  # llguidance or XGrammar: native code, compiled on a thread
            await loop.run_in_executor(self.mask_pool, engine.guided_backend.compile, pattern)
            return
        await loop.run_in_executor(self.mask_pool, engine.vocab_trie)  # the engine can take constraints at all
        if pattern not in engine.token_indexes:
            dfa = await loop.run_in_executor(self.compile_pool, compile_regex, pattern)
            index = engine.token_index(pattern, dfa)
        else:
            index = engine.token_index(pattern)
        await loop.run_in_executor(self.mask_pool, index.row, index.initial)

    def check(self, ids: list[int], req: SamplingRequest, param: str) -> None:
        """labkit's request checks against this engine (the engine makes them again when it adds the request)."""
        check_request(
            ids,
            req.max_tokens,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model.config.vocab_size,
            logit_bias=req.logit_bias or (),
            n=req.n,
            max_num_seqs=self.engine.config.max_num_seqs,
            prompt_param=param,
        )

    def submit(
        self, prompt_ids: list[list[int]], params
    ) -> tuple[list[list[str]], list[list[asyncio.Queue]]] | Response:
        """Each prompt as its own request of the engine's batch: the ids of its n sequences and their queues
        (the engine forks the n - 1 siblings, whose outputs need queues before the loop runs), or the 429."""
        core = self.core
        submitted: list[tuple[str, asyncio.Queue]] = []
        try:
            for ids in prompt_ids:
                submitted.append(core.submit(ids, params))
        except QueueFull as e:
            for request_id, _ in submitted:
                core.abort(request_id)
            return error(429, f"server busy: {e}; retry later", headers={"Retry-After": "1"})
        families = [sibling_ids(request_id, params.n) for request_id, _ in submitted]
        queues = [
            [queue] + [core.queues.setdefault(i, asyncio.Queue()) for i in family[1:]]
            for family, (_, queue) in zip(families, submitted, strict=True)
        ]
        return families, queues

    async def create(self, request: Request, chat: bool) -> Response:
        """POST /v1/completions (chat=False) or /v1/chat/completions: read and check the request, tokenize
        it, compile its constraint, submit its prompts, then stream or collect the reply."""
        req = await read_request(request, ChatCompletionRequest if chat else CompletionRequest, self.max_body_bytes)
        if isinstance(req, Response):
            return req
        try:
            lora = self.adapter_of(req.model)
        except LookupError as e:
            return error(404, str(e), "model")
        prompts = None if chat else req.prompts()  # each text or token ids (lm-evaluation-harness sends ids)
        if prompts is not None and len(prompts) > self.core.max_waiting:
            why = f"a batch of {len(prompts)} prompts is more than the {self.core.max_waiting} requests that may wait"
            return error(400, f"prompt: {why}; send fewer per request", "prompt")
        prompt_ids = await self.prepare(req, chat, prompts, lora)
        if isinstance(prompt_ids, Response):
            return prompt_ids
        submitted = self.submit(prompt_ids, dataclasses.replace(req.to_sampling_params(), lora=lora))
        if isinstance(submitted, Response):
            return submitted
        families, queues = submitted
        reply = self.reply(req, chat, prompts, prompt_ids, families[0][0])
        if req.stream:
            return self.stream(reply, families, queues)
        return await self.collect(request, reply, families, queues, len(prompt_ids), req.n)

    async def prepare(self, req: SamplingRequest, chat: bool, prompts, lora: str | None) -> list[list[int]] | Response:
        """The prompts' token ids, tokenized on the tokenizing thread, checked against the engine and with the
        request's constraint compiled; or the 400 that says which field cannot run, or the 503."""
        param = "messages" if chat else "prompt"

        def tokenize() -> list[list[int]]:
            # encode_batch releases the GIL while it works (encode does not), so the event loop runs meanwhile
            texts = (
                [render_chat(req.messages, self.chat_template)] if chat else [p for p in prompts if isinstance(p, str)]
            )
            encoded = iter(e.ids for e in self.tokenizer.encode_batch(texts))
            return [next(encoded)] if chat else [next(encoded) if isinstance(p, str) else p for p in prompts]

        try:
            prompt_ids = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, tokenize)
        except (ValueError, TemplateError) as e:  # a chat template that refuses these messages
            return error(400, f"the chat template refused the messages: {e}", param)
        if req.n > 1 and lora is not None:
            return error(400, f"n: {req.n} samples with a LoRA adapter cannot be served; send separate requests", "n")
        try:
            for i, ids in enumerate(prompt_ids):  # a batch names the prompt that cannot run: prompt.2
                self.check(ids, req, param if len(prompt_ids) == 1 else f"{param}.{i}")
        except RequestRefused as e:
            return error(400, str(e), e.param)
        try:  # structured output: compile the constraint (once per pattern) off the event loop
            pattern = req.guided_pattern()
            if pattern is not None:
                await self.compile_constraint(pattern)
        except ValueError as e:
            return error(400, str(e), "guided_regex" if req.guided_regex is not None else "response_format")
        problem = self.core.health()
        if problem:
            return error(503, f"the engine is unavailable: {problem}")
        return prompt_ids

    def reply(self, req: SamplingRequest, chat: bool, prompts, prompt_ids: list[list[int]], request_id: str):
        """The ResponseBuilder that words this request's outputs as OpenAI chunks or one final body."""
        tokenizer, echo = self.tokenizer, getattr(req, "echo", False)
        return ResponseBuilder(
            request_id=request_id,
            model=req.model or self.model_name,
            chat=chat,
            num_prompt_tokens=sum(len(ids) for ids in prompt_ids),
            n=req.n,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            token_text=lambda t: tokenizer.decode([t], skip_special_tokens=False),
            echo=[p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if echo else None,
            echo_only=echo and req.max_tokens == 0,
        )

    def stream(self, reply: ResponseBuilder, families, queues) -> StreamingResponse:
        """stream=true: every sequence's events, merged into one server-sent-event stream."""
        streams = [
            stream_events(self.core, i, q, functools.partial(reply.chunk, prompt=p), None)  # merge_streams times out
            for p, (family, prompt_queues) in enumerate(zip(families, queues, strict=True))
            for i, q in zip(family, prompt_queues, strict=True)
        ]
        merged = merge_streams(streams, reply, lambda: self.core.num_steps, self.request_timeout)
        return StreamingResponse(merged, media_type="text/event-stream")

    async def collect(self, request: Request, reply: ResponseBuilder, families, queues, num_prompts: int, n: int):
        """stream=false: wait for every sequence's last output and answer them in one body (choice p * n + i)."""
        core = self.core
        try:
            outs = await until_disconnected(
                request, final_outputs([q for qs in queues for q in qs], lambda: core.num_steps, self.request_timeout)
            )
        finally:
            for i in (i for family in families for i in family):
                core.abort(i)  # frees the blocks on timeout or disconnect; a no-op once it finished
        if outs is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        if isinstance(outs, EngineError):
            return error(outs.status, outs.message)
        return JSONResponse(reply.final([outs[p * n : (p + 1) * n] for p in range(num_prompts)]))


def create_app(
    engine: LLMEngine,
    tokenizer,
    model_name: str = "tiny-target",
    max_waiting: int = 64,
    request_timeout: float = 60.0,
    stall_timeout: float = 30.0,
    chat_template: Template | None = None,
) -> FastAPI:
    """The FastAPI app over `engine` (whose steps it runs) and its `tokenizers.Tokenizer`.

    max_waiting: requests allowed to wait for admission before new ones get 429.
    request_timeout: seconds a request may wait for its next output while the engine completes no step before it
        fails with 504 (one queued behind other requests' long prefills on a loaded machine waits on).
    stall_timeout: seconds one engine step may run before /health reports the engine stalled.
    chat_template: from protocol.load_chat_template; None formats chats as `role: content` lines.
    """
    core = AsyncEngine(engine, max_waiting, stall_timeout, model_name)
    front = Front(core, engine, tokenizer, model_name, request_timeout, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.start()
        yield
        await front.stop()

    app = FastAPI(title="stage04 inference server", lifespan=lifespan)
    app.state.core = core

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.create(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await front.create(request, chat=True)

    @app.get("/v1/models")
    async def models():
        base = {"id": model_name, "object": "model", "created": 0, "owned_by": "course"}
        loras = [{**base, "id": f"{model_name}:{a}", "parent": model_name} for a in front.adapters]
        return {"object": "list", "data": [base, *loras]}

    @app.get("/health")
    async def health():
        problem = core.health()
        if problem:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        core.metrics.observe(engine, core.num_waiting)
        return Response(core.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


async def read_request(request: Request, schema: type[SamplingRequest], max_bytes: int) -> SamplingRequest | Response:
    """The validated body, or the error response: 413 past max_bytes (counted as it arrives, before
    parsing), 400 for invalid JSON or a bad field (naming the field)."""
    declared = request.headers.get("content-length", "")
    too_big = error(413, f"the request body exceeds {max_bytes} bytes, more than any prompt the context holds")
    if declared.isdigit() and int(declared) > max_bytes:
        return too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            return too_big
    try:
        return schema.model_validate(json.loads(body))
    except ValidationError as e:
        return validation_error(e)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
        return error(400, f"the body is not valid JSON: {e}")


async def next_item(queue: asyncio.Queue, steps: Callable[[], int], timeout: float) -> RequestOutput | EngineError:
    """The queue's next item, or EngineError(504) once `timeout` seconds pass in which it gets none and the
    engine completes no step (`steps()` counts them): a stuck engine, not a long queue."""
    seen = steps()
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout)
        except TimeoutError:
            if steps() == seen:
                return EngineError(status=504, message=f"no output and no engine step for {timeout} s")
            seen = steps()


async def final_outputs(
    queues: list[asyncio.Queue], steps: Callable[[], int], timeout: float
) -> list[RequestOutput] | EngineError:
    """The last output of each of a request's n sequences, or the first EngineError among them (the
    first sequence's comes first: if the engine refuses the request, its siblings never start)."""
    outs = []
    for queue in queues:
        out = await next_item(queue, steps, timeout)
        while not isinstance(out, EngineError) and not out.finished:
            out = await next_item(queue, steps, timeout)
        if isinstance(out, EngineError):
            return out
        outs.append(out)
    return outs


async def merge_streams(
    streams: list[AsyncIterator[str]], reply: ResponseBuilder, steps: Callable[[], int], timeout: float
) -> AsyncIterator[str]:
    """The events of a request's n streams as one: each choice's chunks as they come; an error event ends
    the others; then the usage chunk (stream_options.include_usage) and one [DONE], sent once every stream
    still running has sent its own. No event for `timeout` seconds while the engine completes no step ends
    it with a 504 error event. Closing this generator (the client left) cancels the streams, and each aborts
    its sequence."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[str]) -> None:
        try:
            async for event in stream:
                events.put_nowait((i, event))
        finally:
            events.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended, done, failed = set(), set(), None
        while len(ended) < len(tasks):
            item = await next_item(events, steps, timeout)
            if isinstance(item, EngineError):
                yield sse(error_body(item.status, item.message))
                yield SSE_DONE
                return
            i, event = item
            if event is None:
                ended.add(i)
            elif event == SSE_DONE:
                done.add(i)
            elif failed is None:
                yield event
                if event.startswith('data: {"error"'):
                    failed = i
                    for j, task in enumerate(tasks):
                        if j != i:
                            task.cancel()
        if failed is not None:
            if failed in done:
                yield SSE_DONE
        elif len(done) == len(tasks):
            if reply.include_usage:
                yield sse(reply.usage_chunk())
            yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
