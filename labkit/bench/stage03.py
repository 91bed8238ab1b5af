"""Stage 03: quantization on the tiny target ($MODEL if set) — quality vs memory vs decode speed, and the deploy gate.

One row per format/method: weight bytes, held-out perplexity (Δ% vs fp32), KL(fp32 || quantized)
and top-1 agreement with fp32 on the same windows, decode tokens/s (batch 1, its ratio to fp32
measured interleaved), and the quality gate's verdict.

On a CPU the quantized layers dequantize the whole weight on every call, in separate PyTorch ops,
so they are SLOWER than fp32: quantization here saves memory, not time. The speed-up of the serving
guide comes from fused GPU kernels that read 4-bit weights from HBM and never materialize them.
"""

import copy

import torch

from labkit import bench
from labkit.bench import compare, decode_step, floors, table
from labkit.calibration import calibration_windows
from labkit.device import pin_threads
from labkit.plot import setup
from labkit.quality import heldout

GATE = dict(max_ppl_increase_pct=1.0, max_top1_disagreement=0.02)


def variants(fp32, calib, ql, gptq, awq, sq) -> dict:
    """name -> a function making that quantized copy of fp32 (calibrated on `calib` where the method needs it)."""
    variants = {
        "fp32": lambda: fp32,
        "bf16": lambda: copy.deepcopy(fp32).to(torch.bfloat16),
        "INT8 per-channel": lambda: ql.quantize_model(copy.deepcopy(fp32), "int8"),
        "FP8 E4M3": lambda: ql.quantize_model(copy.deepcopy(fp32), "fp8_e4m3"),
        "FP8 E5M2": lambda: ql.quantize_model(copy.deepcopy(fp32), "fp8_e5m2"),
        "W8A8 naive": lambda: sq.w8a8_model(copy.deepcopy(fp32)),
        "W8A8 SmoothQuant": lambda: sq.w8a8_model(sq.smooth_model(copy.deepcopy(fp32), calib, alpha=0.5)),
        "NF4 b64": lambda: ql.quantize_model(copy.deepcopy(fp32), "nf4"),
        "NF4 b64 + DQ": lambda: ql.quantize_model(copy.deepcopy(fp32), "nf4_dq"),
    }
    for bits in (4, 3, 2):
        variants[f"RTN INT{bits} g128"] = lambda b=bits: ql.quantize_model(copy.deepcopy(fp32), "rtn", b, 128)
        variants[f"GPTQ INT{bits} g128"] = lambda b=bits: gptq.gptq_quantize_model(copy.deepcopy(fp32), calib, b, 128)
        variants[f"AWQ INT{bits} g128"] = lambda b=bits: awq.awq_quantize_model(copy.deepcopy(fp32), calib, b, 128)
    return variants


def variant_row(name: str, model, fp32, base, base_step, ev, windows, repeats: int) -> dict:
    """One quantized model against fp32: size, perplexity, KL, top-1 agreement, decode speed (compared in one
    run) with its floor, and stage 03's quality gate's verdict."""
    report = ev.evaluate(model, windows, reference=fp32, decode_repeats=0)
    t_base, t_cand, speedup = compare(base_step, decode_step(model), repeats=repeats, warmup=2)
    verdict = ev.quality_gate(base, report, **GATE)
    print(f"  {name}: done ({'; '.join(verdict.reasons)})", flush=True)
    return {
        "method": name,
        "weight MB": report.weight_bytes / 1e6,
        "vs fp32": report.weight_bytes / base.weight_bytes,
        "ppl": f"{report.perplexity:.4f}",
        "ppl Δ%": round(100 * (report.perplexity / base.perplexity - 1), 3),
        "KL vs fp32": float(f"{report.kl:.3g}"),
        "top-1 agree": round(report.top1_agreement, 4),
        "tok/s": round(1 / t_cand.median, 1),
        "speed vs fp32": round(speedup, 2),
        # the step reads the quantized weights (+ the 64-token cache timing.decode_step holds)
        **floors.row(t_cand.median, bytes=report.weight_bytes + floors.kv_bytes(fp32, 64), name="decode"),
        "gate": "pass" if verdict.passed else "BLOCK",
    }


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # small matrices: a second thread only adds OpenMP stalls on a shared CPU
    ql, gptq, awq, sq, ev = bench.stages(
        "stage03_quantization", "quant_linear", "gptq", "awq", "smoothquant", "evaluate"
    )

    tokenizer = bench.tokenizer()
    fp32, which = bench.model()
    windows = heldout(tokenizer, n_tokens=2048 if quick else 4096, seq=512)
    calib = calibration_windows(tokenizer, n_windows=2 if quick else 8, seq=128 if quick else 256)
    repeats = 5 if quick else 10

    base = ev.evaluate(fp32, windows, decode_repeats=0)
    base_step = decode_step(fp32)
    rows = [
        variant_row(name, make(), fp32, base, base_step, ev, windows, repeats)
        for name, make in variants(fp32, calib, ql, gptq, awq, sq).items()
    ]

    print(table(rows, title=f"Stage 03 on {which} ({len(windows)} held-out windows of 512 tokens)"))
    print(
        f"Quality gate: perplexity ≤ +{GATE['max_ppl_increase_pct']} % and top-1 disagreement ≤ "
        f"{GATE['max_top1_disagreement']:.0%} vs fp32. Top-1 flips on near-ties count as much as real errors "
        "(bf16 flips ~2 % with a tiny KL), so read KL next to the verdict.\n"
        "On this CPU the quantized layers dequantize the full weight on every call, so they save memory, "
        "not time: 'speed vs fp32' < 1 is expected. The decode speed-ups of the serving guide need fused "
        "GPU kernels that stream the small weights from HBM."
    )

    figures = {"model": which, "windows": len(windows), "calibration_tokens": calib.numel(), "gate": GATE}
    return bench.Result(rows, figures, _plot(rows))


def _plot(rows: list[dict]):
    """KL vs weight bytes: one line per calibration family, gray points for the other formats."""
    plt = setup()
    fig, ax = plt.subplots()
    for family, marker in (("RTN", "o"), ("GPTQ", "s"), ("AWQ", "^")):
        pts = [r for r in rows if r["method"].startswith(family)]
        ax.plot([r["weight MB"] for r in pts], [max(r["KL vs fp32"], 1e-7) for r in pts], marker=marker, label=family)
    for r in rows:
        if not r["method"].startswith(("RTN", "GPTQ", "AWQ")):
            ax.scatter(r["weight MB"], max(r["KL vs fp32"], 1e-7), color="gray", s=15)
            ax.annotate(r["method"], (r["weight MB"], max(r["KL vs fp32"], 1e-7)), fontsize=7)
    ax.set(xlabel="weight MB (embedding stays fp32)", ylabel="KL(fp32 || quantized), nats/token", yscale="log")
    ax.set_title("Tiny target: quality vs memory (INT2, INT3, INT4 from left to right; KL 0 drawn at 1e-7)")
    ax.legend()
    return fig
