"""One decode step, everywhere, against the machine's limit: llama.cpp is the yardstick (issue 24).

    make bench STAGE=decode [MODEL=real]   (installs llama-cpp-python on demand: make llamacpp)

In one run and on one thread each, a cached decode step of $MODEL (default the tiny target; `real`
is SmolLM2-135M-Instruct) at CONTEXT tokens: labkit.model eager, labkit.fast_decode.StaticDecoder
(fused, then torch.compile'd), Hugging Face transformers, and llama.cpp on the same weights
exported to GGUF F32 and Q8_0 by stage 03's exporter (and, for the real model, on the Q4_1 file
it ships as). The floor is the bytes a step must read (every weight once) over the bandwidth a
one-thread copy of COPY_MB reaches (bytes read + written per second). Every step is timed
round-robin (bench.interleaved), so load drift hits all alike; aten ops per step come from
torch.profiler (nested ops included).
"""

import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import profile

from labkit import bench
from labkit.checkpoint import model_folder, real_model_folder
from labkit.device import pin_threads
from labkit.fast_decode import StaticDecoder
from labkit.impl import load

CONTEXT = 128
COPY_MB = 512


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second (read + written) of a one-thread copy of COPY_MB between two fresh buffers."""
    src = torch.ones(COPY_MB * 2**20 // 4)
    dst = torch.empty_like(src)
    t = bench.measure(lambda: dst.copy_(src), repeats=repeats)
    return 2 * src.numel() * 4 / t.median


def aten_ops(step) -> int:
    with profile() as p:
        step()
    return sum(1 for e in p.events() if e.name.startswith("aten::"))


def course_step(model, backend: str | None):
    """One cached step at position CONTEXT, rewound after each call; backend None = model(ids, cache)."""
    cache = model.new_cache(1, 1024)
    with torch.no_grad():
        model(torch.ones(1, CONTEXT, dtype=torch.long), cache)
    run = StaticDecoder(model, cache, backend) if backend else (lambda ids: model(ids, cache))
    ids = torch.ones(1, 1, dtype=torch.long)

    def step():
        with torch.no_grad():
            run(ids)
        cache.truncate(CONTEXT)

    return step


def hf_step(hf):
    """The same step in transformers: its DynamicCache, cropped back after each call."""
    with torch.no_grad():
        past = hf(torch.ones(1, CONTEXT, dtype=torch.long), use_cache=True).past_key_values
    ids = torch.ones(1, 1, dtype=torch.long)

    def step():
        with torch.no_grad():
            hf(ids, past_key_values=past, use_cache=True)
        past.crop(-1)  # drop the token just written

    return step


def llamacpp_step(path: Path):
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False)
    llm.eval([1] * CONTEXT)

    def step():
        llm.n_tokens = CONTEXT  # eval drops the KV cache beyond n_tokens
        llm.eval([1])

    return step


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # llama.cpp runs on one thread too: the comparison is per core
    model, which = bench.model()
    folder = model_folder("MODEL")  # the folder bench.model() read: every row runs these weights
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding once
    steps = {"labkit.model, eager": course_step(model, None)}
    steps["StaticDecoder, fused, eager"] = course_step(model, "eager")
    t0 = time.perf_counter()
    steps["StaticDecoder, torch.compile"] = course_step(model, "compile")
    steps["StaticDecoder, torch.compile"]()  # compiles: once per process
    compile_s = time.perf_counter() - t0
    from transformers import AutoModelForCausalLM

    steps["Hugging Face transformers"] = hf_step(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    )
    with tempfile.TemporaryDirectory() as tmp:
        try:
            import llama_cpp  # noqa: F401  (before the exports, which take a while)

            if folder == real_model_folder():
                from labkit.gguf_model import installed_gguf

                steps["llama.cpp on the shipped Q4_1 file"] = llamacpp_step(installed_gguf())
            export = load("stage03_quantization.gguf_export")
            for mix in ("F32", "Q8_0"):
                steps[f"llama.cpp {mix}"] = llamacpp_step(export.export_gguf(folder, Path(tmp) / f"{mix}.gguf", mix))
        except ImportError as e:
            print(f"llama.cpp rows left out ({e}); `make llamacpp` installs llama.cpp")
        except (NotImplementedError, ValueError) as e:  # a learner's unwritten exporter, or a model it refuses
            print(f"llama.cpp rows of stage 03's exporter left out ({type(e).__name__}: {e})")
        ops = {name: aten_ops(step) for name, step in steps.items() if not name.startswith("llama.cpp")}
        times = bench.interleaved(steps, repeats=50 if quick else 300, warmup=10)
    bandwidth = copy_bandwidth()
    floor = weight_bytes / bandwidth
    cpp = times.get("llama.cpp F32")
    rows = [
        {
            "step": name,
            "ms/step": round(t.median * 1e3, 3),
            "vs llama.cpp F32": round(t.median / cpp.median, 2) if cpp else "",
            "vs floor": round(t.median / floor, 2),
            "aten ops": ops.get(name, ""),
        }
        for name, t in times.items()
    ]
    rows.append({"step": "floor: weights / copy bandwidth", "ms/step": round(floor * 1e3, 3), "vs llama.cpp F32": "",
                 "vs floor": 1.0, "aten ops": ""})  # fmt: skip
    print(bench.table(rows, title=f"one cached decode step at context {CONTEXT}, {which}, 1 thread, median"))
    print(
        f"floor: {weight_bytes / 1e6:.1f} MB of weights at {bandwidth / 1e9:.1f} GB/s (one-thread {COPY_MB} MB copy, "
        f"read + write); torch.compile took {compile_s:.0f} s once."
    )
    figures = {"model": which, "context": CONTEXT, "threads": 1, "weight_MB": round(weight_bytes / 1e6, 2),
               "copy_GBps": round(bandwidth / 1e9, 2), "compile_s": round(compile_s, 1)}  # fmt: skip
    return bench.Result(rows, figures)
