"""Prometheus metrics of the server, named after vLLM's: request outcomes, batch occupancy, KV blocks,
tokens, time to first token and inter-token latency. Given code."""

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine import LLMEngine, RequestOutput


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("llm_requests", "Requests by final status", ["status"], registry=r)
        self.running = Gauge("llm_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("llm_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_blocks = Gauge("llm_kv_blocks_in_use", "KV-cache blocks owned by sequences", registry=r)
        self.tokens = Counter("llm_generation_tokens", "Output tokens generated", registry=r)
        self.ttft = Histogram("llm_time_to_first_token_seconds", "Time to first token", registry=r)
        self.itl = Histogram("llm_inter_token_latency_seconds", "Time between two output tokens", registry=r)
        self.last_token: dict[str, float] = {}  # request id -> when its latest token arrived

    def record(self, out: RequestOutput) -> None:
        """Count one output of a step: a token (TTFT or inter-token latency) and, if final, its status."""
        now = time.perf_counter()
        last = self.last_token.pop(out.request_id, None)
        if out.finish_reason == "error":
            return  # no token; AsyncEngine.fail counts the request
        self.tokens.inc()
        if last is None:
            self.ttft.observe(now - out.arrival_time)
        else:
            self.itl.observe(now - last)
        if out.finished:
            self.requests.labels(out.finish_reason).inc()
        else:
            self.last_token[out.request_id] = now

    def finish(self, request_id: str, status: str) -> None:
        """A request that ended outside the engine's outputs: aborted, refused at admission, failed."""
        self.last_token.pop(request_id, None)
        self.requests.labels(status).inc()

    def observe(self, engine: LLMEngine, num_waiting: int) -> None:
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(num_waiting)
        self.kv_blocks.set(engine.block_manager.num_used_blocks)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


CONTENT_TYPE = CONTENT_TYPE_LATEST
