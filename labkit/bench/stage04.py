"""Stage 04 benchmark: continuous batching vs sequential, static batching and HF generate; prefix caching.

    make bench STAGE=04            # LABS_IMPL=solution python -m labkit.bench 04

A seeded workload of requests with mixed prompt and output lengths (EOS ignored, as serving
benchmarks do) on the tiny target, all arriving at once; for each concurrency c the engine runs with
max_num_seqs=c, static batching and HF generate with batches of c. Sequential serving does not
depend on c and runs once. Then TTFT with a shared 512-token system prompt, prefix cache on vs off.

Latency (TTFT, the time to a request's first token; TPOT, the mean time per output token after it) is
measured by `replay`, which feeds requests to the engine at their arrival times, one step at a time,
and timestamps every token as a server would. Two sweeps use it: max_num_batched_tokens (chunked
prefill) against throughput and the p95 gap between two tokens of one request, and goodput, the
requests per second that meet both a TTFT and a TPOT target, against the offered request rate.
"""

import asyncio
import functools
import random
import statistics
import time

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.bench.loadtest import percentile
from labkit.device import pin_threads
from labkit.impl import load
from labkit.testing import hf_from_labkit


def offline_requests(seed: int, n: int, vocab: int, out_range: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    return prompts, [rng.randint(*out_range) for _ in range(n)]


def forward_work(fn, *modules) -> dict:
    """Forward passes and token rows (tokens computed, summed over passes) that fn() runs through the
    run_batch of the given modules (the engine's, and the baselines' that import it)."""
    run_batch = modules[0].run_batch
    work = {"forward_passes": 0, "token_rows": 0}

    def counted(model, cache, seqs, num_tokens, *rest):
        work["forward_passes"] += 1
        work["token_rows"] += sum(num_tokens)
        return run_batch(model, cache, seqs, num_tokens, *rest)

    for m in modules:
        m.run_batch = counted
    try:
        fn()
    finally:
        for m in modules:
            m.run_batch = run_batch
    return work


def workload_floor(model, prompts, max_tokens, batch: int) -> dict:
    """The floor's arguments for serving a whole workload: every sequence's causal forward (its prompt and
    its outputs; the LM head only where a token is sampled, as an engine computes it) at the GEMM rate, or
    the weights read once per decode step, `batch` outputs per step at best, whichever is slower. A prompt
    prefix an earlier prompt already had is computed once at best (prefix caching): only the tokens past
    it count, after it as context (without this, chats sharing a template beat their "floor")."""
    seen, flops = set(), 0.0
    for p, m in zip(prompts, max_tokens, strict=True):
        cached = 0
        while cached < len(p) and tuple(p[: cached + 1]) in seen:
            cached += 1
        seen.update(tuple(p[: i + 1]) for i in range(len(p)))
        flops += floors.forward_flops(model, len(p) - cached + m, context=cached, logits=m)
    return {"flops": flops, "bytes": sum(max_tokens) / batch * floors.weight_bytes(model)}


def _served(name, c, fn, n_tokens, floor: dict) -> dict:
    """Serve the whole workload once with fn() (timed by bench.measure) and summarize it; floor: the
    workload's (workload_floor), against the pass's seconds."""
    t = bench.measure(fn, repeats=1, warmup=0)  # one pass is long; main warms the engine up once
    results = t.last or []
    ttft = [r.first_token_time - r.arrival_time for r in results]
    tpot = [(r.finish_time - r.first_token_time) / max(len(r.token_ids) - 1, 1) for r in results]
    return {
        "variant": name,
        "concurrency": c,
        "tokens_per_s": n_tokens / t.median,
        "ttft_p50_ms": statistics.median(ttft) * 1e3 if ttft else float("nan"),
        "tpot_p50_ms": statistics.median(tpot) * 1e3 if tpot else float("nan"),
        **floors.row(t.median, **floor, name="workload"),
    }


@torch.no_grad()
def hf_padded(hf, prompts: list[list[int]], max_tokens: list[int], batch_size: int) -> None:
    """HF generate on left-padded batches of batch_size, each run to its longest max_tokens."""
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        n = max(max_tokens[b : b + batch_size])
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def throughput_sweep(mods, model, hf, prompts, max_tokens, params, concurrency) -> list[dict]:
    """At each concurrency: the sequential loop (one pass, repeated as a row per concurrency), the engine,
    static batches and HF's padded generate, each serving the whole workload once."""
    engine_mod, _, baselines = mods
    total, floor = sum(max_tokens), functools.partial(workload_floor, model)
    rows = []
    seq_row = _served(
        "sequential", 1, lambda: baselines.sequential(model, prompts, max_tokens), total, floor(prompts, max_tokens, 1)
    )
    for c in concurrency:
        rows.append({**seq_row, "concurrency": c})
        engine = engine_mod.LLMEngine(model, num_blocks=1024, max_num_seqs=c, max_num_batched_tokens=512)
        f = floor(prompts, max_tokens, c)
        rows.append(_served("continuous batching", c, lambda e=engine: e.generate(prompts, params), total, f))
        rows.append(
            _served(
                "static batching", c, lambda c=c: baselines.static_batching(model, prompts, max_tokens, c), total, f
            )
        )
        rows.append(_served("HF generate (padded)", c, lambda c=c: hf_padded(hf, prompts, max_tokens, c), total, f))
    return rows


def headline_ratios(mods, model, prompts, max_tokens, params, rows, quick: bool) -> dict:
    """The headline ratios again, as medians of interleaved repeats (one pass of the sweep is a single sample,
    and at concurrency 1 the engine and the plain loop differ by a few percent), and the forward passes and
    token rows static and continuous batching make, counted."""
    engine_mod, _, baselines = mods

    def at(variant, c):
        return next(r["tokens_per_s"] for r in rows if r["variant"] == variant and r["concurrency"] == c)

    # Five rounds after an untimed one: the static ratio read 1.22x to 1.39x in runs of 3 to 9 rounds
    # made minutes apart on one quiet machine (23 November), so three rounds are too few.
    def engine(c):
        return lambda: engine_mod.LLMEngine(model, num_blocks=1024, max_num_seqs=c).generate(prompts, params)

    head = bench.interleaved(
        {
            "sequential": lambda: baselines.sequential(model, prompts, max_tokens),
            "continuous 1": engine(1),
            "continuous 16": engine(16),
            "static 16": lambda: baselines.static_batching(model, prompts, max_tokens, 16),
        },
        repeats=1 if quick else 5,
        warmup=0 if quick else 1,
    )
    # Why the static ratio is what it is: the work each does, counted (not timed) on the same requests.
    static_work = forward_work(lambda: baselines.static_batching(model, prompts, max_tokens, 16), engine_mod, baselines)
    continuous_work = forward_work(engine(16), engine_mod, baselines)
    ratios = {
        "continuous_vs_sequential_at_1": head["sequential"].median / head["continuous 1"].median,
        "continuous_vs_sequential_at_16": head["sequential"].median / head["continuous 16"].median,
        "continuous_vs_static_at_16": head["static 16"].median / head["continuous 16"].median,
        "continuous_vs_hf_padded_at_16": at("continuous batching", 16) / at("HF generate (padded)", 16),
        "static_vs_continuous_forward_passes_at_16": static_work["forward_passes"] / continuous_work["forward_passes"],
        "static_vs_continuous_token_rows_at_16": static_work["token_rows"] / continuous_work["token_rows"],
    }
    bench.show([ratios], "Throughput ratios, medians of interleaved runs (target >= 3x at 16)")
    print(
        f"At 16, static batching runs {static_work['forward_passes']} forward passes over "
        f"{static_work['token_rows']} token rows, continuous batching {continuous_work['forward_passes']} over "
        f"{continuous_work['token_rows']}. The time ratio nears the passes' ratio when a pass's fixed cost "
        "(its weights streamed, its ops dispatched) outweighs its rows' cost, the rows' ratio when the rows dominate."
    )
    return ratios


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # the tiny model's matrices are too small for threads to pay off
    mods = engine_mod, sequence, _ = bench.stages("stage04_batching", "engine", "sequence", "baselines")
    model, which = bench.model()
    hf = hf_from_labkit(model)
    V = model.config.vocab_size
    n = 16 if quick else 32
    concurrency = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]
    prompts, max_tokens = offline_requests(0, n, V, (8, 32) if quick else (16, 96))
    total = sum(max_tokens)
    params = [sequence.SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    engine_mod.LLMEngine(model, num_blocks=64).generate(prompts[:2], params[:2])  # warm-up
    rows = throughput_sweep(mods, model, hf, prompts, max_tokens, params, concurrency)
    bench.show(rows, f"Throughput on {which}: {n} requests, {total} output tokens")
    ratios = headline_ratios(mods, model, prompts, max_tokens, params, rows, quick)

    prefix = prefix_cache_ttft(engine_mod, sequence, model, V, 4 if quick else 8)
    bench.show(prefix, "TTFT with a shared 512-token system prompt")
    served = server_vs_naive(engine_mod, sequence, model, [4, 16] if quick else [1, 4, 16, 32], 16 if quick else 32)
    bench.show(served["rows"], "HTTP serving, streaming clients (labkit.bench.loadtest)")
    bench.show([served["ratios"]], "Server ratios at concurrency 16")
    lat = latency_sweeps(engine_mod, model, quick)

    plt = plot.setup()
    fig, (ax, ax_chunk, ax_good) = plt.subplots(1, 3, figsize=(16, 4.2))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["concurrency"], r["tokens_per_s"]) for r in rows if r["variant"] == variant]
        ax.plot(*zip(*pts, strict=True), marker="o", label=variant)
    ax.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="output tokens / s", title=which)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.legend()
    plot_latency(lat, ax_chunk, ax_good)
    figures = {"model": which, "ratios": ratios, "prefix_cache": prefix, "server": served, "latency": lat}
    return bench.Result(rows, figures, fig)


def prefix_cache_ttft(engine_mod, sequence, model, vocab: int, n: int) -> list[dict]:
    """Requests one after another, each = the same 512-token system prompt + its own question."""
    rng = random.Random(1)
    system = [1] + [rng.randrange(3, vocab) for _ in range(511)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n + 1)]
    params = sequence.SamplingParams(max_tokens=4, ignore_eos=True)
    rows = []

    def prefill_p50(outs) -> tuple[float, float]:
        cached = statistics.median(o.num_cached_tokens for o in outs)
        return statistics.median(len(p) for p in prompts[1:]) - cached, cached

    for on in (False, True):
        engine = engine_mod.LLMEngine(model, num_blocks=256, enable_prefix_caching=on, max_num_batched_tokens=1024)
        outs = [engine.generate([p], params)[0] for p in prompts]
        ttft = [o.first_token_time - o.arrival_time for o in outs[1:]]  # the first request fills the cache
        rows.append(
            {
                "prefix_cache": "on" if on else "off",
                "ttft_p50_ms": statistics.median(ttft) * 1e3,
                "cached_tokens_p50": statistics.median(o.num_cached_tokens for o in outs[1:]),
                # floor: the median request's prefill FLOPs, its uncached tokens after its cached ones
                **floors.row(
                    statistics.median(ttft),
                    flops=floors.forward_flops(model, *prefill_p50(outs[1:]), logits=1),
                    name="ttft",
                ),
            }
        )
    rows[1]["ttft_speedup"] = rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"]
    rows[0]["ttft_speedup"] = 1.0
    return rows


def server_vs_naive(engine_mod, sequence, model, concurrency: list[int], n: int) -> dict:
    """The continuous-batching server vs the same server limited to one request at a time
    (max_num_seqs=1), driven by labkit.bench.loadtest; plus the server's overhead over the offline engine."""
    from labkit.bench.loadtest import run, workload
    from labkit.serving import serving

    server = load("stage04_batching.api_server")
    tok = bench.tokenizer()
    bodies = workload(0, n, (16, 64))
    rows = []
    prompts, new = [tok.encode(b["prompt"]).ids for b in bodies], [b["max_tokens"] for b in bodies]
    for name, seqs in (("naive (one at a time)", 1), ("continuous batching", 32)):
        engine = engine_mod.LLMEngine(model, tok, num_blocks=1024, max_num_seqs=seqs)
        with serving(server.create_app(engine, tok, max_waiting=1024)) as url:
            for c in concurrency:
                r = asyncio.run(run(url, bodies, c))
                seconds = sum(new) / r["tokens_per_s"]  # ignore_eos: every request makes its max_tokens
                rows.append(
                    {
                        "server": name,
                        **{k: r[k] for k in ("concurrency", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "failed")},
                        **floors.row(seconds, **workload_floor(model, prompts, new, min(c, seqs)), name="workload"),
                    }
                )
    engine = engine_mod.LLMEngine(model, tok, num_blocks=1024, max_num_seqs=16)
    params = [sequence.SamplingParams(max_tokens=b["max_tokens"], ignore_eos=True) for b in bodies]
    t = bench.measure(lambda: engine.generate([b["prompt"] for b in bodies], params), repeats=1, warmup=0)
    offline = sum(len(o.token_ids) for o in t.last) / t.median

    def at(name):
        return next(r["tokens_per_s"] for r in rows if r["server"] == name and r["concurrency"] == 16)

    ratios = {
        "server_vs_naive_at_16": at("continuous batching") / at("naive (one at a time)"),
        "server_fraction_of_offline_engine_at_16": at("continuous batching") / offline,
        "offline_engine_tokens_per_s_at_16": offline,
    }
    return {"rows": rows, "ratios": ratios}


def replay(engine, arrivals: list[tuple[float, list[int], object]]) -> dict:
    """Serve requests that arrive over time on the offline engine, one step at a time, timing each token.

    arrivals: (offset_s, prompt_ids, SamplingParams), sorted by offset. A request joins before the first
    step that starts after its offset, as a server's loop adds requests between steps; its TTFT counts
    from the offset, so time spent waiting for a step or for room in the batch is included.
    Returns {"requests": [{"ttft": s, "gaps": [s between consecutive tokens], "tokens": n}], "seconds": makespan}.
    """
    pending = sorted(arrivals, key=lambda a: a[0], reverse=True)
    token_times: dict[str, list[float]] = {}
    offsets: dict[str, float] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[-1][0] <= now:
            offset, prompt, params = pending.pop()
            request_id = engine.add_request(prompt, params)
            offsets[request_id], token_times[request_id] = offset, []
        if not engine.has_unfinished_requests():
            time.sleep(max(pending[-1][0] - now, 0.0))
            continue
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            token_times[out.request_id].append(now)
    requests = [
        {"ttft": ts[0] - offsets[r], "gaps": [b - a for a, b in zip(ts, ts[1:], strict=False)], "tokens": len(ts)}
        for r, ts in token_times.items()
    ]
    return {"requests": requests, "seconds": time.perf_counter() - t0}


def latency(served: dict, slo_ttft: float = float("inf"), slo_tpot: float = float("inf")) -> dict:
    """Throughput, TTFT and TPOT percentiles, the p95 gap between two tokens of a request, and goodput
    (requests per second that met both SLOs; slo_ttft and slo_tpot in seconds) of one replay."""
    reqs = served["requests"]
    tpot = [sum(r["gaps"]) / len(r["gaps"]) for r in reqs if r["gaps"]]
    met = sum(r["ttft"] <= slo_ttft and (not r["gaps"] or sum(r["gaps"]) / len(r["gaps"]) <= slo_tpot) for r in reqs)
    return {
        "tokens_per_s": sum(r["tokens"] for r in reqs) / served["seconds"],
        "ttft_p50_ms": percentile([r["ttft"] for r in reqs], 50) * 1e3,
        "ttft_p95_ms": percentile([r["ttft"] for r in reqs], 95) * 1e3,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "gap_p95_ms": percentile([g for r in reqs for g in r["gaps"]], 95) * 1e3,
        "slo_met": met / len(reqs),
        "goodput_rps": met / served["seconds"],
    }


def poisson_arrivals(seed: int, n: int, rate: float, vocab: int, prompt_range, out_range) -> list[tuple]:
    """n requests at exponential gaps of mean 1/rate s (rate 0: all at once), long prompts, short outputs."""
    from labkit.impl import load as load_stage

    sequence = load_stage("stage04_batching.sequence")
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range) - 1)]
        params = sequence.SamplingParams(max_tokens=rng.randint(*out_range), ignore_eos=True)
        arrivals.append((t, prompt, params))
        t += rng.expovariate(rate) if rate else 0.0
    return arrivals


def latency_sweeps(engine_mod, model, quick: bool) -> dict:
    """Chunked prefill's trade (max_num_batched_tokens vs throughput and the p95 token gap) and goodput
    against the offered rate, on requests with long prompts (128-384 tokens) and short outputs (8-24)
    arriving as a Poisson process, so that prefills often land while others decode.

    The rates are fractions of the engine's measured capacity (the same requests all at once), and the
    SLOs are multiples of this machine's unloaded latencies, so the sweep means the same on any machine:
    TTFT <= 5x one request's prefill of the longest prompt, TPOT <= 3x a batch-1 decode step."""
    n = 8 if quick else 16
    V = model.config.vocab_size
    prompt_range, out_range = (128, 384), (8, 24)

    def engine(budget):
        return engine_mod.LLMEngine(model, num_blocks=1024, max_num_seqs=16, max_num_batched_tokens=budget)

    engine(512).generate([[1] * 64], engine_mod.SamplingParams(max_tokens=4))  # warm-up
    alone = replay(engine(512), poisson_arrivals(9, 1, 0, V, (384, 384), (32, 32)))["requests"][0]
    slo_ttft, slo_tpot = 5 * alone["ttft"], 3 * sum(alone["gaps"]) / len(alone["gaps"])
    capacity = n / replay(engine(512), poisson_arrivals(2, n, 0, V, prompt_range, out_range))["seconds"]

    def with_floors(row: dict, arrivals) -> dict:
        """row + the floors of its p50 TTFT and TPOT: the median prompt's prefill FLOPs; one decode step's
        read of the weights and the median prompt's K/V (queueing and batching only add to both)."""
        p50 = statistics.median(len(prompt) for _, prompt, _ in arrivals)
        return {
            **row,
            **floors.row(row["ttft_p50_ms"] / 1e3, flops=floors.forward_flops(model, p50, logits=1), name="ttft_p50"),
            **floors.row(row["tpot_p50_ms"] / 1e3, bytes=floors.decode_bytes(model, round(p50)), name="tpot_p50"),
        }

    budgets = [32, 512] if quick else [16, 32, 64, 128, 256, 512]
    arrivals = poisson_arrivals(2, n, 1.5 * capacity, V, prompt_range, out_range)  # prefills land mid-decode
    chunked = [
        with_floors({"max_num_batched_tokens": b, **latency(replay(engine(b), arrivals), slo_ttft, slo_tpot)}, arrivals)
        for b in budgets
    ]

    loads = [0.5, 1.5] if quick else [0.25, 0.5, 0.75, 1.0, 1.5, 2.0]
    goodput = []
    for budget in (64, 512):
        for x in loads:
            arrivals = poisson_arrivals(3, n, x * capacity, V, prompt_range, out_range)
            row = latency(replay(engine(budget), arrivals), slo_ttft, slo_tpot)
            goodput.append(
                with_floors({"max_num_batched_tokens": budget, "offered_rps": x * capacity, **row}, arrivals)
            )
    print(bench.table(chunked, f"Chunked prefill at {1.5 * capacity:.2f} requests/s"))
    slo = f"TTFT <= {slo_ttft * 1e3:.0f} ms, TPOT <= {slo_tpot * 1e3:.0f} ms"
    print(bench.table(goodput, f"Goodput ({slo}); capacity {capacity:.2f} requests/s"))
    return {
        "capacity_rps": capacity,
        "slo_ttft_ms": slo_ttft * 1e3,
        "slo_tpot_ms": slo_tpot * 1e3,
        "chunked_prefill": chunked,
        "goodput": goodput,
    }


def plot_latency(lat: dict, ax_chunk, ax_good) -> None:
    """Throughput against the p95 token gap for each token budget; goodput against the offered rate."""
    chunk = lat["chunked_prefill"]
    ax_chunk.plot([r["gap_p95_ms"] for r in chunk], [r["tokens_per_s"] for r in chunk], marker="o")
    for r in chunk:
        ax_chunk.annotate(str(r["max_num_batched_tokens"]), (r["gap_p95_ms"], r["tokens_per_s"]), fontsize=8)
    ax_chunk.set(xlabel="p95 gap between two tokens (ms)", ylabel="output tokens / s", title="max_num_batched_tokens")
    for budget in dict.fromkeys(r["max_num_batched_tokens"] for r in lat["goodput"]):
        pts = [(r["offered_rps"], r["goodput_rps"]) for r in lat["goodput"] if r["max_num_batched_tokens"] == budget]
        ax_good.plot(*zip(*pts, strict=True), marker="o", label=f"max_num_batched_tokens={budget}")
    slo = f"SLO: TTFT <= {lat['slo_ttft_ms']:.0f} ms, TPOT <= {lat['slo_tpot_ms']:.0f} ms"
    ax_good.set(xlabel="offered requests / s", ylabel="goodput (requests / s within SLO)", title=slo)
    ax_good.legend()


if __name__ == "__main__":
    main()
