"""Stage 07 on the course's real model (SmolLM2-135M-Instruct, `make setup`): TP = 1 against TP = 3.

    make bench STAGE=07_real [QUICK=1]     (IMPL=student times your own tensor parallelism)

SmolLM2's 9 query heads and 3 KV heads split over 1 or 3 ranks only, so this is stage07.py's
measurement at TP = 3: three gloo ranks of one thread each, rank 0 timing the unsharded model
between sharded steps (interleaved, same load), a decode step after 64 cached tokens. Beside it,
the alpha-beta prediction with this machine's own numbers: the unsharded step divided by 3, plus
what a token's collectives cost when timed alone. On a 2-core machine three ranks share two
cores, so the compute cannot fall below half the unsharded step; the table shows that bound too.
"""

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.checkpoint import read_config, require_real_model
from labkit.device import pin_threads
from labkit.distributed import launch
from labkit.impl import load
from labkit.model import Config, Llama

from .stage07 import CONTEXT, _decode_worker, collectives_per_token

TP = 3


def main(quick: bool = False) -> bench.Result:
    cost = load("stage07_tensor_parallel.cost_model")
    folder = require_real_model()
    c, steps = Config.from_hf(read_config(folder)), 10 if quick else 30
    print(f"model: {folder.name}, {c.num_hidden_layers} layers; decode after {CONTEXT} tokens, TP={TP}")

    per_rank = launch(_decode_worker, TP, steps, str(folder), threads=1, timeout=900)
    tp = {k: max(r[k] for r in per_rank) for k in per_rank[0]}  # a step ends when its slowest rank does
    base = per_rank[0]["unsharded_step_s"]
    n_all_reduce = collectives_per_token(c) - 1  # 2 per layer + the embedding's; then one all-gather
    sent = cost.comm_bytes_per_token(c, TP)
    predicted_comm = n_all_reduce * tp["all_reduce_s"] + tp["all_gather_s"]
    cores = 2
    # floor of a measured step: the weights + 64 cached tokens' K/V (float32) over the one-thread streaming rate,
    # times the cores the run could use (TP=3's three ranks share 2 cores); the predictions get none
    with torch.device("meta"):
        step_bytes = floors.decode_bytes(Llama(c), CONTEXT)
    with pin_threads(1):  # the one-thread rates
        tp1_floor, tp_floor = floors.row(base, bytes=step_bytes), floors.row(tp["step_s"], bytes=step_bytes / cores)
    rows = [
        {"run": "TP=1, 1 thread", "ms/token": base * 1e3, "in collectives (ms)": 0.0, **tp1_floor},
        {"run": f"TP={TP}, 1 thread/rank", "ms/token": tp["step_s"] * 1e3, "in collectives (ms)": tp["comm_s"] * 1e3,
         **tp_floor},
        {"run": f"TP={TP} predicted (TP=1/{TP} + collectives)", "ms/token": (base / TP + predicted_comm) * 1e3,
         "in collectives (ms)": predicted_comm * 1e3},
        {"run": f"TP={TP} predicted on {cores} cores (TP=1/{cores} + collectives)",
         "ms/token": (base / cores + predicted_comm) * 1e3, "in collectives (ms)": predicted_comm * 1e3},
    ]  # fmt: skip
    print(bench.table(rows, title="measured on this CPU (gloo over loopback), median per decode step"))
    print(
        f"\nA token makes {n_all_reduce} all-reduces of {c.hidden_size} floats ({sent['all_reduce']:,} B from each "
        f"rank in all) and one all-gather of the logits ({sent['all_gather']:,} B from each rank). Timed alone: "
        f"{tp['all_reduce_s'] * 1e6:.0f} us per all-reduce, {tp['all_gather_s'] * 1e6:.0f} us for the all-gather. "
        f"TP={TP} / TP=1 time per token: {tp['step_s'] / base:.2f}x."
    )
    figures = {
        "model": f"{folder.name} ({c.num_hidden_layers} layers, {c.num_attention_heads} heads, "
        f"{c.num_key_value_heads} KV heads)",
        "tp": TP,
        "steps": steps,
        "context": CONTEXT,
        "per_rank": per_rank,
        "all_reduces_per_token": n_all_reduce,
        "all_gathers_per_token": 1,
        "bytes_per_token_per_rank": sent,
        "all_reduce_s": tp["all_reduce_s"],
        "all_gather_s": tp["all_gather_s"],
        "tp_over_tp1": tp["step_s"] / base,
    }
    return bench.Result(rows, figures, _plot(rows))


def _plot(rows):
    plt = plot.setup()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r["run"].replace(" (", "\n(").replace(", ", "\n") for r in rows]
    comm = [r["in collectives (ms)"] for r in rows]
    rest = [r["ms/token"] - x for r, x in zip(rows, comm, strict=True)]
    ax.bar(labels, rest, label="compute + Python")
    ax.bar(labels, comm, bottom=rest, label="inside collectives")
    ax.set_ylabel("ms per token")
    ax.set_title(f"SmolLM2-135M decode, TP=1 vs TP={TP}, gloo on this CPU")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    fig.tight_layout()
    return fig
