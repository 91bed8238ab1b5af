"""Stage 04 benchmark: continuous batching vs sequential, static batching and HF generate; prefix caching.

    make bench STAGE=04            # LABS_IMPL=solution python -m labkit.bench 04

A seeded workload of requests with mixed prompt and output lengths (EOS ignored, as serving
benchmarks do) on the tiny target, all arriving at once; for each concurrency c the engine runs with
max_num_seqs=c, static batching and HF generate with batches of c. Sequential serving does not
depend on c and runs once. Then TTFT with a shared 512-token system prompt, prefix cache on vs off.
"""

import asyncio
import random
import statistics

import torch

from labkit import bench, plot
from labkit.device import pin_threads
from labkit.impl import load
from labkit.testing import hf_from_labkit


def offline_requests(seed: int, n: int, vocab: int, out_range: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    return prompts, [rng.randint(*out_range) for _ in range(n)]


def _served(name, c, fn, n_tokens) -> dict:
    """Serve the whole workload once with fn() (timed by bench.measure) and summarize it."""
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


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # the tiny model's matrices are too small for threads to pay off
    engine_mod = load("stage04_batching.engine")
    sequence = load("stage04_batching.sequence")
    baselines = load("stage04_batching.baselines")
    model, which = bench.model()
    hf = hf_from_labkit(model)
    V = model.config.vocab_size
    n = 16 if quick else 32
    concurrency = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]
    prompts, max_tokens = offline_requests(0, n, V, (8, 32) if quick else (16, 96))
    total = sum(max_tokens)
    params = [sequence.SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    engine_mod.LLMEngine(model, num_blocks=64).generate(prompts[:2], params[:2])  # warm-up

    rows = []
    seq_row = _served("sequential", 1, lambda: baselines.sequential(model, prompts, max_tokens), total)
    for c in concurrency:
        rows.append({**seq_row, "concurrency": c})
        engine = engine_mod.LLMEngine(model, num_blocks=1024, max_num_seqs=c, max_num_batched_tokens=512)
        rows.append(_served("continuous batching", c, lambda e=engine: e.generate(prompts, params), total))
        rows.append(
            _served("static batching", c, lambda c=c: baselines.static_batching(model, prompts, max_tokens, c), total)
        )
        rows.append(_served("HF generate (padded)", c, lambda c=c: hf_padded(hf, prompts, max_tokens, c), total))
    print(bench.table(rows, f"Throughput on {which}: {n} requests, {total} output tokens"))

    def at(variant, c):
        return next(r["tokens_per_s"] for r in rows if r["variant"] == variant and r["concurrency"] == c)

    c_ref = 16
    ratios = {
        "continuous_vs_sequential_at_16": at("continuous batching", c_ref) / at("sequential", c_ref),
        "continuous_vs_static_at_16": at("continuous batching", c_ref) / at("static batching", c_ref),
        "continuous_vs_hf_padded_at_16": at("continuous batching", c_ref) / at("HF generate (padded)", c_ref),
    }
    print(bench.table([{k: v for k, v in ratios.items()}], "Throughput ratios at concurrency 16 (target >= 3x)"))

    prefix = prefix_cache_ttft(engine_mod, sequence, model, V, 4 if quick else 8)
    print(bench.table(prefix, "TTFT with a shared 512-token system prompt"))
    served = server_vs_naive(engine_mod, sequence, model, [4, 16] if quick else [1, 4, 16, 32], 16 if quick else 32)
    print(bench.table(served["rows"], "HTTP serving, streaming clients (labkit.loadtest)"))
    print(bench.table([served["ratios"]], "Server ratios at concurrency 16"))

    plt = plot.setup()
    fig, ax = plt.subplots()
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["concurrency"], r["tokens_per_s"]) for r in rows if r["variant"] == variant]
        ax.plot(*zip(*pts, strict=True), marker="o", label=variant)
    ax.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="output tokens / s", title=which)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.legend()
    return bench.Result(rows, {"model": which, "ratios": ratios, "prefix_cache": prefix, "server": served}, fig)


def prefix_cache_ttft(engine_mod, sequence, model, vocab: int, n: int) -> list[dict]:
    """Requests one after another, each = the same 512-token system prompt + its own question."""
    rng = random.Random(1)
    system = [1] + [rng.randrange(3, vocab) for _ in range(511)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n + 1)]
    params = sequence.SamplingParams(max_tokens=4, ignore_eos=True)
    rows = []
    for on in (False, True):
        engine = engine_mod.LLMEngine(model, num_blocks=256, enable_prefix_caching=on, max_num_batched_tokens=1024)
        outs = [engine.generate([p], params)[0] for p in prompts]
        ttft = [o.first_token_time - o.arrival_time for o in outs[1:]]  # the first request fills the cache
        rows.append(
            {
                "prefix_cache": "on" if on else "off",
                "ttft_p50_ms": statistics.median(ttft) * 1e3,
                "cached_tokens_p50": statistics.median(o.num_cached_tokens for o in outs[1:]),
            }
        )
    rows[1]["ttft_speedup"] = rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"]
    rows[0]["ttft_speedup"] = 1.0
    return rows


def server_vs_naive(engine_mod, sequence, model, concurrency: list[int], n: int) -> dict:
    """The continuous-batching server vs the same server limited to one request at a time
    (max_num_seqs=1), driven by labkit.loadtest; plus the server's overhead over the offline engine."""
    from labkit.loadtest import run, serving, workload

    server = load("stage04_batching.api_server")
    tok = bench.tokenizer()
    bodies = workload(0, n, (16, 64))
    rows = []
    for name, seqs in (("naive (one at a time)", 1), ("continuous batching", 32)):
        engine = engine_mod.LLMEngine(model, tok, num_blocks=1024, max_num_seqs=seqs)
        with serving(server.create_app(engine, tok, max_waiting=1024)) as url:
            for c in concurrency:
                r = asyncio.run(run(url, bodies, c))
                rows.append(
                    {
                        "server": name,
                        **{k: r[k] for k in ("concurrency", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "failed")},
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


if __name__ == "__main__":
    main()
