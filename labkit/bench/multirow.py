"""Rows share the weight read: a step's matrix products at B rows against one row, on SmolLM2 (issue 55).

    make bench STAGE=multirow [QUICK=1]

A decode step of B chats (or a verification of B = k + 1 tokens, or a short prefill chunk) multiplies every
weight matrix by B rows. If the kernel reads each weight once for all B rows, the step costs the bytes of
the weights until the multiply-adds take longer: the roofline, max(bytes / bandwidth, B * FLOPs per row /
FMA rate), with this machine's measured streaming bandwidth and float32 GEMM rate (labkit.bench.floors).
Every row times all of SmolLM2's linear layers (the LM head included) once, each on its own B rows, through
labkit.cpu_kernels' float32 loop (what the engine's fast forward runs up to fast_paged.CPP_MAX_ROWS rows,
and its batch-invariant mode at any) and through PyTorch's F.linear (MKL), variants interleaved, medians, at
one thread (the issue's target: on this 2-core VM a second thread meets whatever else runs); and the
integer loops at a few B for reference.

The float32 loop keeps one running sum per output over the inputs in order, so a row's bits should depend
neither on the other rows in the batch nor on the threads: `bitwise` checks it on every layer, row 0 alone
against row 0 in each batch and at every thread count.
"""

import torch
import torch.nn.functional as F

from labkit import bench, plot
from labkit.bench import floors
from labkit.checkpoint import require_real_model
from labkit.fast_paged import PackedLinear, accelerate
from labkit.model import from_pretrained

ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 32, 64, 128)  # past fast_paged.CPP_MAX_ROWS the engine takes the GEMM
# the engine's --quantization choices: Q8_0 and Q4_0 with rows interleaved in eights, Q4_1 one row a pass
QUANTIZED = ("q8_0", "q4_0", "q4_1")


def linears(model, quantization=None) -> list[PackedLinear]:
    return [m for m in accelerate(model, "cpp", quantization).modules() if isinstance(m, PackedLinear)]


def inputs(layers, rows: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    return [torch.randn(rows, lay.in_features, generator=gen) for lay in layers]


def all_layers(layers, xs, fn):
    def run():
        for lay, x in zip(layers, xs, strict=True):
            fn(lay, x)

    return run


def kernel(lay: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's kernel itself, at any row count (the engine's PackedLinear hands passes of more than
    CPP_MAX_ROWS float32 rows to PyTorch's GEMM instead)."""
    return lay.op(x, *lay.packed)


def bitwise(layers) -> bool:
    """Row 0 of every layer's output, alone at one thread, equals row 0 in each batch of ROWS at 1 and 2 threads."""
    was, ok = torch.get_num_threads(), True
    xs = inputs(layers, max(ROWS))
    torch.set_num_threads(1)
    alone = [kernel(lay, x[:1]) for lay, x in zip(layers, xs, strict=True)]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in ROWS:
            ok &= all(torch.equal(kernel(lay, x[:rows])[:1], a) for lay, x, a in zip(layers, xs, alone, strict=True))
    torch.set_num_threads(was)
    return bool(ok)


def main(quick: bool = False) -> bench.Result:
    model = from_pretrained(require_real_model()).eval()
    layers = {q or "f32": linears(model, q) for q in (None, *QUANTIZED)}
    # bytes per 32 weights: 128 float32; Q8_0 32 codes and a float16 scale; Q4_0 16 and one; Q4_1 16 and two
    weight_bytes = {"f32": floors.weight_bytes(model), "q8_0": floors.weight_bytes(model) * 34 / 128,
                    "q4_0": floors.weight_bytes(model) * 18 / 128, "q4_1": floors.weight_bytes(model) * 20 / 128}  # fmt: skip
    # 2 FLOPs per weight per row; the embedding is the tied LM head, counted once, as the bytes
    flops_per_row = 2 * sum(lay.weight.numel() for lay in layers["f32"])
    figures = {"model": "SmolLM2-135M-Instruct", "flops_per_row": flops_per_row, "bitwise": bitwise(layers["f32"])}
    rows, repeats = [], 5 if quick else 15
    with torch.no_grad():
        for threads in (1,):  # the target; on this 2-core VM a second thread meets whatever else runs
            torch.set_num_threads(threads)
            figures[f"floors_{threads}_threads"] = floors.figures()
            for b in ROWS if not quick else (1, 4, 8):
                fns = {"cpp f32": all_layers(layers["f32"], inputs(layers["f32"], b), kernel),
                       "torch F.linear": all_layers(layers["f32"], inputs(layers["f32"], b),
                                                    lambda lay, x: F.linear(x, lay.weight))}  # fmt: skip
                if b in (1, 4, 8):
                    fns.update({f"cpp {q}": all_layers(layers[q], inputs(layers[q], b), kernel)
                                for q in QUANTIZED})  # fmt: skip
                for name, t in bench.interleaved(fns, repeats=repeats, warmup=2).items():
                    fmt = name.split()[-1] if name.split()[-1] in weight_bytes else "f32"
                    # the integer loops' byte products are not float32 multiply-adds: the GEMM rate bounds
                    # neither them nor their floor, which counts their bytes alone
                    flops = b * flops_per_row if fmt == "f32" else 0
                    rows.append({"threads": threads, "rows": b, "variant": name, "ms": round(t.median * 1e3, 2),
                                 "min ms": round(t.min * 1e3, 2),
                                 **floors.row(t.median, bytes=weight_bytes[fmt], flops=flops)})  # fmt: skip
    for r in rows:  # the cost of B rows against one row, same variant, same threads
        one = next(o for o in rows if (o["threads"], o["variant"], o["rows"]) == (r["threads"], r["variant"], 1))
        r["vs 1 row"] = round(r["ms"] / one["ms"], 2)
    print(bench.table(rows, title="all of SmolLM2's matrices at B rows, median ms"))
    print(f"bitwise (row 0 alone = row 0 in any batch, 1 and 2 threads): {figures['bitwise']}")
    return bench.Result(rows, figures, _plot(rows, figures))


def _plot(rows: list[dict], figures: dict):
    """ms against B at one thread, each variant, beside the roofline of the float32 weights."""
    plt = plot.setup()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        pts = [(r["rows"], r["ms"]) for r in rows if r["variant"] == name and r["threads"] == 1]
        ax.plot(*zip(*pts, strict=True), marker="o", color=f"C{i}", label=name)
    f32 = sorted((r["rows"], r["floor ms"]) for r in rows if r["variant"] == "cpp f32" and r["threads"] == 1)
    rates = figures["floors_1_threads"]
    ax.plot(
        *zip(*f32, strict=True),
        "k--",
        label=f"float32 roofline ({rates['floor_read_GBps']} GB/s, {rates['floor_gemm_GFLOPs']} GFLOP/s)",
    )
    ax.set(xlabel="rows B (chats in a decode step, or k + 1 verified tokens)", ylabel="ms, all matrices, 1 thread",
           title="SmolLM2-135M: B rows share one read of the weights", ylim=(0, None))  # fmt: skip
    ax.legend(fontsize=7)
    return fig
