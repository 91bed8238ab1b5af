"""One decode step, everywhere, against the machine's limit: llama.cpp is the yardstick (issue 24).

    make bench STAGE=decode [MODEL=real]   (installs llama-cpp-python on demand: make llamacpp)

In one run and on one thread each, a cached decode step of $MODEL (default the tiny target; `real`
is SmolLM2-135M-Instruct) at CONTEXT tokens: labkit.model eager, labkit.fast_decode.StaticDecoder
(fused, then torch.compile'd, with fp32, int8 and int4 weights), Hugging Face transformers, and
llama.cpp on the same weights exported to GGUF F32 and Q8_0 by stage 03's exporter (for the real
model: the Q4_1 file it ships as, and that file requantized to F32 and Q8_0 by llama.cpp).

Each row's floor is the bytes its step must read (every weight once at its own width: codes and
scales for int8/int4, the GGUF file's tensors for llama.cpp) over the bandwidth a one-thread copy
of COPY_MB reaches (bytes read + written per second). Every step is timed round-robin
(bench.interleaved), so load drift hits all alike; aten ops per step come from torch.profiler
(nested ops included). The int8/int4 steps' greedy tokens are compared with fp32's over
GREEDY_TOKENS tokens of a chat prompt.
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
GREEDY_TOKENS = 64
PROMPT = "<|im_start|>user\nWhat is the capital of France, and why?<|im_end|>\n<|im_start|>assistant\n"


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


def course_step(model, backend: str | None, weights: str = "fp32"):
    """One cached step at position CONTEXT, rewound after each call; backend None = model(ids, cache)."""
    cache = model.new_cache(1, 1024)
    with torch.no_grad():
        model(torch.ones(1, CONTEXT, dtype=torch.long), cache)
    run = StaticDecoder(model, cache, backend, weights=weights) if backend else (lambda ids: model(ids, cache))
    ids = torch.ones(1, 1, dtype=torch.long)

    def step():
        with torch.no_grad():
            run(ids)
        cache.truncate(CONTEXT)

    step.weight_bytes = run.weight_bytes() if backend else None
    return step


def greedy(model, prompt: list[int], weights: str) -> list[int]:
    """GREEDY_TOKENS greedy tokens after prompt: eager prefill, then StaticDecoder steps with `weights`."""
    cache = model.new_cache(1, len(prompt) + GREEDY_TOKENS)
    with torch.no_grad():
        token = model(torch.tensor([prompt]), cache)[:, -1:].argmax(-1)
        decoder, out = StaticDecoder(model, cache, "eager", weights=weights), []
        for _ in range(GREEDY_TOKENS):
            out.append(token.item())
            token = decoder(token)[:, -1:].argmax(-1)
    return out


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
    import gguf
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False)
    llm.eval([1] * CONTEXT)

    def step():
        llm.n_tokens = CONTEXT  # eval drops the KV cache beyond n_tokens
        llm.eval([1])

    step.weight_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)  # the file's tensors, tied once
    return step


def requantize(src: Path, out: Path, mix: str) -> Path:
    """llama.cpp's own quantizer from src to `mix` (F32 or Q8_0): the real model ships only as Q4_1."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[mix]
    params.allow_requantize = True  # Q4_1 -> Q8_0 or F32 loses nothing: each block's values are d * q + m
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {mix}")
    return out


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # llama.cpp runs on one thread too: the comparison is per core
    model, which = bench.model()
    folder = model_folder("MODEL")  # the folder bench.model() read: every row runs these weights
    fp32_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding once
    steps = {"labkit.model, eager": course_step(model, None)}
    steps["StaticDecoder, fused, eager"] = course_step(model, "eager")
    t0 = time.perf_counter()
    steps["StaticDecoder, torch.compile"] = course_step(model, "compile")
    steps["StaticDecoder, torch.compile"]()  # compiles: once per process
    compile_s = time.perf_counter() - t0
    for weights in ("int8", "int4"):
        steps[f"StaticDecoder, torch.compile, {weights}"] = course_step(model, "compile", weights)
    prompt = bench.tokenizer().encode(PROMPT).ids
    tokens = {w: greedy(model, prompt, w) for w in ("fp32", "int8", "int4")}
    from transformers import AutoModelForCausalLM

    steps["Hugging Face transformers"] = hf_step(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    )
    with tempfile.TemporaryDirectory() as tmp:
        try:
            import llama_cpp  # noqa: F401  (before the exports, which take a while)

            if folder == real_model_folder():  # stage 03's exporter writes byte-level BPE vocabularies only
                from labkit.gguf_model import installed_gguf

                for mix in ("F32", "Q8_0"):
                    steps[f"llama.cpp {mix}"] = llamacpp_step(requantize(installed_gguf(), Path(tmp) / mix, mix))
                steps["llama.cpp Q4_1 (the shipped file)"] = llamacpp_step(installed_gguf())
            else:
                export = load("stage03_quantization.gguf_export")
                for mix in ("F32", "Q8_0"):
                    gguf_file = export.export_gguf(folder, Path(tmp) / f"{mix}.gguf", mix)
                    steps[f"llama.cpp {mix}"] = llamacpp_step(gguf_file)
        except ImportError as e:
            print(f"llama.cpp rows left out ({e}); `make llamacpp` installs llama.cpp")
        except (NotImplementedError, ValueError) as e:  # a learner's unwritten exporter, or a model it refuses
            print(f"llama.cpp rows of stage 03's exporter left out ({type(e).__name__}: {e})")
        ops = {name: aten_ops(step) for name, step in steps.items() if not name.startswith("llama.cpp")}
        times = bench.interleaved(steps, repeats=50 if quick else 300, warmup=10)
    bandwidth = copy_bandwidth()
    weight_bytes = {name: step.weight_bytes for name, step in steps.items() if getattr(step, "weight_bytes", None)}
    cpp = times.get("llama.cpp F32")
    rows = []
    for name, t in times.items():
        floor = weight_bytes.get(name, fp32_bytes) / bandwidth
        rows.append({"step": name, "ms/step": round(t.median * 1e3, 3),
                     "vs llama.cpp F32": round(t.median / cpp.median, 2) if cpp else "",
                     "floor ms": round(floor * 1e3, 3), "vs floor": round(t.median / floor, 2),
                     "aten ops": ops.get(name, "")})  # fmt: skip
    print(bench.table(rows, title=f"one cached decode step at context {CONTEXT}, {which}, 1 thread, median"))
    agree = {w: sum(a == b for a, b in zip(tokens[w], tokens["fp32"], strict=True)) for w in ("int8", "int4")}
    first = {
        w: next((i for i, (a, b) in enumerate(zip(tokens[w], tokens["fp32"], strict=True)) if a != b), None)
        for w in agree
    }
    print(
        f"floor: each row's weight bytes at {bandwidth / 1e9:.1f} GB/s (one-thread {COPY_MB} MB copy, read + write); "
        f"torch.compile took {compile_s:.0f} s once.\ngreedy tokens equal to fp32's over {GREEDY_TOKENS}: "
        + ", ".join(f"{w} {agree[w]} (first difference at {first[w]})" for w in agree)
    )
    text = bench.tokenizer().decode
    for w, ids in tokens.items():
        print(f"{w}: {text(ids)!r}")
    figures = {"model": which, "context": CONTEXT, "threads": 1, "weight_MB": round(fp32_bytes / 1e6, 2),
               "copy_GBps": round(bandwidth / 1e9, 2), "compile_s": round(compile_s, 1),
               "greedy_tokens": GREEDY_TOKENS, "greedy_equal_to_fp32": agree, "first_difference": first,
               "greedy_text": {w: text(ids) for w, ids in tokens.items()}}  # fmt: skip
    return bench.Result(rows, figures)
