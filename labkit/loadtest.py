"""Drive an OpenAI-compatible server with N concurrent streaming clients and report latency figures.

    python -m labkit.loadtest --url http://127.0.0.1:8000 --concurrency 16 --requests 64

The workload is seeded: prompts are the openings of held-out stories, output lengths are drawn
uniformly, and EOS is ignored (`ignore_eos`, as vLLM's benchmarks do) so every run generates the
same number of tokens. Reports aggregate output tokens/s and TTFT / TPOT percentiles.
"""

import argparse
import asyncio
import contextlib
import json
import random
import socket
import threading
import time

import httpx

from . import corpus
from .bench import table


def workload(seed: int, n: int, max_tokens: tuple[int, int] = (16, 128)) -> list[dict]:
    """n request bodies for /v1/completions (stream=True, greedy)."""
    rng = random.Random(seed)
    stories = corpus.valid_texts(max(n, 8))
    bodies = []
    for i in range(n):
        words = stories[i % len(stories)].split()
        bodies.append(
            {
                "prompt": " ".join(words[: rng.randint(8, 60)]),
                "max_tokens": rng.randint(*max_tokens),
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return bodies


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


async def _one(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter()
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    end = time.perf_counter()
    first = first or end
    return {"status": 200, "ttft": first - t0, "tpot": (end - first) / max(tokens - 1, 1), "tokens": tokens}


async def run(url: str, bodies: list[dict], concurrency: int, timeout: float = 600.0) -> dict:
    """Closed loop: `concurrency` clients, each sending its next request when the previous one ends."""
    todo = list(bodies)
    results: list[dict] = []

    async def worker(client):
        while todo:
            results.append(await _one(client, todo.pop(0)))

    limits = httpx.Limits(max_connections=concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p90_ms": percentile(ttft, 90) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
        "seconds": wall,
    }


@contextlib.contextmanager
def serving(app, timeout: float = 30.0):
    """Run an ASGI app with uvicorn on a free 127.0.0.1 port in a thread; yields its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start within {timeout} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Load-test an OpenAI-compatible completions server.")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    bodies = workload(args.seed, args.requests)
    rows = [asyncio.run(run(args.url, bodies, c)) for c in args.concurrency]
    print(table(rows, f"{args.url}: {args.requests} streaming requests per concurrency level"))


if __name__ == "__main__":
    main()
