"""Stage 06 part 2 benchmark: speculative decoding inside a batching engine, against the same engine
without it, at concurrency 1, 2, 4, 8, 16 on the tiny pair.

    make bench STAGE=06b                      (LABS_IMPL=solution; IMPL=student times your own code)
    make bench STAGE=06b MODEL=dir DRAFT=dir  (your own target/draft pair)

Greedy, held-out story prompts, every request submitted at once. Three engines, timed interleaved
in one run (medians of repeats): no speculation (k = 0), a fixed k, and choose_k (adaptive k per
sequence from its acceptance, off when it does not pay) on costs measured on this machine.
Every engine must emit the same tokens as the target's own greedy decoding. Throughput is the
batch's generated tokens per second, prefill included, and the speedups are throughput ratios.
TPOT is a request's time between its first and last token divided by the tokens after the first,
averaged over requests; it flatters speculation a little, because the engine already drafts in the
prefill step, so a request's first step can emit up to k + 1 tokens before its TPOT clock starts.

The prediction is the stage's cost model (speedup.py, choose_k) with measured parts: alpha from
the fixed-k run, draft(B) and target(B, T) timed on the engine's own paged forward. Speculation
pays while k draft forwards plus one target forward over k + 1 tokens per sequence cost less than
the expected_tokens_per_step(alpha, k) plain steps they replace; as the batch grows the target's
forward stops being a fixed cost and the crossover comes.
"""

import statistics

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import current, load
from labkit.quality import heldout

from .stage06 import refuse_real_without_draft

CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128]  # the issue asks for 1..16; beyond it, looking for the crossover


def run_engine(engine_cls, target, draft, prompts: list[list[int]], new: int, **kw) -> list:
    """One engine run of every prompt submitted at once; the sequences, in submission order."""
    engine = engine_cls(target, draft, max_batch=len(prompts), num_blocks=len(prompts) * 16, **kw)
    seqs = [engine.add(p, new) for p in prompts]
    engine.run()
    return seqs


def tpot(seqs) -> float:
    """Mean over requests of (last token time - first token time) / (tokens - 1)."""
    return sum((s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1) for s in seqs) / len(seqs)


@torch.inference_mode()
def sweep(
    target, draft, prompts, new: int, concurrency: list[int], k: int, costs, repeats: int, k_max: int = 8, warmup=1
):
    """For each concurrency: throughput and TPOT of no speculation, a fixed k and choose_k (up to k_max, on
    `costs`), acceptance, and the cost model's prediction for the fixed k. Returns the table's rows."""
    eng = load("stage06_speculative.batch_engine")
    verify = load("stage06_speculative.batch_verify")
    speedup = load("stage06_speculative.speedup")
    engines = {"plain": dict(k=0), "fixed": dict(k=k), "adaptive": dict(k=k_max, costs=costs)}
    rows = []
    for C in concurrency:
        batch = prompts[:C]
        reference = [target.generate(p, new, stop_at_eos=False) for p in batch]
        tpots: dict[str, list[float]] = {name: [] for name in engines}

        def variant(name, b=batch, tpots=tpots):
            seqs = run_engine(eng.SpecBatchEngine, target, draft, b, new, **engines[name])
            tpots[name].append(tpot(seqs))
            return seqs

        t = bench.interleaved({name: lambda n=name: variant(n) for name in engines}, repeats, warmup)
        for name, timing in t.items():
            if [s.generated for s in timing.last] != reference:
                raise AssertionError(f"concurrency {C}: the {name} engine's output differs from the target's greedy")
        tp = {name: statistics.median(times[warmup:]) for name, times in tpots.items()}  # the timed runs
        fixed, adaptive = t["fixed"].last, t["adaptive"].last
        accepted = sum(s.accepted for s in fixed)
        alpha = accepted / max(accepted + sum(s.rejected for s in fixed), 1)
        predicted = (
            speedup.expected_tokens_per_step(alpha, k)
            * costs.target(C, 1)
            / (k * costs.draft(C) + costs.target(C, k + 1))
        )
        tokens = C * new
        # floors of each run: the target's FLOPs over every prompt and generated token, or its weights and
        # the batch's caches read once per target step: `new` steps plain, new / (k + 1) at best speculating
        # (k_max for choose_k); the draft's work is left out: each floor is its engine's with a free draft
        context = len(batch[0])
        flops = C * floors.forward_flops(target, context + new, logits=new)  # logits where tokens are sampled
        step = floors.decode_bytes(target, context, C)
        target_steps = {"plain": new, "fixed": new / (k + 1), "adaptive": new / (k_max + 1)}
        floor = {n: floors.row(t[n].median, flops=flops, bytes=step * s, name=n) for n, s in target_steps.items()}
        rows.append({
            "concurrency": C,
            "plain_tok_s": tokens / t["plain"].median,
            "fixed_tok_s": tokens / t["fixed"].median,
            "adaptive_tok_s": tokens / t["adaptive"].median,
            "plain_tpot_ms": tp["plain"] * 1e3,
            "fixed_tpot_ms": tp["fixed"] * 1e3,
            "adaptive_tpot_ms": tp["adaptive"] * 1e3,
            "alpha": alpha,
            "fixed_speedup": t["plain"].median / t["fixed"].median,
            "fixed_tpot_ratio": tp["plain"] / tp["fixed"],
            "predicted_speedup": predicted,
            "adaptive_speedup": t["plain"].median / t["adaptive"].median,
            "adaptive_k0": verify.choose_k(alpha, C, costs, k_max),
            "adaptive_drafts_per_token": sum(s.proposed for s in adaptive) / tokens,
            **floor["plain"], **floor["fixed"], **floor["adaptive"],
        })  # fmt: skip
    return rows


def crossover(rows: list[dict], key: str = "fixed_speedup") -> int | None:
    """The smallest concurrency at which speculation no longer beats plain decoding (None: it always did)."""
    return next((r["concurrency"] for r in rows if r[key] < 1.0), None)


def main(quick: bool = False) -> bench.Result:
    eng = load("stage06_speculative.batch_engine")
    pin_threads(1)  # one thread, as every stage's benchmark: a shared 2-core machine
    new, k, repeats = (12, 4, 1) if quick else (24, 4, 3)
    concurrency = [1, 4, 16, 64] if quick else CONCURRENCY
    refuse_real_without_draft()
    (target, which), (draft, which_draft) = bench.model(), bench.model("DRAFT")
    prompts = [w.tolist() for w in heldout(bench.tokenizer(), n_tokens=32 * max(concurrency), seq=32)]
    costs = eng.Costs.measure(target, draft, concurrency, k_max=8)
    rows = sweep(target, draft, prompts, new, concurrency, k, costs, repeats)
    title = (
        f"stage 06b: speculation in a batching engine, target {which}, draft {which_draft}, {new} new tokens per "
        f"request, 32-token prompts, k = {k} (fixed) or choose_k up to 8, impl={current()}, median of {repeats}"
    )
    print(bench.table(rows, title=title))
    cross = crossover(rows)
    print(f"crossover (fixed k={k} stops beating plain decoding): concurrency {cross}")
    figures = {"target": which, "draft": which_draft, "new_tokens": new, "k": k, "repeats": repeats,
               "crossover_fixed_k": cross, "crossover_predicted": crossover(rows, "predicted_speedup"),
               "costs_ms": {f"B={B}": {"draft": costs.draft(B) * 1e3, "target_T1": costs.target(B, 1) * 1e3,
                                       f"target_T{k + 1}": costs.target(B, k + 1) * 1e3} for B in concurrency}}  # fmt: skip
    return bench.Result(rows, figures, plot_crossover(rows, k))


def plot_crossover(rows: list[dict], k: int):
    """Left: throughput per engine against concurrency; right: speedup over plain, measured and predicted."""
    plt = plot.setup()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["concurrency"] for r in rows]
    ax1.plot(x, [r["plain_tok_s"] for r in rows], "o-", label="no speculation")
    ax1.plot(x, [r["fixed_tok_s"] for r in rows], "s-", label=f"fixed k = {k}")
    ax1.plot(x, [r["adaptive_tok_s"] for r in rows], "^-", label="choose_k (adaptive)")
    ax1.set(xscale="log", xlabel="concurrent requests", ylabel="generated tokens / s", title="throughput")
    ax1.set_xticks(x, [str(c) for c in x])
    ax1.legend()
    ax2.plot(x, [r["fixed_speedup"] for r in rows], "s-", label=f"fixed k = {k}, measured")
    ax2.plot(x, [r["fixed_tpot_ratio"] for r in rows], "s:", label=f"fixed k = {k}, TPOT ratio")
    ax2.plot(x, [r["predicted_speedup"] for r in rows], "--", label=f"cost model, k = {k} (measured α, costs)")
    ax2.plot(x, [r["adaptive_speedup"] for r in rows], "^-", label="choose_k, measured")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(
        xscale="log", xlabel="concurrent requests", ylabel="speedup over no speculation", title="when it stops paying"
    )
    ax2.set_xticks(x, [str(c) for c in x])
    ax2.legend()
    return fig
