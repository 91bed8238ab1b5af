"""The fleet's front: one OpenAI-compatible endpoint over many replicas (given code).

    app = create_app(["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"], tokenizer, policy="cache_aware")
    python -m stage07_tensor_parallel.fleet.router --replica tcp://10.0.0.5:5555 --replica tcp://10.0.0.6:5555

Replicas are zmq addresses (replica.py), so they may run on this machine or others: start
`python -m stage07_tensor_parallel.fleet.replica --host 0.0.0.0 --port 5555` on each machine and name them
here. This file is the HTTP app; front.py answers its requests, router_state.py holds the replicas, the open requests and their moves,
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
import contextlib
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .api import chat_template, plain_chat
from .front import Front
from .kv_index import KVAware, KVIndex
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
