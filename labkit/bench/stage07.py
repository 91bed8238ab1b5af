"""Stage 07: tensor-parallel decode latency on this CPU (TP=1 vs TP=2) and the alpha-beta model's
predictions for Llama-3-70B on H100s over NVLink and PCIe.

    make bench STAGE=07

On a laptop CPU, TP=2 is honestly slower: the tiny model's per-layer matmuls take microseconds,
while each gloo all-reduce over loopback costs far more, and a token needs 2·layers + 1 of them.
TP pays off when what it divides (each GPU's HBM read of its weight shard, milliseconds for a
70B model) is much larger than what it adds (2·layers + 1 all-reduce latencies over NVLink).
The run below measures both sides on this machine and feeds the measured all-reduce latency into
the same cost model, so the prediction and the measurement sit side by side.
"""

import statistics
import time

import torch
import torch.distributed as dist

from labkit import bench, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.distributed import launch
from labkit.impl import load
from labkit.specs import H100, LLAMA3_70B

CONTEXT = 64


def _decode_worker(steps: int, folder: str | None = None) -> dict:
    """On every rank: median decode-step time and the part spent inside collectives. With two or
    more ranks, rank 0 also times a step of the unsharded model between TP steps (the others
    wait at the barrier before the next call), so TP=1 and TP=N are measured interleaved, under
    the same load; every call starts together after a barrier, as a GPU stream would. `folder`:
    a Llama folder instead of $MODEL's (stage07_real.py)."""
    tp = load("stage07_tensor_parallel.tp_model")
    if folder:
        from labkit.model import from_pretrained

        # TPLlama builds a full-size Llama before its strict load overwrites every weight: at 135 M
        # parameters that random init costs seconds per rank, so this process skips it.
        torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda self: None
        full = from_pretrained(folder).eval()
    else:
        full, _ = bench.model()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tp.TPLlama(full.config).eval()
    model.load_state_dict(tp.shard_state_dict(full.state_dict(), rank, world, full.config))

    in_comm = [0.0]
    for name in ("all_reduce", "all_gather"):  # time the collectives the layers make
        original = getattr(dist, name)

        def timed(*args, _fn=original, **kwargs):
            t0 = time.perf_counter()
            out = _fn(*args, **kwargs)
            in_comm[0] += time.perf_counter() - t0
            return out

        setattr(dist, name, timed)

    tp_step, comm_s = bench.decode_step(model, CONTEXT), []

    def sharded():
        in_comm[0] = 0.0
        tp_step()
        comm_s.append(in_comm[0])

    timed_full = rank == 0 and world > 1
    unsharded = bench.decode_step(full, CONTEXT) if timed_full else lambda: None
    t = bench.interleaved({"tp": sharded, "full": unsharded}, steps, warmup=2, before=dist.barrier)
    # alpha: one token's worth of back-to-back all-reduces of its hidden state, on every rank at
    # once, per collective (a sum of latencies is predicted by their mean, so no median per call).
    x, n = torch.zeros(1, 1, full.config.hidden_size), collectives_per_token(full.config)
    burst = bench.measure(lambda: [dist.all_reduce(x) for _ in range(n)], repeats=20, warmup=1, before=dist.barrier)
    alpha = burst.median / n if world > 1 else 0.0
    # The one collective that is not latency-bound: gathering each rank's slice of the logits.
    shard = torch.zeros(1, full.config.vocab_size // world)
    parts = [torch.empty_like(shard) for _ in range(world)]
    gather = bench.measure(lambda: dist.all_gather(parts, shard), repeats=20, warmup=1, before=dist.barrier)
    return {
        "step_s": t["tp"].median,
        "comm_s": statistics.median(comm_s[-steps:]),
        "all_reduce_s": alpha,
        "all_gather_s": gather.median if world > 1 else 0.0,
        "unsharded_step_s": t["full"].median if timed_full else float("nan"),
    }


def collectives_per_token(config) -> int:
    """Two all-reduces per layer (attention and MLP outputs), one for the vocab-parallel embedding
    and one all-gather of the vocab-parallel logits."""
    return 2 * config.num_hidden_layers + 1 + 1


def main(quick: bool = False) -> bench.Result:
    cost = load("stage07_tensor_parallel.cost_model")
    full, which = bench.model()
    c, steps = full.config, 20 if quick else 60
    print(f"model: {which}, {c.num_hidden_layers} layers; decode after {CONTEXT} tokens")

    # --- measured on this CPU: one core per rank; TP=1 on one core interleaved step by step with
    # TP=2 in the same run (the ratio we quote), and TP=1 on both cores in a separate run.
    per_rank = launch(_decode_worker, 2, steps, threads=1, timeout=300)
    tp2 = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    base = {"step_s": per_rank[0]["unsharded_step_s"], "comm_s": 0.0}
    two_threads = launch(_decode_worker, 1, steps, threads=2, timeout=300)[0]
    measured = {
        "TP=1, 1 thread": base,
        "TP=2, 1 thread/rank": {"step_s": tp2["step_s"], "comm_s": tp2["comm_s"]},
        "TP=1, 2 threads (own run)": {"step_s": two_threads["step_s"], "comm_s": 0.0},
    }
    n_collectives = collectives_per_token(c)
    # The cost model with this machine's numbers: the compute halves, each collective costs alpha.
    predicted_comm = n_collectives * tp2["all_reduce_s"]
    predicted_tp2 = base["step_s"] / 2 + predicted_comm
    # floor: the step's bytes (weights + cache) over the one-thread streaming rate times the cores used (2 unless
    # TP=1 on 1 thread), the best two cores could do if each streamed its share at one core's rate
    step_bytes = floors.decode_bytes(full, CONTEXT)
    with pin_threads(1):  # the one-thread rates
        rows = [
            {"run": label, "ms/token": m["step_s"] * 1e3, "in collectives (ms)": m["comm_s"] * 1e3,
             **floors.row(m["step_s"], bytes=step_bytes / (1 if label == "TP=1, 1 thread" else 2))}
            for label, m in measured.items()
        ]  # fmt: skip
    rows.append({"run": f"TP=2 predicted (TP=1/2 + {n_collectives} x alpha)", "ms/token": predicted_tp2 * 1e3,
                 "in collectives (ms)": predicted_comm * 1e3})  # fmt: skip
    print(bench.table(rows, title="measured on this CPU (gloo over loopback), median per decode step"))
    slowdown = tp2["step_s"] / base["step_s"]
    print(
        f"\nTP=2 / TP=1 time per token: {slowdown:.2f}x. Why: one gloo all-reduce of a {c.hidden_size}-float vector "
        f"costs {tp2['all_reduce_s'] * 1e6:.0f} us here (alpha), a token needs {n_collectives} collectives "
        f"({predicted_comm * 1e3:.2f} ms), while the whole TP=1 step computes in "
        f"{base['step_s'] * 1e3:.2f} ms, so halving it saves at most {base['step_s'] / 2 * 1e3:.2f} ms.\n"
        f"Outside the collectives a TP=2 step takes {(tp2['step_s'] - tp2['comm_s']) * 1e3:.2f} ms against "
        f"{base['step_s'] * 1e3:.2f} ms unsharded: at this size a step is mostly Python and per-op overhead, "
        "which TP does not divide."
    )
    if two_threads["step_s"] > base["step_s"]:
        print(
            "TP=1 on 2 threads is slower than on 1: matrices this small do not split well over intra-op threads, "
            "and the threads wait for each other when the cores are shared."
        )

    planning = llama3_70b_planning(cost)
    figures = {"model": which, "measured": measured, "all_reduce_s": tp2["all_reduce_s"], "tp2_over_tp1": slowdown,
               "tp2_predicted_s": predicted_tp2, "llama3_70b_planning": planning}  # fmt: skip
    return bench.Result(rows, figures, _plot(measured, predicted_tp2, predicted_comm, planning))


def llama3_70b_planning(cost) -> list[dict]:
    """The cost model's Llama-3-70B decode (batch 1, context 1024) on H100s at TP = 1, 2, 4, 8."""
    planning = []
    for link_name, link in (("NVLink", cost.NVLINK), ("PCIe", cost.PCIE)):
        for p in (1, 2, 4, 8):
            t = cost.tp_step_time(LLAMA3_70B, p, 1, **link, **H100, context=1024)
            planning.append({"link": link_name, "TP": p, "ms/token": t.total * 1e3, "HBM (ms)": t.memory * 1e3,
                             "compute (ms)": t.compute * 1e3, "comm (ms)": t.comm * 1e3})  # fmt: skip
    title = "cost model: Llama-3-70B bf16, batch 1, context 1024, H100 (989 TFLOP/s, 3.35 TB/s)"
    print(f"\n{bench.table(planning, title=title)}")
    nv = {r["TP"]: r["ms/token"] for r in planning if r["link"] == "NVLink"}
    pc = {r["TP"]: r["ms/token"] for r in planning if r["link"] == "PCIe"}
    print(f"\npredicted TP=8 vs TP=1 speed-up: NVLink {nv[1] / nv[8]:.1f}x, PCIe {pc[1] / pc[8]:.1f}x")
    return planning


def _plot(measured, predicted_tp2, predicted_comm, planning):
    plt = plot.setup()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    shown = {k: v for k, v in measured.items() if "own run" not in k}  # the interleaved pair
    labels = [k.replace(", ", "\n") for k in shown] + ["TP=2\npredicted"]
    comm = [m["comm_s"] * 1e3 for m in shown.values()] + [predicted_comm * 1e3]
    total = [m["step_s"] * 1e3 for m in shown.values()] + [predicted_tp2 * 1e3]
    ax1.bar(labels, [t - c for t, c in zip(total, comm, strict=True)], label="compute + Python")
    ax1.bar(labels, comm, bottom=[t - c for t, c in zip(total, comm, strict=True)], label="inside collectives")
    ax1.set_ylabel("ms per token")
    ax1.set_title("this CPU: tiny target, gloo")
    ax1.legend()
    for i, link in enumerate(("NVLink", "PCIe")):
        rows = [r for r in planning if r["link"] == link]
        x = [j + (i - 0.5) * 0.38 for j in range(len(rows))]
        device = [max(r["HBM (ms)"], r["compute (ms)"]) for r in rows]
        ax2.bar(x, device, width=0.36, color=f"C{i}", label=f"{link}: HBM-bound weights + KV")
        ax2.bar(x, [r["comm (ms)"] for r in rows], width=0.36, bottom=device, color=f"C{i}", alpha=0.45,
                hatch="//", label=f"{link}: all-reduces")  # fmt: skip
    ax2.set_xticks(range(4), [f"TP={r['TP']}" for r in planning[:4]])
    ax2.set_ylabel("ms per token (predicted)")
    ax2.set_title("cost model: Llama-3-70B decode, batch 1, H100")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
