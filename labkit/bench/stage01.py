"""Stage 01: how fast is a forward pass in plain NumPy next to PyTorch, on the same weights?

Prefill of 128 tokens (one sequence, float32), NumPy vs Hugging Face transformers, with PyTorch
given as many threads as NumPy's BLAS uses. Two models: the tiny target ($MODEL if set) as a
Llama, and a random-init model shaped like GPT-2 small (124M). Both variants run interleaved in
one process; the ratio is what we quote. The thread count is NumPy's BLAS default (every core)
unless OPENBLAS_NUM_THREADS sets it, e.g. `OPENBLAS_NUM_THREADS=1 make bench STAGE=01` on a
machine shared with other jobs.
"""

import os

import numpy as np
import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.checkpoint import model_folder
from labkit.device import pin_threads
from labkit.impl import load

PREFILL = 128


def blas_threads() -> int:
    """Threads NumPy's BLAS uses: OpenBLAS/MKL read these variables, else take every core."""
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return len(os.sched_getaffinity(0))


def llama_pair(folder=None):
    """(label, HF model, NumPy params, numpy forward) for a Llama folder, $MODEL's (the tiny target) by default."""
    from transformers import AutoModelForCausalLM

    folder = folder or model_folder()
    llama = load("stage01_forward_numpy.llama_numpy")
    params = llama.load_llama_params(folder)  # first: its errors say what is wrong with the folder
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    label = f"{folder.name} (Llama, {hf.num_parameters() / 1e6:.1f}M)"
    return label, hf, params, llama.llama_forward


def gpt2_small_pair():
    """(label, HF model, NumPy params, numpy forward) for a random-init model shaped like GPT-2 small."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).eval()
    gpt2 = load("stage01_forward_numpy.gpt2_numpy")
    params = gpt2.load_gpt2_params(dict(hf.state_dict()), config=hf.config.to_dict())  # shares the memory
    return "GPT-2-small-shaped (random init, 124M)", hf, params, gpt2.gpt2_forward


def main(quick: bool = False) -> bench.Result:
    return run([llama_pair] + ([] if quick else [gpt2_small_pair]), repeats=3 if quick else 7)


def run(builds, repeats: int) -> bench.Result:
    """Time each pair that `builds` makes, NumPy against torch, interleaved; one model in memory at a time."""
    threads = blas_threads()
    pin_threads(threads)
    rows = []
    for build in builds:
        label, hf, params, forward = build()
        ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=PREFILL)
        ids_t = torch.from_numpy(ids)[None]

        @torch.no_grad()
        def torch_prefill(hf=hf, ids_t=ids_t):
            return hf(ids_t).logits

        def numpy_prefill(forward=forward, params=params, ids=ids):
            return forward(params, ids)

        delta = float(np.abs(numpy_prefill() - torch_prefill()[0].numpy()).max())
        t_torch, t_numpy, ratio = bench.compare(torch_prefill, numpy_prefill, repeats=repeats)
        if hf.config.model_type == "llama":
            flops = floors.forward_flops(hf, PREFILL)
        else:  # GPT-2: 2 FLOPs per parameter per token (its tied embedding is the LM head), attention aside
            flops = 2 * hf.num_parameters() * PREFILL
        rows.append(
            {
                "model": label,
                "torch prefill s": t_torch.median,
                "numpy prefill s": t_numpy.median,
                "torch tok/s": PREFILL / t_torch.median,
                "numpy tok/s": PREFILL / t_numpy.median,
                "numpy/torch": ratio,
                "max |dlogits|": delta,
                **floors.row(t_torch.median, flops=flops, name="torch"),
                **floors.row(t_numpy.median, flops=flops, name="numpy"),
            }
        )
    title = f"Prefill of {PREFILL} tokens, float32, threads={threads} for NumPy's BLAS and for torch"
    print(bench.table(rows, title=title))

    plt = plot.setup()
    fig, ax = plt.subplots()
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["torch tok/s"] for r in rows], 0.4, label="HF transformers (PyTorch)")
    ax.bar(x + 0.2, [r["numpy tok/s"] for r in rows], 0.4, label="NumPy (this stage)")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['numpy/torch']:.2f}×", (i + 0.2, r["numpy tok/s"]), ha="center", va="bottom")
    ax.set_xticks(x, [r["model"] for r in rows])
    ax.set_yscale("log")
    # A decade around the bars: with one model, matplotlib's own limits would magnify a 3% gap into a wall.
    speeds = [r[k] for r in rows for k in ("torch tok/s", "numpy tok/s")]
    ax.set_ylim(min(speeds) / 10, max(speeds) * 10)
    ax.set_ylabel("prefill tokens / s (log scale)")
    ax.set_title(f"Prefill of {PREFILL} tokens, float32, threads={threads} for each")
    ax.legend()
    return bench.Result(rows, {"threads": threads, "prefill_tokens": PREFILL}, fig)
