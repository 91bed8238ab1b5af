"""The router's Prometheus /metrics (given code): what its clients saw, under the names stage 04's server
and vLLM use, and what the fleet looks like, read from the router's state at each scrape.

    vllm:request_success_total{finished_reason}      requests by how they ended: stop, length, abort, error
    vllm:prompt_tokens_total, vllm:generation_tokens_total
    vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds
    vllm:num_requests_running                        requests open at the router
    fleet_replicas{state}                            replicas alive (and in the candidates) or dead
    fleet_requests_moved_total                       requests moved off a replica that fell silent
    fleet_requests_rejected_total                    requests admission control answered 429
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self, fleet, model_name: str):
        self.fleet, self.model_name = fleet, model_name
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter("vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests routed", labels, registry=r)
        self.tokens = Counter("vllm:generation_tokens", "Output tokens received from replicas", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the end", labels,
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        r.register(self)  # collect(): the fleet's state, read at each scrape

    def routed(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def token(self, arrival: float, first: bool) -> None:
        """One output token of a request that arrived at `arrival` (time.monotonic())."""
        self.tokens.labels(self.model_name).inc()
        if first:
            self.ttft.labels(self.model_name).observe(time.monotonic() - arrival)

    def finished(self, arrival: float, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(time.monotonic() - arrival)

    def collect(self):
        fleet, name = self.fleet, self.model_name
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests open at the router", labels=["model_name"])
        running.add_metric([name], len(fleet.flights))
        replicas = GaugeMetricFamily("fleet_replicas", "Replicas by state", labels=["model_name", "state"])
        healthy = sum(w.alive and (w.breaker is None or w.breaker.state == "closed") for w in fleet.workers.values())
        dead = sum(not w.alive for w in fleet.workers.values())
        for state, count in (("healthy", healthy), ("dead", dead), ("total", len(fleet.workers))):
            replicas.add_metric([name, state], count)
        moved = CounterMetricFamily(
            "fleet_requests_moved", "Requests moved off a silent replica", labels=["model_name"]
        )
        moved.add_metric([name], fleet.moved)
        rejected = CounterMetricFamily("fleet_requests_rejected", "Requests answered 429", labels=["model_name"])
        rejected.add_metric([name], fleet.rejected)
        yield from (running, replicas, moved, rejected)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
