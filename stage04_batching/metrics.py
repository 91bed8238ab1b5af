"""Prometheus metrics of the server under vLLM's names (`vllm:num_requests_running`, ...), each labelled
with the served model's name as vLLM labels them, so vLLM's Grafana dashboards and load generators that
read vLLM's /metrics read this server's. Given code.

    vllm:request_success_total{finished_reason}   requests by how they ended: stop, length, abort, error
    vllm:num_requests_running / _waiting          sequences in the running batch / requests not admitted yet
    vllm:kv_cache_usage_perc                      fraction of the KV blocks that sequences hold (0 to 1)
    vllm:prompt_tokens_total, _generation_tokens_total
    vllm:prefix_cache_queries_total, _hits_total  prompt tokens looked up in the prefix cache / found there
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds
"""

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine import LLMEngine, RequestOutput

# Seconds; prometheus_client's default buckets stop at 10 s, which a CPU's long request passes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, model_name: str = ""):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name

        def make(kind, name: str, doc: str, labels=(), **kw):
            return kind(f"vllm:{name}", doc, ["model_name", *labels], registry=r, **kw)

        self.requests = make(Counter, "request_success", "Finished requests by finish reason", ["finished_reason"])
        self.running = make(Gauge, "num_requests_running", "Sequences in the running batch")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting for admission")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks owned by sequences")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests that got a first token")
        self.tokens = make(Counter, "generation_tokens", "Output tokens generated")
        self.cache_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.cache_hits = make(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        timing = dict(buckets=LATENCY_BUCKETS)
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token", **timing)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Time between two output tokens", **timing)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to last token", **timing)
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.tokens, self.cache_queries):
            metric.labels(model_name)  # a series from the start, at 0, as vLLM's
        self.cache_hits.labels(model_name)
        self.last_token: dict[str, float] = {}  # request id -> when its latest token arrived

    def record(self, out: RequestOutput) -> None:
        """Count one output of a step: a token (TTFT or inter-token latency) and, if final, its status."""
        now = time.perf_counter()
        name = self.model_name
        last = self.last_token.pop(out.request_id, None)
        if out.finish_reason == "error":
            return  # no token; AsyncEngine.fail counts the request
        self.tokens.labels(name).inc()
        if last is None:
            self.ttft.labels(name).observe(now - out.arrival_time)
            if out.index == 0:  # the prompt is computed once, by the first of a request's n samples
                self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                self.cache_queries.labels(name).inc(len(out.prompt_token_ids))
                self.cache_hits.labels(name).inc(out.num_cached_tokens)
        else:
            self.itl.labels(name).observe(now - last)
        if out.finished:
            self.requests.labels(name, out.finish_reason).inc()
            self.e2e.labels(name).observe(now - out.arrival_time)
        else:
            self.last_token[out.request_id] = now

    def finish(self, request_id: str, status: str) -> None:
        """A request that ended outside the engine's outputs: aborted, refused at admission, failed."""
        self.last_token.pop(request_id, None)
        self.requests.labels(self.model_name, status).inc()

    def observe(self, engine: LLMEngine, num_waiting: int) -> None:
        name = self.model_name
        self.running.labels(name).set(len(engine.scheduler.running))
        self.waiting.labels(name).set(num_waiting)
        self.kv_usage.labels(name).set(engine.block_manager.num_used_blocks / engine.config.num_blocks)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


CONTENT_TYPE = CONTENT_TYPE_LATEST
