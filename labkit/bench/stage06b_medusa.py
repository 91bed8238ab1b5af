"""Stage 06 part 2 benchmark, Medusa: the tiny target's 4 Medusa heads against the separate draft model
(part 1) and prompt lookup, on the same held-out prompts, all greedy at batch 1.

    make bench STAGE=06b   (labkit/bench/stage06b.py runs this main and saves its Result)

For each drafter: mean tokens per target forward (the accepted length, bonus token included; the
prefill counts as a forward), tokens each target forward reads, and the wall-clock speedup over the
target's own cached greedy decoding (labkit.model.Llama.generate), timed interleaved in one run as
medians of repeats. Every run must produce the target's greedy tokens. Medusa runs twice: with the
course's 20-node tree (MEDUSA_CHOICES) and with a chain of each head's top-1 guess (K + 1 tokens),
and the cost of one target forward over those many tokens (v, in target decode steps) is measured
alongside, since on a CPU it is what a wide tree pays for.
"""

import os
from pathlib import Path

import torch

from labkit import ASSETS, bench, medusa, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import current
from labkit.quality import heldout

from .stage06 import refuse_real_without_draft

CHAIN = [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]


def heads_folder() -> Path:
    """$MEDUSA (heads trained for $MODEL by labkit.train --only medusa), else the tiny target's."""
    return Path(os.environ.get("MEDUSA") or ASSETS / "tiny-target-medusa")


@torch.inference_mode()
def rows_of(runs: dict, stats: dict, times: dict, step: dict, floor_bytes: float) -> list[dict]:
    """Plain greedy's row, then one a drafter: tokens per target forward, the verification's width and cost in
    plain steps, time and speedup. Every row's floor is plain decoding's, as in stage06b_eagle: one step per
    token reading the target's weights and a mean context's cache (`floor_bytes`); a drafter that accepts
    several tokens per step can go under it."""
    rows = [{"drafter": "none (plain greedy)", "tok_per_fwd": 1.0, "verify_tokens": 1, "verify_cost_v": 1.0,
             "seconds": times["plain"].median, "speedup": 1.0,
             **floors.row(times["plain"].median, bytes=floor_bytes)}]  # fmt: skip
    for name, (_, width) in runs.items():
        s = stats[name]
        rows.append({
            "drafter": name,
            "tok_per_fwd": sum(x.generated for x in s) / sum(x.target_forwards for x in s),
            "verify_tokens": width,
            "verify_cost_v": step[width].median / step[1].median,
            "seconds": times[name].median,
            "speedup": times["plain"].median / times[name].median,
            **floors.row(times[name].median, bytes=floor_bytes),
        })  # fmt: skip
    return rows


def main(quick: bool = False) -> bench.Result:
    spec, lookup, med = bench.stages("stage06_speculative", "speculative", "prompt_lookup", "medusa")
    pin_threads(1)  # batch-1 decoding of a 6.6M-parameter model: threads only add noise on a shared CPU
    n_prompts, new, repeats, k = (1, 48, 1, 4) if quick else (2, 96, 3, 4)
    refuse_real_without_draft()
    (target, which), (draft, which_draft) = bench.model(), bench.model("DRAFT")
    heads = medusa.load(heads_folder(), target)
    prompts = [w[:64].tolist() for w in heldout(bench.tokenizer(), n_tokens=512 * n_prompts, seq=512)]
    reference = [target.generate(p, new, stop_at_eos=False) for p in prompts]
    tree = med.sort_paths(med.MEDUSA_CHOICES)
    runs = {
        f"draft model, k={k}": (lambda p: spec.greedy_speculative(target, draft, p, new, k=k), k + 1),
        f"prompt lookup, k={k}": (lambda p: lookup.lookup_decode(target, p, new, k=k), k + 1),
        "Medusa, chain of top-1": (lambda p: med.medusa_generate(target, heads, p, new, paths=CHAIN), len(CHAIN) + 1),
        f"Medusa, {len(tree) + 1}-node tree": (lambda p: med.medusa_generate(target, heads, p, new), len(tree) + 1),
    }
    stats = {name: [] for name in runs}

    def timed(name):
        def go():
            stats[name].clear()
            for p, ref in zip(prompts, reference, strict=True):
                out, s = runs[name][0](p)
                if out != ref:
                    raise AssertionError(f"{name}: output differs from the target's greedy decoding")
                stats[name].append(s)

        return go

    fns = {"plain": lambda: [target.generate(p, new, stop_at_eos=False) for p in prompts]}
    fns |= {name: timed(name) for name in runs}
    times = bench.interleaved(fns, repeats, warmup=1)
    widths = sorted({1, *(n for _, n in runs.values())})
    step = bench.interleaved({n: bench.decode_step(target, 96, n) for n in widths}, 10 if quick else 30, warmup=3)
    rows = rows_of(
        runs, stats, times, step, len(prompts) * new * floors.decode_bytes(target, len(prompts[0]) + new // 2)
    )
    title = (
        f"stage 06b Medusa: target {which}, heads {heads_folder().name} (K={heads.num_heads}), draft {which_draft}, "
        f"{len(prompts)} prompts x {new} tokens, impl={current()}, median of {repeats}"
    )
    bench.show(rows, title)
    best = max(rows[1:], key=lambda r: r["speedup"])
    print(f"best: {best['drafter']} {best['speedup']:.2f}x, every run identical to plain greedy")
    figures = {"target": which, "draft": which_draft, "heads": heads.num_heads, "prompts": len(prompts),
               "new_tokens": new, "repeats": repeats, "target_step_s": step[1].median}  # fmt: skip
    return bench.Result(rows, figures, _plot(rows))


def _plot(rows: list[dict]):
    """Left: tokens per target forward; right: wall-clock speedup over plain greedy."""
    plt = plot.setup()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["drafter"].replace(", ", "\n") for r in rows]
    ax1.barh(names, [r["tok_per_fwd"] for r in rows])
    ax1.set(xlabel="tokens per target forward", title="accepted length (bonus included)")
    ax2.barh(names, [r["speedup"] for r in rows])
    ax2.axvline(1.0, color="gray", lw=0.8)
    ax2.set(xlabel="speedup over plain greedy", title="wall clock, batch 1, one thread")
    ax1.invert_yaxis()
    ax2.invert_yaxis()
    fig.tight_layout()
    return fig
