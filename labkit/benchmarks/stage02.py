"""Stage 02 benchmark: generation with the KV cache against re-running the whole sequence.

    make bench STAGE=02          (LABS_IMPL=solution; IMPL=student times your own code)

For each total length N the prompt holds N - new_tokens tokens and both variants generate the
last `new_tokens` greedily on the tiny target, so the context is ~N tokens at every step. The
two are timed interleaved in one run (median of repeats). Without a cache each step is a
forward pass over ~N tokens; with it, one prefill plus one-token steps.
"""

import json

import torch

from labkit import ROOT, TARGET, bench, plot
from labkit.impl import current, load
from labkit.model import Config, Llama, init_weights
from labkit.model import load as load_model


def target_and_text(n_tokens: int) -> tuple[Llama, list[int], str]:
    """The trained tiny target and held-out text, or a random-init model of the same shape."""
    if (TARGET / "config.json").is_file():
        from labkit.evaluate import heldout, load_tokenizer

        ids = heldout(load_tokenizer(TARGET), n_tokens=n_tokens, seq=n_tokens)[0].tolist()
        return load_model(TARGET), ids, "tiny target (trained)"
    ids = torch.randint(3, Config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return init_weights(Llama(Config())).eval(), ids, "random-init model of the tiny target's shape"


def main(quick: bool = False) -> list[dict]:
    gen = load("stage02_kv_cache.generate")
    lengths, new_tokens, repeats = ((128, 256), 8, 1) if quick else ((256, 512, 1024), 32, 3)
    model, text, which = target_and_text(max(lengths))
    rows = []
    for n in lengths:
        prompt = text[: n - new_tokens]
        no_cache, cached, speedup = bench.compare(
            lambda p=prompt: gen.generate_no_cache(model, p, new_tokens),
            lambda p=prompt: gen.generate_kv_cache(model, p, new_tokens),
            repeats=repeats,
            warmup=0,
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
            }
        )
    print(bench.table(rows, title=f"stage 02: KV cache vs no cache, {which}, impl={current()}, median of {repeats}"))
    result = {"model": which, "impl": current(), "machine": bench.machine(), "repeats": repeats, "rows": rows}
    name = "stage02_quick" if quick else "stage02"
    (ROOT / "bench_results").mkdir(exist_ok=True)
    (ROOT / "bench_results" / f"{name}.json").write_text(json.dumps(result, indent=2))

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
    print(f"wrote {plot.save(fig, name)}")
    return rows


if __name__ == "__main__":
    main()
