"""Stage 02 benchmark: generation with the KV cache against re-running the whole sequence.

    make bench STAGE=02          (LABS_IMPL=solution; IMPL=student times your own code)

For each total length N the prompt holds N - new_tokens tokens and both variants generate the
last `new_tokens` greedily on the tiny target, so the context is ~N tokens at every step. The
two are timed interleaved in one run (median of repeats). Without a cache each step is a
forward pass over ~N tokens; with it, one prefill plus one-token steps. The per-token figure of a
cached generation includes its prefill, so the cached *step* is also timed on its own: one token
after N - 1 cached ones, the cache rewound after each (what a learner's decode step costs).

Floors (labkit.bench.floors, this machine's measured rates): without a cache every step's forward
FLOPs at the GEMM rate; with it, the prefill's FLOPs plus each step's bytes (weights and cache) at the
streaming bandwidth; the cached step, its bytes.
"""

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.impl import current, load
from labkit.quality import heldout


def cached_step(model, prompt: list[int]):
    """One decode step of the stage's forward after `prompt` is cached; the cache is rewound after each call."""
    cl, kv = load("stage02_kv_cache.cached_llama"), load("stage02_kv_cache.kv_cache")
    cache = kv.KVCache(model.config, 1, len(prompt) + 1)
    cl.forward(model, torch.tensor([prompt]), cache)
    token = torch.tensor([[prompt[-1]]])

    def step():
        cl.forward(model, token, cache)
        cache.truncate(len(prompt))

    return step


def main(quick: bool = False) -> bench.Result:
    lengths, new_tokens, repeats = ((128, 256), 8, 1) if quick else ((256, 512, 1024), 32, 3)
    return run(*bench.model(), bench.tokenizer(), lengths, new_tokens, repeats, 20 if quick else 100)


def run(model, which: str, tokenizer, lengths, new_tokens: int, repeats: int, step_repeats: int) -> bench.Result:
    """The comparison on `model` (stage02_real.py runs it on SmolLM2)."""
    gen = load("stage02_kv_cache.generate")
    text = heldout(tokenizer, n_tokens=max(lengths), seq=max(lengths))[0].tolist()
    rows = []
    for n in lengths:
        prompt = text[: n - new_tokens]
        no_cache, cached, speedup = bench.compare(
            lambda p=prompt: gen.generate_no_cache(model, p, new_tokens),
            lambda p=prompt: gen.generate_kv_cache(model, p, new_tokens),
            repeats=repeats,
            warmup=0,
        )
        step = bench.measure(cached_step(model, text[: n - 1]), repeats=step_repeats, warmup=3)
        p = len(prompt)
        no_cache_flops = sum(floors.forward_flops(model, p + i) for i in range(new_tokens))
        cached_floor = floors.floor_s(flops=floors.forward_flops(model, p)) + sum(
            floors.floor_s(bytes=floors.decode_bytes(model, p + i)) for i in range(1, new_tokens)
        )
        rows.append(
            {
                "total_tokens": n,
                "prompt": len(prompt),
                "new": new_tokens,
                "no_cache_s": no_cache.median,
                "kv_cache_s": cached.median,
                "speedup": speedup,
                "no_cache_ms_per_token": no_cache.median / new_tokens * 1e3,
                "kv_cache_ms_per_token": cached.median / new_tokens * 1e3,
                "cached_step_ms": step.median * 1e3,
                "step_vs_shortest": step.median * 1e3 / (rows[0]["cached_step_ms"] if rows else step.median * 1e3),
                **floors.row(no_cache.median, flops=no_cache_flops, name="no_cache"),
                "kv_cache floor ms": round(cached_floor * 1e3, 3),
                "kv_cache vs floor": round(cached.median / cached_floor, 2),
                **floors.row(step.median, bytes=floors.decode_bytes(model, n - 1), name="cached_step"),
            }
        )
    print(bench.table(rows, title=f"stage 02: KV cache vs no cache, {which}, impl={current()}, median of {repeats}"))

    plt = plot.setup()
    fig, ax = plt.subplots()
    x = [r["total_tokens"] for r in rows]
    ax.plot(x, [r["no_cache_ms_per_token"] for r in rows], "o-", label="no cache: full forward every step")
    ax.plot(x, [r["kv_cache_ms_per_token"] for r in rows], "o-", label="KV cache: prefill once, 1 token per step")
    for r in rows:
        ax.annotate(
            f"{r['speedup']:.1f}×",
            (r["total_tokens"], r["no_cache_ms_per_token"]),
            textcoords="offset points",
            xytext=(0, 6),
        )
    ax.set(xlabel="context length (tokens)", ylabel="ms per generated token", yscale="log", title=f"Stage 02: {which}")
    ax.legend()
    return bench.Result(rows, {"model": which, "repeats": repeats, **floors.figures()}, fig)
