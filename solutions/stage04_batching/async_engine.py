"""The engine core of the server: ONE background task owns the LLMEngine, and HTTP handlers talk to it
through submit/abort and a per-request asyncio.Queue, so every client shares one continuous batch.

    core = AsyncEngine(engine); core.start()              # inside a running event loop
    request_id, queue = core.submit(prompt_ids, params)   # outputs (or an EngineError) arrive on queue

Faults end where they start. The engine finishes a request whose forward pass or sampling raises with
reason "error"; the loop fails a request that add_request refuses (400: its input, else 500); if the
loop itself dies, the supervisor answers every request 503 at once and restarts on a clean engine,
or stays down, and says so through health(), when the engine cannot be cleaned.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .engine import LLMEngine, RequestOutput
from .metrics import Metrics
from .protocol import SSE_DONE, error_body, sse
from .sequence import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Admission refused: max_waiting requests already wait (the route answers 429)."""


@dataclass(frozen=True)
class EngineError:
    """What a request's queue gets instead of a final output when the request fails: HTTP status, reason."""

    status: int
    message: str


class AsyncEngine:
    """Owns the engine. Handlers call submit/abort from the event loop; the loop task applies them
    between steps, so the engine itself is only ever touched by one step at a time."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 64, stall_timeout: float = 30.0, model_name: str = ""):
        self.engine = engine
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.metrics = Metrics(model_name)  # model_name labels every series, as vLLM's
        self.queues: dict[str, asyncio.Queue] = {}
        self.pending: list[tuple[list[int], SamplingParams, str]] = []
        self.aborts: list[str] = []
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.step_started: float | None = None  # time.monotonic() when the running engine step began
        self.num_steps = 0
        self.dead: str | None = None  # why the loop is down for good
        # every step on one thread: torch's OpenMP team belongs to the thread that runs it (serve.py says why one)
        self.stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + len(self.pending)

    def health(self) -> str | None:
        """None while the loop is alive and making progress, else what is wrong."""
        if self.dead:
            return self.dead
        if self.task is None or self.task.done():
            return "the engine loop is not running"
        if self.step_started is not None and time.monotonic() - self.step_started > self.stall_timeout:
            return f"an engine step has been running for over {self.stall_timeout} s"
        return None

    def start(self) -> None:
        self.task = asyncio.create_task(self._supervise())

    async def stop(self) -> None:
        """Graceful shutdown: fail whatever is in flight with 503, stop the loop."""
        self._fail_all(503, "the server is shutting down")
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

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, timeout); its blocks are freed before the next step.
        A finished, failed or unknown id is ignored."""
        if self.queues.pop(request_id, None) is None:
            return
        self.aborts.append(request_id)
        self.metrics.finish(request_id, "abort")
        self.wakeup.set()

    def fail(self, request_id: str, status: int, message: str) -> None:
        """End a request with an EngineError on its queue (its handler answers status and message)."""
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(EngineError(status=status, message=message))
            self.metrics.finish(request_id, "error")

    async def step(self) -> list[RequestOutput]:
        """One engine.step() in a worker thread, so the event loop serves HTTP meanwhile; records metrics."""
        self.step_started = time.monotonic()
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(self.stepper, self.engine.step)
        finally:
            self.step_started = None
        self.num_steps += 1
        for out in outputs:
            if out.request_id in self.queues:
                self.metrics.record(out)
        self.metrics.observe(self.engine, self.num_waiting)
        return outputs

    async def _loop(self) -> None:
        """Forever: apply queued submits and aborts, sleep on `wakeup` while there is no work, otherwise
        run one self.step() and put each output on its request's queue (dropping the queue once the
        request finishes). Call the given self.step(), not engine.step(): besides the worker thread, it
        records every output in self.metrics (metrics.record) and the queue and KV gauges once per step
        (metrics.observe), so skipping it leaves /metrics at 0.

        One request's fault fails that request only: if add_request raises, fail(...) it with 400 for a
        ValueError (its input) or 500 for anything else; an output with finish_reason "error" (the engine
        could not run or sample it) is fail(...)ed with 500 and out.error. Anything else that raises
        propagates: the supervisor answers every request 503 and restarts the loop."""
        while True:
            for prompt_ids, params, request_id in self.pending:
                if request_id not in self.queues:
                    continue  # aborted before it reached the engine
                try:
                    self.engine.add_request(prompt_ids, params, request_id)
                except ValueError as e:
                    self.fail(request_id, 400, str(e))
                except Exception as e:
                    self.fail(request_id, 500, f"the engine could not add the request: {type(e).__name__}: {e}")
            for request_id in self.aborts:
                self.engine.abort(request_id)
            self.pending, self.aborts = [], []
            if not self.engine.has_unfinished_requests():
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            for out in await self.step():
                queue = self.queues.get(out.request_id)
                if queue is None:
                    continue  # aborted while the step ran; its abort is applied next iteration
                if out.finish_reason == "error":
                    self.fail(out.request_id, 500, f"the engine failed this request: {out.error}")
                    continue
                queue.put_nowait(out)
                if out.finished:
                    del self.queues[out.request_id]

    async def _supervise(self) -> None:
        """Run _loop. If it dies: every waiting and running request gets 503 at once, the engine aborts
        everything, and the loop restarts on the clean engine. It stays down (`dead`, so /health says why)
        when cleaning fails, or when the loop died without completing a step since it last started: a
        fault that recurs at once would only restart forever."""
        while True:
            steps = self.num_steps
            try:
                await self._loop()
                raise RuntimeError("AsyncEngine._loop returned; it must run forever")
            except Exception as e:
                reason = f"the engine loop failed: {type(e).__name__}: {e}"
                log.exception(reason)
                self._fail_all(503, f"{reason}; retry the request")
                try:
                    self.engine.abort_all()
                    used = self.engine.block_manager.num_used_blocks
                    if used or self.engine.has_unfinished_requests():
                        raise RuntimeError(f"{used} KV blocks still in use after aborting every request")
                except Exception as cleanup:
                    self.dead = f"{reason}; resetting the engine failed too ({type(cleanup).__name__}: {cleanup})"
                if not self.dead and self.num_steps == steps:
                    self.dead = f"{reason}; it completed no step since it started, so it stays down"
                if self.dead:
                    log.error("the engine loop stays down: %s", self.dead)
                    return
                self.metrics.observe(self.engine, self.num_waiting)

    def _fail_all(self, status: int, message: str) -> None:
        for request_id in list(self.queues):
            self.fail(request_id, status, message)
        self.pending, self.aborts = [], []


async def stream_events(
    core: AsyncEngine, request_id: str, queue: asyncio.Queue, chunk: Callable[[RequestOutput], dict], timeout: float
) -> AsyncIterator[str]:
    """Server-sent events of one request: sse(chunk(out)) per output with text or a finish reason, then
    SSE_DONE. The status line (200) has gone out already, so a failure is an event too: an EngineError on
    the queue, or no output for `timeout` seconds (EngineError(status=504, ...)), ends the stream with
    sse(error_body(status, message)) and SSE_DONE. If the client disconnects (the generator is closed or
    cancelled) or the stream ends before its last output, the request is aborted so its KV blocks are freed."""
    finished = False
    try:
        while not finished:
            try:
                item = await asyncio.wait_for(queue.get(), timeout)
            except TimeoutError:
                item = EngineError(status=504, message=f"no output for {timeout} s")
            if isinstance(item, EngineError):
                yield sse(error_body(item.status, item.message))
                break
            finished = item.finished
            if item.delta_text or finished:
                yield sse(chunk(item))
        yield SSE_DONE
    finally:
        if not finished:
            core.abort(request_id)
