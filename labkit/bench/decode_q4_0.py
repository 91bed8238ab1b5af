"""The course's 4-bit step against llama.cpp's fastest 4-bit, one thread, on SmolLM2 (issue 55).

    make bench STAGE=decode_q4_0 [QUICK=1]   (llama-cpp-python built natively: make llamacpp)

llama.cpp runs Q4_0 fastest on x86: at load it repacks the rows to interleave them, so one load of x serves
several rows. labkit.cpu_kernels' q4_0_matvec does the same with the same codes (quantize_q4_0 equals
gguf.quants' Q4_0), eight rows a vpdpbusd. This benchmark times one cached step of StaticDecoder(weights=
"q4_0", kernels="cpp"), compiled, beside llama.cpp on the Q4_0 GGUF of the same weights (LM head included),
and the course's Q4_1 (int4) beside llama.cpp Q4_1, at contexts CONTEXTS: the decode benchmark's method
(bench/decode.py: each llama.cpp configuration in a process of its own, flash attention on, its weights
mmap'd and once more on 2 MB pages; variants round-robin in blocks; medians), on one thread only, the
issue's target. Greedy tokens are checked against the eager model on the dequantized weights, and the
logits against llama.cpp's on the same GGUF (KL per token).
"""

import tempfile
from pathlib import Path

from labkit import bench
from labkit.bench import floors
from labkit.bench.decode import (
    BLOCK,
    PROMPT,
    ROUNDS,
    SETTLE,
    at,
    decode_row,
    fill,
    greedy_check,
    in_process,
    plot_decode,
    round_robin,
)
from labkit.bench.llamacpp_worker import Worker, build_info, describe_gguf, gguf_files, kl_per_token
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.fast_decode import StaticDecoder
from labkit.model import from_pretrained

CONTEXTS = (128, 512)
MIXES = ("Q4_0", "Q4_1")  # llama.cpp's: the course's q4_0 and int4 compute these weights


def llamacpp_blocks(files: dict, model, figures: dict, blocks: dict, sizes: dict) -> list[Worker]:
    """A worker per llama.cpp variant (mmap'd; Q4_0 also on 2 MB pages), its decode blocks into `blocks`."""
    cfgs = {f"llama.cpp {m}": {"gguf": str(files[m]), "mmap": True} for m in MIXES}
    cfgs["llama.cpp Q4_0, 2 MB pages"] = {"gguf": str(files["Q4_0"]), "mmap": False, "huge": True}
    workers = {name: Worker({**cfg, "threads": 1, "contexts": list(CONTEXTS)}) for name, cfg in cfgs.items()}
    for name, wk in workers.items():
        figures.setdefault("llamacpp_processes", {})[name] = wk.info
        for ctx in CONTEXTS:
            blocks[(name, ctx)] = wk.decode_block(ctx)
            sizes[(name, ctx)] = wk.weight_bytes + floors.kv_bytes(model, ctx, element_size=2)
    return list(workers.values())


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)
    folder = require_real_model()
    model = from_pretrained(folder).eval()
    n = max(CONTEXTS) + 1
    decoders = {w: StaticDecoder(model, model.new_cache(1, n), "compile", window=n, weights=w, kernels="cpp")
                for w in ("q4_0", "int4")}  # fmt: skip
    prompt = load_tokenizer(folder).encode(PROMPT).ids  # SmolLM2's, whatever $MODEL says
    checks = {w: greedy_check(model, d, prompt, w) for w, d in decoders.items()}
    fill(model, decoders, max(CONTEXTS))
    figures = {"model": "SmolLM2-135M-Instruct", "threads": 1, "contexts": list(CONTEXTS), "llamacpp_build": build_info(),
               "greedy": {w: c[0] for w, c in checks.items()}, "floors_1_threads": floors.figures()}  # fmt: skip
    blocks, sizes, workers = {}, {}, []
    for ctx in CONTEXTS:
        for w, d in decoders.items():
            blocks[(f"StaticDecoder, compiled, cpp {w}", ctx)] = in_process(at(d, ctx, d.weight_bytes()))
            sizes[(f"StaticDecoder, compiled, cpp {w}", ctx)] = d.weight_bytes() + floors.kv_bytes(model, ctx)
    with tempfile.TemporaryDirectory() as tmp:
        files = gguf_files(folder, Path(tmp))
        if not all(m in files for m in MIXES):
            raise SystemExit("llama.cpp is not installed (make llamacpp): this benchmark compares against it")
        figures["gguf"] = {m: describe_gguf(files[m]) for m in MIXES}
        figures["kl_vs_llamacpp"] = {"q4_0": kl_per_token(files, "Q4_0", prompt, *checks["q4_0"][1:]),
                                     "int4": kl_per_token(files, "Q4_1", prompt, *checks["int4"][1:])}  # fmt: skip
        try:
            workers = llamacpp_blocks(files, model, figures, blocks, sizes)
            times = round_robin(blocks, 3 if quick else ROUNDS, BLOCK, SETTLE)
        finally:
            for wk in workers:
                wk.close()
    rows = [decode_row(name, ctx, 1, times, sizes) for name, ctx in times]
    bench.show(rows, "decode, SmolLM2, one thread, median ms; vs: ratio of medians")
    print(f"greedy against eager on the dequantized weights: {figures['greedy']}")
    print(f"KL per token against llama.cpp on the same GGUF: {figures['kl_vs_llamacpp']}")
    return bench.Result(rows, figures, plot_decode(rows, "SmolLM2-135M-Instruct"))
