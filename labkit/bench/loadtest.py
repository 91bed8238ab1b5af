"""Drive an OpenAI-compatible server with N concurrent streaming clients and report latency figures.

    python -m labkit.bench.loadtest --url http://127.0.0.1:8000 --concurrency 16 --requests 64
    python -m labkit.bench.loadtest --url http://127.0.0.1:8000 --chaos   # serve with --fault-marker "<fault>"

The workload is seeded: prompts are the openings of held-out stories, output lengths are drawn
uniformly, and EOS is ignored (`ignore_eos`, as vLLM's benchmarks do) so every run generates the
same number of tokens. Reports aggregate output tokens/s and TTFT / TPOT percentiles.

--chaos mixes into that load clients that disconnect (streaming and not), invalid bodies, and
requests that fail inside the engine (their prompt holds the server's fault marker), then checks
that every healthy request completed, no KV block is left in use, and the server still serves.
"""

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time

import httpx

from .. import corpus
from ..serving import FAULT_MARKER
from ..timing import table


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

    # a fresh connection per request: llama-server closes a streamed one as the client reuses it, and that
    # client saw "Server disconnected" (both servers pay the same connect, ~0.1 ms)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
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
        **(
            {"error": f"HTTP status {sorted({r['status'] for r in results if r['status'] != 200})}"}
            if len(ok) < len(results)
            else {}
        ),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p90_ms": percentile(ttft, 90) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
        "seconds": wall,
    }


# Bodies every server must refuse with a 4xx: broken JSON, each field outside its domain, a lone
# surrogate, and a body larger than any context (1 MB).
INVALID_BODIES = [
    b"{not json",
    b'{"prompt": "\\ud800 lone surrogate"}',
    b'{"prompt": "x", "temperature": 1e-40}',
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "top_p": 0}',
    b'{"prompt": "x", "max_tokens": 0}',
    b'{"prompt": "x", "stop": [""]}',
    b'{"prompt": "x", "seed": 100000000000000000000000}',
    json.dumps({"prompt": "word " * 200_000}).encode(),
]


async def _chaos_one(client: httpx.AsyncClient, kind: str, body: dict, rng: random.Random) -> str:
    """Send one chaos request; returns its outcome ("completed", "failed-alone", "rejected", "gone", ...)."""
    if kind == "invalid":
        r = await client.post("/v1/completions", content=rng.choice(INVALID_BODIES))
        return "rejected" if 400 <= r.status_code < 500 else f"invalid got {r.status_code}"
    if kind == "drop-plain":  # a non-streaming client that gives up after a moment
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                client.post("/v1/completions", json={**body, "stream": False}), rng.uniform(0.05, 0.3)
            )
        return "gone"
    if kind in ("healthy-plain", "fault-plain"):
        r = await client.post("/v1/completions", json={**body, "stream": False})
        if kind == "fault-plain":
            return "failed-alone" if r.status_code == 500 else f"fault got {r.status_code}"
        return (
            "completed" if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] else f"got {r.status_code}"
        )
    async with client.stream("POST", "/v1/completions", json=body) as r:
        cut, events, error, done = rng.randint(1, 8), 0, False, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            error |= line.startswith('data: {"error"')
            done |= line == "data: [DONE]"
            if kind == "drop-stream" and events >= cut:
                return "gone"  # leaving the context closes the connection mid-stream
    if kind == "fault-stream":
        return "failed-alone" if error and done else f"fault stream ended without an error event ({r.status_code})"
    return "completed" if r.status_code == 200 and done and not error else f"healthy stream got {r.status_code}"


async def _kv_cache_usage(client: httpx.AsyncClient, settle: float) -> float:
    """vllm:kv_cache_usage_perc from /metrics (the fraction of KV blocks sequences hold), polled until it is
    0 or `settle` seconds pass."""
    deadline = time.perf_counter() + settle
    while True:
        text = (await client.get("/metrics")).text
        used = next(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")
        )
        if used == 0 or time.perf_counter() > deadline:
            return used
        await asyncio.sleep(0.1)


async def chaos(url: str, n: int = 64, concurrency: int = 16, seed: int = 0, timeout: float = 120.0) -> dict:
    """n requests, `concurrency` at a time: about half healthy (streaming or not), the rest clients that
    disconnect (streaming or not), invalid bodies, and requests holding FAULT_MARKER (the server must run
    with fail_on_marker as its engine's fault_hook: `serve --fault-marker '<fault>'`). Returns counts and
    `ok`: every healthy request completed, every invalid one got a 4xx, every fault failed alone (500, or an
    error event in its stream), 0 KV blocks in use afterwards, and /health and a new request still answer."""
    rng = random.Random(seed)
    kinds = (
        ["healthy"] * 8 + ["drop-stream"] * 2 + ["drop-plain"] * 2 + ["invalid"] * 3 + ["fault-stream", "fault-plain"]
    )
    jobs = [(rng.choice(kinds), body) for body in workload(seed, n, (8, 64))]
    jobs = [
        (kind, {**body, "prompt": FAULT_MARKER + " " + body["prompt"]} if kind.startswith("fault") else body)
        for kind, body in jobs
    ]
    outcomes: list[tuple[str, str]] = []
    todo = list(jobs)

    async def worker(client):
        while todo:
            kind, body = todo.pop(0)
            with contextlib.suppress(httpx.TransportError):
                outcomes.append((kind, await _chaos_one(client, kind, body, rng)))
                continue
            outcomes.append((kind, "transport error"))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=concurrency)) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        usage = await _kv_cache_usage(c, settle=10.0)
        health = (await c.get("/health")).status_code
        after = await c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})

    def count(kind_prefix: str, outcome: str | None = None) -> int:
        return sum(k.startswith(kind_prefix) and (outcome is None or o == outcome) for k, o in outcomes)

    report = {
        "requests": len(outcomes),
        "healthy": count("healthy"),
        "healthy_completed": count("healthy", "completed"),
        "disconnected": count("drop", "gone"),
        "invalid": count("invalid"),
        "invalid_rejected": count("invalid", "rejected"),
        "faults": count("fault"),
        "faults_failed_alone": count("fault", "failed-alone"),
        "kv_cache_usage": usage,
        "still_serving": health == 200 and after.status_code == 200,
        "seconds": time.perf_counter() - t0,
    }
    report["problems"] = sorted(
        {f"{k}: {o}" for k, o in outcomes if o not in ("completed", "gone", "rejected", "failed-alone")}
    )
    report["ok"] = (
        report["healthy_completed"] == report["healthy"]
        and report["invalid_rejected"] == report["invalid"]
        and report["faults_failed_alone"] == report["faults"]
        and usage == 0
        and report["still_serving"]
    )
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Load-test an OpenAI-compatible completions server.")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chaos", action="store_true", help="mix disconnects, invalid bodies and engine faults in")
    args = ap.parse_args(argv)
    if args.chaos:
        report = asyncio.run(chaos(args.url, args.requests, args.concurrency[-1], args.seed))
        print(table([{k: v for k, v in report.items() if k != "problems"}], f"{args.url}: chaos"))
        for problem in report["problems"]:
            print("  ", problem)
        sys.exit(0 if report["ok"] else 1)
    bodies = workload(args.seed, args.requests)
    rows = [asyncio.run(run(args.url, bodies, c)) for c in args.concurrency]
    print(table(rows, f"{args.url}: {args.requests} streaming requests per concurrency level"))


if __name__ == "__main__":
    main()
