"""The physical floor under a timing: what this machine cannot beat, measured once per process.

A step that must read B bytes cannot take less than B / (the memory bandwidth); a step of F floating
point operations cannot take less than F / (the machine's GEMM rate). Every benchmark row that quotes a
time also quotes its floor and the ratio, so a reader sees how far each variant is from the hardware,
not only from the other variants. One line per row:

    from labkit.bench import floors
    row.update(floors.row(seconds, bytes=floors.decode_bytes(model, context)))   # decode: bandwidth bound
    row.update(floors.row(seconds, flops=floors.forward_flops(model, tokens)))   # prefill: compute bound
    row.update(floors.row(seconds, bytes=..., name="step"))   # {"step floor ms", "step vs floor"}: a 2nd time

row() returns {"floor ms": ..., "vs floor": measured / floor} (with both bytes and flops, the larger
floor: the step is bound by whichever is slower). figures() is the two measured rates, for the JSON.

Both rates are measured with the threads torch has when first asked (pin_threads first) and cached for
the process: bandwidth as the fastest of a copy of COPY_MB between two fresh buffers (bytes read + written
per second), a sum over one (bytes read per second) and, past one thread, each thread summing its own
slice at once (both reading the whole time, as two decode loops do), on 2 MB pages: the rate a streaming kernel can
reach (on 4 kB pages this VM's copy reached two thirds of it, which labkit.cpu_kernels' read-only loops
on huge pages beat; JSONs written before 2026-11-28 hold that copy rate), and labkit.cpu_kernels' own
streaming read where it builds (on two threads torch's sums read slower than two of its matrix loops did;
JSONs written before 2026-12-06 lack it),
GEMM rate as the fastest float32 matmul among GEMM_SHAPES (2 m k n FLOPs): squares and a 135M model's prefill
shapes, since MKL runs some shapes faster than others and a floor is the best of them (a 1024-square alone read
75 GFLOP/s here where 2048 reached 90, and a prefill then beat its floor), and labkit.cpu_kernels' own loop
on weights in L2 where it builds (its multiply-adds ran faster than MKL's); each the fastest of REPEATS calls
(JSONs written before 2026-12-06 hold the median of 5 of a 1024 square, and one thread summing for the two-thread rate).
"""

import concurrent.futures
import functools

import torch

from ..cpu_kernels import huge_pages
from ..timing import measure

COPY_MB = 512
GEMM_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (512, 576, 576), (512, 576, 1536), (512, 1536, 576))
REPEATS = 10


@functools.cache
def _rates(threads: int) -> tuple[float, float, dict]:
    # two buffers, not one: halves of one buffer exactly COPY_MB apart alias in the caches (21 vs 26 GB/s here)
    (src,), (dst,) = huge_pages([torch.ones(COPY_MB * 2**20 // 4)]), huge_pages([torch.zeros(COPY_MB * 2**20 // 4)])
    # the fastest call, not the median: a floor is the best this machine did, and a shared machine's other
    # work slows some calls (a median under load gave a floor that a quieter step then beat)
    copy = 2 * src.numel() * 4 / measure(lambda: dst.copy_(src), repeats=REPEATS).min
    read = src.numel() * 4 / measure(lambda: src.sum(), repeats=REPEATS).min
    ways = {
        "copy": copy,
        "sum": read,
        "a sum per thread": _parallel_read(src, threads),
        "kernel read": _kernel_read(src),
    }
    bandwidth = max(ways.values())  # a decode step only reads: here a read streams faster than a copy
    flops = max(*(_gemm_rate(*shape) for shape in GEMM_SHAPES), _kernel_fma_rate())
    return bandwidth, flops, {way: round(r / 1e9, 2) for way, r in ways.items() if r}


def _gemm_rate(m: int, k: int, n: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / measure(lambda: a @ b, repeats=REPEATS, warmup=2).min


def _kernel_fma_rate() -> float:
    """Float32 FLOPs per second of labkit.cpu_kernels' matrix loop on 6, 8 or 12 rows (its passes) against
    weights that stay in L2, the fastest (0 where the kernels cannot be built): its multiply-adds run near
    the FMA units' peak, at or above MKL's GEMM here, and a floor its own loop beats is no floor."""
    from ..cpu_kernels import ops, pack_f32

    kernels = ops()
    if kernels is None:
        return 0.0
    w, calls, best = pack_f32(torch.randn(512, 576)), 100, 0.0
    for rows in (6, 8, 12):
        x = torch.randn(rows, 576)

        def run(x: torch.Tensor = x) -> None:
            for _ in range(calls):
                kernels.f32_matvec(x, w)

        best = max(best, 2 * 512 * 576 * rows * calls / measure(run, repeats=REPEATS, warmup=2).min)
    return best


def _kernel_read(src: torch.Tensor) -> float:
    """Bytes per second of labkit.cpu_kernels' streaming read (AVX2 loads, each thread its slice; 0 where the
    kernels cannot be built): on two threads here torch's sums read slower than two matrix loops do."""
    from ..cpu_kernels import ops

    kernels = ops()
    if kernels is None:
        return 0.0
    return src.numel() * 4 / measure(lambda: kernels.stream_read(src), repeats=REPEATS).min


def _parallel_read(src: torch.Tensor, threads: int) -> float:
    """Bytes per second with `threads` threads each summing its own slice of src at once, one torch thread
    each: every thread reading for the whole time, as two decode loops over halves of the rows do. torch's
    own src.sum() on two threads can trail that (a reduction's split and combine), and a floor under what
    two loops reach is no floor."""
    if threads < 2:
        return 0.0
    parts = src.chunk(threads)
    was = torch.get_num_threads()
    torch.set_num_threads(1)  # each Python thread's sum runs on itself; ops release the GIL
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:

            def both() -> None:
                list(pool.map(torch.sum, parts))

            return src.numel() * 4 / measure(both, repeats=REPEATS).min
    finally:
        torch.set_num_threads(was)


def bandwidth() -> float:
    """Bytes per second a streaming read reaches on torch's current thread count (see the module's docstring)."""
    return _rates(torch.get_num_threads())[0]


def gemm_rate() -> float:
    """Float32 FLOPs per second of a large matmul on torch's current thread count."""
    return _rates(torch.get_num_threads())[1]


def floor_s(bytes: float = 0, flops: float = 0) -> float:
    """Seconds a step cannot beat: its bytes at the measured bandwidth or its FLOPs at the GEMM rate, the larger."""
    return max(bytes / bandwidth() if bytes else 0.0, flops / gemm_rate() if flops else 0.0)


def row(seconds: float, bytes: float = 0, flops: float = 0, name: str = "") -> dict:
    """The two columns a benchmark row adds: {"floor ms", "vs floor"} for a measured time in seconds
    (prefixed by `name` where a row holds several times)."""
    floor, prefix = floor_s(bytes, flops), f"{name} " if name else ""
    return {f"{prefix}floor ms": round(floor * 1e3, 3), f"{prefix}vs floor": round(seconds / floor, 2) if floor else ""}


def figures() -> dict:
    """The measured rates, for a benchmark's JSON figures."""
    return {"floor_read_GBps": round(bandwidth() / 1e9, 2), "floor_gemm_GFLOPs": round(gemm_rate() / 1e9, 1),
            "floor_threads": torch.get_num_threads(), "floor_read_GBps_by_way": _rates(torch.get_num_threads())[2]}  # fmt: skip


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads at least: every parameter once (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes(model, context: int, element_size: int = 4) -> int:
    """Bytes of keys and values a decode step reads from a cache of `context` positions (float32 by default)."""
    c = getattr(model, "config", model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * context * element_size


def decode_bytes(model: torch.nn.Module, context: int, batch: int = 1) -> int:
    """Bytes one decode step of `batch` sequences reads at least: the weights once, each sequence's cache."""
    return weight_bytes(model) + batch * kv_bytes(model, context)


def forward_flops(model, tokens: int, context: int = 0, logits: int | None = None) -> float:
    """FLOPs of a forward over `tokens` new tokens after `context` cached ones (labkit.model.Llama or a
    transformers Llama config): 2 per weight per token for the matrices (the LM head over `logits` of the
    tokens, all by default; an engine's prefill needs only the last; embedding lookup free), plus
    attention's QK^T and PV, 4 * heads * head_dim per (query, key) pair (causal)."""
    c = getattr(model, "config", model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    head = c.hidden_size * c.vocab_size * (tokens if logits is None else logits)
    pairs = tokens * context + tokens * (tokens + 1) / 2  # (query, key) pairs the causal mask keeps
    return (
        2 * (c.num_hidden_layers * per_layer * tokens + head)
        + 4 * c.num_attention_heads * head_dim * pairs * c.num_hidden_layers
    )
