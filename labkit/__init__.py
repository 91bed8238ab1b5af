"""The course's library: the reference model, checkpoints, the paged cache, timing, the implementation switch.

Nothing in labkit is graded. Every stage imports from it, and no stage imports another stage.
Two tool rooms sit beside it and are never imported by it: labkit.grading (make test, make grade,
make mutants, the learner edition) and labkit.bench (make bench, the load test).
"""

import warnings
from pathlib import Path

# In Jupyter without ipywidgets, tqdm (Hugging Face's progress bars) draws text bars and warns that it does;
# text bars are what the course wants, so the warning is only noise in a handout's output.
warnings.filterwarnings("ignore", message="IProgress not found")

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"
TARGET = ASSETS / "tiny-target"
DRAFT = ASSETS / "tiny-draft"
LORA = ASSETS / "lora"  # LoRA adapters of the target (PEFT folders), one per subfolder

STAGES = {
    "01": ("stage01_forward_numpy", "GPT-2 and a Llama block, forward pass in NumPy"),
    "02": ("stage02_kv_cache", "KV cache, GQA, memory math, cached decode"),
    "02b": ("stage02_kv_cache", "Multi-head Latent Attention, attention sinks and H2O eviction"),
    "03": ("stage03_quantization", "INT8, INT4, NF4, FP8, GPTQ, AWQ, SmoothQuant"),
    "03b": (
        "stage03_quantization",
        "llama.cpp's Q8_0, Q4_0, Q4_K, Q6_K, a GGUF file it runs, and a GGUF read back into HF",
    ),
    "04": ("stage04_batching", "paged KV cache, prefix caching, continuous batching, streaming server"),
    "04b": ("stage04_batching", "Structured output and multi-LoRA serving"),
    "04c": ("stage04_batching", "A quantized (FP8, INT8) KV cache served behind a quality gate"),
    "05": ("stage05_flashattention", "online softmax, FlashAttention and decode kernels in Triton"),
    "06": ("stage06_speculative", "speculative decoding, rejection sampling, prompt lookup"),
    "06b": ("stage06_speculative", "Speculation in a batching engine, Medusa heads"),
    "07": ("stage07_tensor_parallel", "column/row-parallel layers, a tensor-parallel model"),
    "07b": (
        "stage07_tensor_parallel",
        "A fleet behind one endpoint: a radix prefix cache, routing policies, goodput under an SLO",
    ),
    "07c": ("stage07_tensor_parallel", "Pipeline parallelism and context (ring) parallelism"),
    "07d": ("stage07_tensor_parallel", "Mixture of Experts and expert parallelism"),
}

# A row is a stage's part: part 1 is lab.ipynb (notebook 1); a later part owns the notebooks listed here, and
# part 2 (the "b" row) every other notebook of its stage.
PART_NOTEBOOKS = {"04c": (5,), "07c": (6, 7), "07d": (8,)}


def row_of(stage: str, notebook: int) -> str:
    """The grader row of a stage's notebook: ("02", 1) -> "02", ("02", 3) -> "02b", ("07", 6) -> "07c"."""
    if notebook == 1:
        return stage
    return next((row for row, books in PART_NOTEBOOKS.items() if row[:2] == stage and notebook in books), stage + "b")


def triton_interpret() -> str:
    """TRITON_INTERPRET for child processes: as set, else the CPU interpreter unless a GPU is present."""
    import os

    from .device import has_gpu

    return os.environ.get("TRITON_INTERPRET", "0" if has_gpu() else "1")
