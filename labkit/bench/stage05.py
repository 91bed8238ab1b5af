"""Stage 05: what tiling buys. On the CPU, the peak memory of naive vs tiled attention (a ratio that
grows like T); on a CUDA GPU, the TFLOP/s of the learner's Triton kernel vs SDPA and naive attention.

    make bench STAGE=05          (LABS_IMPL=solution; add IMPL=student for your own code)
"""

import torch
import torch.nn.functional as F

from labkit import bench, plot, triton_interpret
from labkit.device import has_gpu, pin_threads
from labkit.impl import load
from labkit.tensor_memory import TensorWatch

MIB = 2**20
# why the rows carry no "floor ms" (labkit.bench.floors): they count bytes, and no time is taken on a CPU
FLOOR_NOTE = (
    "none: the CPU rows are peak bytes of tensors, not times; GPU TFLOP/s rows are timed only on a CUDA GPU "
    "with TRITON_INTERPRET=0 (under TRITON_INTERPRET=1 a time would measure the interpreter, not a kernel)"
)


def cpu_memory(
    lengths: list[int], head_dim: int = 64, block: int = 256, heads: int = 1, kv_heads: int = 1, causal: bool = False
) -> list[dict]:
    """Peak bytes of tensors created by one attention call, B = 1, float32 (B = H = 1, non-causal by default)."""
    attn = load("stage05_flashattention.tiled_attention")
    rows = []
    with pin_threads(1):  # bytes, not seconds: one thread avoids OpenMP stalls on a busy machine
        for T in lengths:
            g = torch.Generator().manual_seed(T)
            q, k, v = (torch.randn(1, h, T, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
            with TensorWatch() as naive:
                attn.naive_attention(q, k, v, causal=causal)
            with TensorWatch() as tiled:
                attn.tiled_attention(q, k, v, causal=causal, block_q=block, block_k=block)
            rows.append(
                {
                    "T": T,
                    "naive MiB": naive.peak_bytes / MIB,
                    "tiled MiB": tiled.peak_bytes / MIB,
                    "naive/tiled": naive.peak_bytes / tiled.peak_bytes,
                    "T×T fp32 MiB": heads * T * T * 4 / MIB,  # every query head's scores
                }
            )
    return rows


def gpu_tflops(lengths: list[int], repeats: int) -> list[dict]:
    """Triton tutorial 06's shapes: B=4, H=32, D=64, fp16. FLOPs = 4·B·H·T²·D, halved when causal."""
    return [_gpu_row(T, causal, repeats) for causal in (False, True) for T in lengths]


def _gpu_row(T: int, causal: bool, repeats: int, B: int = 4, H: int = 32, D: int = 64) -> dict:
    flash = load("stage05_flashattention.flash_attention").flash_attention
    naive = load("stage05_flashattention.tiled_attention").naive_attention
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.float16) for _ in range(3))
    variants = {
        "triton": lambda: flash(q, k, v, causal=causal, block_m=128, block_n=64),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if B * H * T * T * 2 <= 4 * 2**30:  # naive's fp16 score matrix must fit in 4 GiB
        variants["naive"] = lambda: naive(q, k, v, causal=causal)
    flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    row = {"causal": causal, "T": T}
    for name, fn in variants.items():
        row[f"{name} TFLOP/s"] = flops / bench.measure(_synced(fn), repeats=repeats, warmup=2).median / 1e12
    return row


def _synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()

    return run


def main(quick: bool = False) -> bench.Result:
    lengths = [1024, 2048] if quick else [1024, 2048, 4096, 8192]
    cpu = cpu_memory(lengths)
    print(bench.table(cpu, "CPU: peak memory of one attention call (B=H=1, D=64, float32, tiles 256×256)"))
    gpu = None
    if not has_gpu():
        print("\nGPU TFLOP/s: skipped, no CUDA device on this machine (the kernels ran nowhere but the CPU).")
    elif triton_interpret() == "1":
        print("\nGPU TFLOP/s: skipped, TRITON_INTERPRET=1 would time the interpreter; rerun with TRITON_INTERPRET=0.")
    else:
        gpu = gpu_tflops([1024, 2048] if quick else [1024, 2048, 4096, 8192, 16384], repeats=3 if quick else 10)
        print()
        print(bench.table(gpu, f"GPU: forward TFLOP/s, B=4 H=32 D=64 fp16 ({torch.cuda.get_device_name()})"))

    plt = plot.setup()
    fig, ax = plt.subplots()
    Ts = [r["T"] for r in cpu]
    ax.loglog(Ts, [r["naive MiB"] for r in cpu], "o-", label="naive (T×T scores)")
    ax.loglog(Ts, [r["tiled MiB"] for r in cpu], "o-", label="tiled (256×256 tiles)")
    for r in cpu:
        ax.annotate(f"{r['naive/tiled']:.0f}×", (r["T"], r["naive MiB"]), textcoords="offset points", xytext=(-8, 6))
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak MiB of tensors created")
    ax.set_title("Attention memory on the CPU: naive O(T²) vs tiled O(T)")
    ax.legend()
    return bench.Result(cpu, {"gpu_tflops": gpu, "floor": FLOOR_NOTE}, fig)
