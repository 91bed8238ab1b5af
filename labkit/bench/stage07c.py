"""Stage 07 part 3: pipeline and context parallelism on SmolLM2-135M, on this CPU's processes (gloo).

    make bench STAGE=07c

Pipeline (lab6): the 32 units split by measured cost over p = 1, 2, 3 ranks; m = 1, 2, 4, 8 micro-batches of
one prompt each go through (fill, steady, drain). The measured bubble is 1 - (mean busy time of a stage) / wall,
beside (p - 1) / (m + p - 1); the serving view is the latency of one request (m = 1) and the throughput at m.
Context (lab7): one long prompt's prefill by ring attention over p = 1, 2, 3 ranks (zig-zag split, and
contiguous at p = 3): time, each rank's KV bytes, and the bytes it sent against the hand count.
Anchors: Hugging Face on one process, and part 1's TP = 3 (SmolLM2's 9 heads do not split in two) on the same
prompt. Floors: the run's FLOPs at one core's GEMM rate times the cores it can use (one a rank, two here).
Every rank runs one thread: on two cores, p = 3 oversubscribes them, which the figures show.
"""

import os
import statistics

import torch
import torch.distributed as dist

from labkit import bench, plot
from labkit.bench import floors
from labkit.checkpoint import require_real_model
from labkit.device import pin_threads
from labkit.distributed import launch
from labkit.impl import load
from labkit.model import from_pretrained
from labkit.testing import real_ids

PP_TOKENS = 64  # one micro-batch: a 64-token prompt
MICROBATCHES = (1, 2, 4, 8)
STAGES = (1, 2, 3)


def tp_prefill(folder: str, ids: torch.Tensor, repeats: int) -> float:
    """On every rank of part 1's tensor-parallel model: the median prefill of ids (between barriers)."""
    tp = load("stage07_tensor_parallel.tp_model")
    full = from_pretrained(folder)
    model = tp.TPLlama(full.config).eval()
    model.load_state_dict(tp.shard_state_dict(full.state_dict(), dist.get_rank(), dist.get_world_size(), full.config))
    with torch.no_grad():
        t = bench.measure(lambda: model(ids[None], logits_to_keep=1), repeats, warmup=1, before=dist.barrier)
    return t.median


def floor_row(seconds: float, flops: float, ranks: int) -> dict:
    """The floor of a run on `ranks` one-thread processes: its FLOPs at one core's GEMM rate times the cores it
    can use, min(ranks, cores). Two threads' rate, measured on a shared machine, can fall below one thread's;
    each core at the one-thread rate is what the cores together cannot beat."""
    with pin_threads(1):
        return floors.row(seconds, flops=flops / min(ranks, os.cpu_count() or 1))


def pipeline_part(folder, model, quick):
    partition = load("stage07_tensor_parallel.pipeline.partition")
    with pin_threads(1):
        costs = partition.measure_costs(model, PP_TOKENS, repeats=3 if quick else 7)
    prompt = real_ids(PP_TOKENS).tolist()
    runs = [[prompt] * m for m in MICROBATCHES]
    flops = floors.forward_flops(model, PP_TOKENS, logits=1)
    rows, series = [], {}
    for p in STAGES:
        bounds = partition.balanced_partition(costs, p)
        per_rank = launch(load("stage07_tensor_parallel.pipeline.workers").pipeline_run, p, folder, bounds, prompt,
                          0, runs, 1 if quick else 2, threads=1, timeout=600)  # fmt: skip
        for i, m in enumerate(MICROBATCHES):
            walls = [max(r["runs"][i][k]["wall_s"] for r in per_rank) for k in range(len(per_rank[0]["runs"][i]))]
            k = walls.index(statistics.median(walls)) if len(walls) % 2 else 0
            busy = statistics.mean(r["runs"][i][k]["busy_s"] for r in per_rank)
            wall = walls[k]
            row = {"part": "PP", "p": p, "m": m, "stages": str([b - a for a, b in bounds]), "wall ms": wall * 1e3,
                   "bubble": 1 - busy / wall, "(p-1)/(m+p-1)": (p - 1) / (m + p - 1),
                   "tok/s": m * PP_TOKENS / wall, **floor_row(wall, m * flops, p)}  # fmt: skip
            rows.append(row)
            series.setdefault(p, []).append(row)
        series[p][0]["stage costs ms"] = [round(sum(costs[a:b]) * 1e3, 2) for a, b in bounds]
    return rows, series, costs


def context_part(folder, model, quick):
    ring = load("stage07_tensor_parallel.context.ring")
    workers = load("stage07_tensor_parallel.context.cp_model")
    T = 512 if quick else 2048
    text = real_ids()
    ids = text.repeat(T // len(text) + 1)[:T]
    flops = floors.forward_flops(model, T, logits=0)
    rows = []
    for p, scheme in [(1, "contiguous"), (2, "zigzag"), (3, "zigzag"), (3, "contiguous")]:
        # one timed run, no warm-up: a 2,048-token prefill takes tens of seconds here, its first-call costs little
        per_rank = launch(workers.prefill_worker, p, folder, ids, scheme, 0, threads=1, timeout=900)
        seconds = max(r["seconds"] for r in per_rank)
        hand = [ring.ring_bytes_per_rank(model.config, T, p, r, scheme) for r in range(p)]
        rows.append({"part": "CP", "p": p, "split": scheme, "T": T, "prefill s": seconds,
                     "KV MB / rank (max)": max(r["kv_bytes"] for r in per_rank) / 1e6,
                     "KV MB total": sum(r["kv_bytes"] for r in per_rank) / 1e6,
                     "sent MB / rank (max)": max(r["sent_bytes"] for r in per_rank) / 1e6,
                     "hand count MB (max)": max(hand) / 1e6,
                     "sent == hand count": [r["sent_bytes"] for r in per_rank] == hand,
                     **floor_row(seconds, flops, p)})  # fmt: skip
    return rows, ids


def anchors(folder, model, pp_prompt, cp_ids, quick):
    """HF on one process (one thread), and part 1's TP = 3, on the pipeline's prompt and the long prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    with pin_threads(1), torch.no_grad():
        for what, ids, n in (("PP prompt", pp_prompt, 3), ("CP prompt", cp_ids, 1)):
            t = bench.measure(lambda ids=ids: hf(ids[None], logits_to_keep=1), repeats=1 if quick else n)
            flops = floors.forward_flops(model, len(ids), logits=1)
            rows.append({"part": "anchor", "run": f"HF, one process, {what} ({len(ids)} tokens)",
                         "wall ms": t.median * 1e3, **floors.row(t.median, flops=flops)})  # fmt: skip
    tp = max(launch(tp_prefill, 3, folder, pp_prompt, 1 if quick else 3, threads=1, timeout=600))
    rows.append({"part": "anchor", "run": f"part 1's TP=3, PP prompt ({len(pp_prompt)} tokens)", "wall ms": tp * 1e3,
                 **floor_row(tp, floors.forward_flops(model, len(pp_prompt), logits=1), 3)})  # fmt: skip
    return rows


def main(quick: bool = False) -> bench.Result:
    folder = str(require_real_model())
    model = from_pretrained(folder)
    pp_rows, series, costs = pipeline_part(folder, model, quick)
    print(bench.table(pp_rows, title=f"pipeline: m micro-batches of a {PP_TOKENS}-token prompt through p stages"))
    cp_rows, cp_ids = context_part(folder, model, quick)
    print(bench.table(cp_rows, title="context parallelism: one long prefill by ring attention"))
    anchor_rows = anchors(folder, model, real_ids(PP_TOKENS), cp_ids, quick)
    print(bench.table(anchor_rows, title="anchors"))
    figures = {"model": "SmolLM2-135M-Instruct", "unit_costs_ms": [round(c * 1e3, 3) for c in costs],
               "pp_prompt_tokens": PP_TOKENS, "threads_per_rank": 1}  # fmt: skip
    return bench.Result(pp_rows + cp_rows + anchor_rows, figures, _plot(series, cp_rows, anchor_rows))


def _plot(series, cp_rows, anchor_rows):
    plt = plot.setup()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for p, rows in series.items():
        m = [r["m"] for r in rows]
        if p > 1:
            ax1.plot(m, [r["bubble"] for r in rows], "o-", color=f"C{p}", label=f"p={p} measured")
            ax1.plot(m, [r["(p-1)/(m+p-1)"] for r in rows], "--", color=f"C{p}", label=f"p={p}: (p-1)/(m+p-1)")
        ax2.plot(
            m,
            [r["tok/s"] for r in rows],
            "o-",
            color=f"C{p}",
            label=f"p={p} (one request: {rows[0]['wall ms']:.0f} ms)",
        )
    hf = next(r for r in anchor_rows if "PP prompt" in r["run"] and "HF" in r["run"])
    ax2.axhline(PP_TOKENS / hf["wall ms"] * 1e3, color="grey", ls=":", label="HF, one process")
    ax1.set(xscale="log", xlabel="micro-batches m", ylabel="idle fraction", title="the bubble: measured vs formula")
    ax2.set(xscale="log", xlabel="micro-batches m", ylabel="prompt tokens / s", title="serving view (1 thread a rank)")
    for ax in (ax1, ax2):
        ax.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
        ax.legend(fontsize=8)
    zig = [r for r in cp_rows if r["split"] == "zigzag" or r["p"] == 1]
    ax3.bar([f"p={r['p']}" for r in zig], [r["prefill s"] for r in zig], color="C0", label="prefill (s)")
    ax3.plot([f"p={r['p']}" for r in zig], [r["floor ms"] / 1e3 for r in zig], "k_", ms=30, label="floor (s)")
    ax3b = ax3.twinx()
    ax3b.plot(
        [f"p={r['p']}" for r in zig], [r["KV MB / rank (max)"] for r in zig], "o-", color="C3", label="KV MB / rank"
    )
    ax3b.set_ylabel("KV MB per rank", color="C3")
    ax3.set(ylabel="seconds", title=f"ring attention: a {zig[0]['T']}-token prefill")
    ax3.legend(fontsize=8, loc="upper center")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
