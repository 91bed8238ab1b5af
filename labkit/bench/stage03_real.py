"""Stage 03 on the course's real model (SmolLM2-135M-Instruct, `make setup`): which quantizer keeps quality.

    make bench STAGE=03_real [QUICK=1]     (IMPL=student runs your own quantizers)

One row per method, all with the stage's own code: weight bytes, held-out perplexity and its change
against fp32, KL(fp32 || quantized) and top-1 agreement on the same windows. The held-out text is
the course's own (labkit.corpus.valid_texts, the stories no model was calibrated on); calibration
uses the training stories. The group size is 64: the stage's default 128 does not divide SmolLM2's
width 576 and is refused. No decode timing here: on a CPU the quantized layers dequantize on every
call (stage03.json shows that on the tiny target).

The source of the weights is a Q4_1 GGUF: fp32 here is those 4-bit values widened, so a 4-bit
method re-rounds weights that already sit on a 4-bit grid of a different block layout. Its loss is
an upper bound on what it would lose from the original bf16 checkpoint.
"""

import copy

from labkit import bench
from labkit.bench import table
from labkit.calibration import calibration_windows
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.impl import current, load
from labkit.model import from_pretrained
from labkit.plot import setup
from labkit.quality import heldout

GROUP = 64  # divides SmolLM2's 576 and 1536; 128 does not


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)
    ql, gptq, awq, sq, ev = (
        load(f"stage03_quantization.{m}") for m in ("quant_linear", "gptq", "awq", "smoothquant", "evaluate")
    )
    folder = require_real_model()
    tokenizer = load_tokenizer(folder)
    fp32 = from_pretrained(folder).eval()
    which = f"{folder.name} ({fp32.num_params() / 1e6:.1f}M params)"
    windows = heldout(tokenizer, n_tokens=1024 if quick else 2048, seq=512)
    calib = calibration_windows(tokenizer, n_windows=2 if quick else 4, seq=256)
    variants = {
        "fp32": lambda: fp32,
        "INT8 per-channel": lambda: ql.quantize_model(copy.deepcopy(fp32), "int8"),
        "W8A8 naive": lambda: sq.w8a8_model(copy.deepcopy(fp32)),
        "W8A8 SmoothQuant (α=0.5)": lambda: sq.w8a8_model(sq.smooth_model(copy.deepcopy(fp32), calib, alpha=0.5)),
        f"RTN INT4 g{GROUP}": lambda: ql.quantize_model(copy.deepcopy(fp32), "rtn", 4, GROUP),
        f"GPTQ INT4 g{GROUP}": lambda: gptq.gptq_quantize_model(copy.deepcopy(fp32), calib, 4, GROUP),
        f"AWQ INT4 g{GROUP}": lambda: awq.awq_quantize_model(copy.deepcopy(fp32), calib, 4, GROUP),
    }
    base = ev.evaluate(fp32, windows, decode_repeats=0)
    rows = []
    for name, make in variants.items():
        report = ev.evaluate(make(), windows, reference=fp32, decode_repeats=0)
        rows.append(
            {
                "method": name,
                "weight MB": round(report.weight_bytes / 1e6, 1),
                "ppl": round(report.perplexity, 4),
                "ppl Δ%": round(100 * (report.perplexity / base.perplexity - 1), 2),
                "KL vs fp32": float(f"{report.kl:.3g}"),
                "top-1 agree": round(report.top1_agreement, 4),
            }
        )
        print(f"  {name}: perplexity {report.perplexity:.4f}", flush=True)
    print(table(rows, title=f"Stage 03 on {which}, impl={current()}: {windows.numel()} held-out tokens"))
    print("The weights come from a 4-bit (Q4_1) file: the INT4 rows are upper bounds on their loss.")
    figures = {
        "model": which,
        "heldout_tokens": windows.numel(),
        "heldout_text": "labkit.corpus.valid_texts() stories, packed (labkit.quality.heldout)",
        "calibration_tokens": calib.numel(),
        "group_size": GROUP,
    }
    plt = setup()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["method"] for r in rows][::-1], [r["ppl Δ%"] for r in rows][::-1])
    ax.set(xlabel="perplexity change vs fp32 (%)", title=f"{folder.name}: quantizers at equal text")
    return bench.Result(rows, figures, fig)
