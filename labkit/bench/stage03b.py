"""Stage 03, part 2: the learner's GGUF files of the tiny target, run by llama.cpp itself.

One row per file (F32, Q8_0, Q4_K_M, Q4_0, all written by stage03_quantization.gguf_export):
file MB, bits per weight, held-out perplexity from llama.cpp's own logits, KL(HF fp32 || llama.cpp)
and top-1 agreement with the HF model on the same windows, and llama.cpp's decode tokens/s (batch 1,
one thread). The course's own decode (labkit's PyTorch Llama, fp32 and stage 03's INT8 / RTN INT4
layers) is timed the same way in the same run.

Needs llama-cpp-python, which compiles llama.cpp on install: `make llamacpp` (about 4 minutes on 2 idle cores).
"""

import copy
import tempfile
from pathlib import Path

import numpy as np
import torch

import labkit
from labkit import bench
from labkit.bench import floors
from labkit.checkpoint import load_tokenizer
from labkit.device import pin_threads
from labkit.model import from_pretrained
from labkit.plot import setup
from labkit.quality import heldout

MIXES = ("F32", "Q8_0", "Q4_K_M", "Q4_0")
CONTEXT = 64  # decode steps are timed at this position, the KV cache rewound after each


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "stage 03b runs the GGUF files in llama.cpp, which is not installed: run `make llamacpp` "
            "(pip install -r requirements-llamacpp.txt; it compiles llama.cpp, about 4 minutes on 2 idle cores)"
        ) from None
    return llama_cpp


def llama(path: Path, n_ctx: int):
    """A llama.cpp context on one thread that keeps the logits of every position."""
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1, n_threads_batch=1,
                 logits_all=True, verbose=False)  # fmt: skip


def llamacpp_logits(llm, window: list[int]) -> np.ndarray:
    """(T, vocab) float32 logits llama.cpp computes for one window, from an empty cache."""
    llm.reset()
    llm.eval(window)
    return np.array(llm.scores[: len(window)], dtype=np.float32)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def llamacpp_decode_step(llm, context: int = CONTEXT):
    """A closure running one llama.cpp decode step at position `context` (eval drops the KV beyond n_tokens)."""
    llm.reset()
    llm.eval([1] * context)

    def step():
        llm.n_tokens = context
        llm.eval([1])

    return step


def hf_reference(windows, seq: int) -> tuple[list[np.ndarray], float, int]:
    """HF's float32 log-probabilities of every window, its perplexity on them, and the model's parameter count."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(labkit.TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [log_softmax(hf(w[None]).logits[0].numpy()) for w in windows]
    nll_hf = -sum(lp[np.arange(seq - 1), w[1:].numpy()].sum() for w, lp in zip(windows, ref, strict=True))
    ppl_hf = float(np.exp(nll_hf / (len(windows) * (seq - 1))))  # HF's fp32 logits, the same windows
    return ref, ppl_hf, sum(p.numel() for p in hf.parameters())


def llamacpp_rows(export, tmp: str, windows, seq: int, ref, ppl_hf: float, n_params: int, steps, step_bytes):
    """Each mix exported to GGUF and read by llama.cpp: its file, perplexity, KL and top-1 agreement against HF;
    its decode step goes into `steps` and the bytes it reads into `step_bytes`."""
    rows = []
    for mix in MIXES:
        path = export.export_gguf(labkit.TARGET, Path(tmp) / f"tiny-target-{mix}.gguf", mix)
        llm = llama(path, n_ctx=seq)
        nll = kl = agree = 0.0
        for w, lp_ref in zip(windows, ref, strict=True):
            lp = log_softmax(llamacpp_logits(llm, w.tolist()))
            nll -= lp[np.arange(seq - 1), w[1:].numpy()].sum()
            kl += (np.exp(lp_ref) * (lp_ref - lp)).sum()
            agree += (lp.argmax(-1) == lp_ref.argmax(-1)).sum()
        size, count = path.stat().st_size, len(windows) * seq
        ppl = float(np.exp(nll / (len(windows) * (seq - 1))))
        rows.append(
            {
                "engine": "llama.cpp",
                "format": mix,
                "file MB": round(size / 1e6, 2),
                "bits/weight": round(8 * size / n_params, 2),
                "ppl": f"{ppl:.4f}",
                "ppl Δ% vs HF": round(100 * (ppl / ppl_hf - 1), 3),
                "KL vs HF fp32": float(f"{kl / count:.3g}"),
                "top-1 agree": round(agree / count, 4),
            }
        )
        steps[("llama.cpp", mix)] = llamacpp_decode_step(llm)
        step_bytes[("llama.cpp", mix)] = size  # the file is its tensors (and a small header)
        print(f"  llama.cpp {mix}: done", flush=True)
    return rows


def course_rows(ql, fp32, ppl_hf: float, steps, step_bytes) -> list[dict]:
    """Stage 03's PyTorch layers (float32, INT8, INT4): their decode steps into `steps` and `step_bytes`."""
    rows = []
    for name, model in (
        ("fp32", fp32),
        ("INT8 per-channel", ql.quantize_model(copy.deepcopy(fp32), "int8")),
        ("RTN INT4 g128", ql.quantize_model(copy.deepcopy(fp32), "rtn", 4, 128)),
    ):
        steps[("course (PyTorch)", name)] = bench.decode_step(model, CONTEXT)
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}  # tied once
        step_bytes[("course (PyTorch)", name)] = sum(tensors.values())
        rows.append({"engine": "course (PyTorch)", "format": name, "file MB": "", "bits/weight": "",
                     "ppl": f"{ppl_hf:.4f}" if name == "fp32" else "", "ppl Δ% vs HF": "", "KL vs HF fp32": "",
                     "top-1 agree": ""})  # fmt: skip
    return rows


def main(quick: bool = False) -> bench.Result:
    require_llama_cpp()
    pin_threads(1)  # llama.cpp runs on one thread too: the comparison is per core
    export, ql = bench.stages("stage03_quantization", "gguf_export", "quant_linear")
    tokenizer = load_tokenizer(labkit.TARGET)
    seq = 256 if quick else 512
    windows = heldout(tokenizer, n_tokens=4 * seq if quick else 16 * seq, seq=seq)
    repeats = 10 if quick else 30
    ref, ppl_hf, n_params = hf_reference(windows, seq)

    steps, step_bytes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = llamacpp_rows(export, tmp, windows, seq, ref, ppl_hf, n_params, steps, step_bytes)
        fp32 = from_pretrained(labkit.TARGET)
        rows += course_rows(ql, fp32, ppl_hf, steps, step_bytes)
        seconds = {key: t.median for key, t in bench.interleaved(steps, repeats, warmup=3).items()}
    for r in rows:
        r["decode tok/s"] = round(1 / seconds[(r["engine"], r["format"])], 1)
        r["vs course fp32"] = round(seconds[("course (PyTorch)", "fp32")] / seconds[(r["engine"], r["format"])], 2)
        key = (r["engine"], r["format"])  # floor: the weights' bytes and the cache's at the measured streaming rate
        r.update(floors.row(seconds[key], bytes=step_bytes[key] + floors.kv_bytes(fp32, CONTEXT)))

    bench.show(rows, f"Stage 03b: GGUF files of the tiny target in llama.cpp ({len(windows)} windows of {seq})")
    q4km, q8 = (next(r for r in rows if r["format"] == f) for f in ("Q4_K_M", "Q8_0"))
    print(
        f"Q4_K_M vs Q8_0: perplexity {q4km['ppl']} vs {q8['ppl']} "
        f"({100 * (float(q4km['ppl']) / float(q8['ppl']) - 1):+.3f} %), file {q4km['file MB']} vs {q8['file MB']} MB.\n"
        "Decode steps of every row are timed round-robin in one loop (median of repeats), so load drift hits all alike.\n"
        "Perplexity uses llama.cpp's logits; the course's INT8/INT4 rows are stage 03's PyTorch layers, which "
        "dequantize the whole weight on every call. Bits/weight count the whole file (fp32 norms, metadata)."
    )
    figures = {"windows": len(windows), "seq": seq, "threads": 1, "note": "measured while other jobs ran"}
    return bench.Result(rows, figures, _plot(rows))


def _plot(rows: list[dict]):
    """Left: KL from the HF model against file size (llama.cpp). Right: decode tokens/s of every row."""
    plt = setup()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cpp = [r for r in rows if r["engine"] == "llama.cpp"]
    a.plot([r["file MB"] for r in cpp], [r["KL vs HF fp32"] for r in cpp], "o")
    for r in cpp:
        a.annotate(f"{r['format']} (ppl {r['ppl']})", (r["file MB"], r["KL vs HF fp32"]), fontsize=8)
    a.set(xlabel="GGUF file MB", ylabel="KL(HF fp32 || llama.cpp), nats/token", yscale="log",
          title="llama.cpp on the exported files: quality vs size")  # fmt: skip
    labels = [f"{r['format']} ({'llama.cpp' if r['engine'] == 'llama.cpp' else 'course'})" for r in rows]
    b.barh(range(len(rows)), [r["decode tok/s"] for r in rows],
           color=["C0" if r["engine"] == "llama.cpp" else "C1" for r in rows])  # fmt: skip
    b.set_yticks(range(len(rows)), labels, fontsize=8)
    b.invert_yaxis()
    b.set(xlabel="decode tokens/s (batch 1, 1 thread)", title="decode speed (measured while other jobs ran)")
    return fig
