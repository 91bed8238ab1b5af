"""Decode and prefill against llama.cpp as a user builds and runs it, and against the machine's floor (issues 24,
49 and 56).

    make bench STAGE=decode [MODEL=real]   (builds llama-cpp-python natively on demand: make llamacpp)

$MODEL defaults to the tiny target; `real` is SmolLM2-135M-Instruct. At one thread, then two:

- decode: one cached step of labkit.fast_decode.StaticDecoder, torch.compile'd, with labkit.cpu_kernels' fp32,
  int8 (Q8_0), int4 (Q4_1, LM head included) and q4_0 (Q4_0, rows interleaved in eights) loops, at contexts
  CONTEXTS, beside llama.cpp on the same model as GGUF F32, Q8_0, Q4_1 with its LM head at Q4_1 (what the course's int4 computes), Q4_0 likewise
  (llama.cpp's fastest 4-bit path on x86: it repacks Q4_0 rows to interleave them), and, on SmolLM2, the
  shipped Q4_1 file (LM head Q8_0). Each llama.cpp row runs in a process of its own (llamacpp_worker.py:
  no torch in it), flash attention on, weights mmap'd on 4 kB pages as llama-cpp-python loads them, and
  once more read into memory on 2 MB pages (use_mmap=False, glibc.malloc.hugetlb=1: malloc asks for
  transparent huge pages; the course's matrices sit on 2 MB pages too). At one thread also labkit.model
  eager, the compiled step on PyTorch's kernels and Hugging Face transformers, at context 128. Each floor
  is the bytes the step must read (every weight once at its width, the GGUF file's tensors for llama.cpp,
  and the KV cache: float32 in the course, float16 in llama.cpp) over the measured streaming bandwidth.
- prefill: PREFILLS-token prompts through labkit.model (float32, PyTorch's GEMMs) beside llama.cpp F32
  with n_batch = the prompt, both computing the last position's logits only (one course row also every
  position's); the floor is the forward's FLOPs over the measured float32 GEMM rate.

Variants run round-robin, each in blocks of BLOCK timed steps after SETTLE untimed ones of its own (a decode
loop's steps run back to back; a thread pool the other process left asleep must wake first), the order
rotated each round, so load drift hits all alike; min, median and spread (p90 - p10 over the median) of
ROUNDS * BLOCK steps. The floors are measured at each thread count while no llama.cpp process runs.
Greedy tokens over GREEDY_TOKENS of a chat prompt: each compiled path against the eager model on the same
(dequantized) weights, within the paths' measured logit error, or the benchmark raises; then the course's
logits against llama.cpp's on the GGUF of the same precision, KL per token, teacher-forced on one sequence.
The JSON records the llama.cpp build (.venv/.llamacpp-build, llama_print_system_info()), the CPU's SIMD
flags, the transparent-huge-page mode and the pages each side's weights sit on.
"""

import copy
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import profile

from labkit import bench, cpu_kernels, plot
from labkit.bench import floors
from labkit.bench.llamacpp_worker import Worker, build_info, describe_gguf, gguf_files, kl_per_token, pages_at
from labkit.checkpoint import model_folder
from labkit.device import pin_threads
from labkit.fast_decode import StaticDecoder
from labkit.testing import assert_greedy_within

CONTEXTS = (128, 512, 1024, 2048)
CONTEXT = 128  # the profile's, and the one-thread extras' (eager, PyTorch's kernels, transformers)
PREFILLS = (128, 512)
THREADS = (1, 2)
GREEDY_TOKENS = 64
ROUNDS, BLOCK, SETTLE = 10, 10, 3
PROMPT = "<|im_start|>user\nWhat is the capital of France, and why?<|im_end|>\n<|im_start|>assistant\n"
COURSE = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_1", "q4_0": "Q4_0"}  # each precision's GGUF: the same weights


def aten_ops(step) -> int:
    step()  # warm: the first call of a compiled step traces and compiles, thousands of ops
    with profile() as p:
        step()
    return sum(1 for e in p.events() if e.name.startswith("aten::"))


def profile_step(step) -> list[dict]:
    """Where a warm step's time goes, per op kind: each matrix-vector op (the bytes of its weights, their
    rate, and its time over its own floor), the attention (the cached keys and values it reads), and the
    rest of the compiled graph (norms, RoPE, cache writes, residual adds, dynamo's guard check) as one row.
    Its rows are single ops, not whole steps: the tiny model's 26 MB sit partly in L3, so some beat the
    DRAM floor."""
    step()
    profiles = []
    for _ in range(5):  # one step each; the quickest, so that a preemption does not land in "the rest"
        with profile(record_shapes=True) as p:
            step()
        span = max(e.time_range.end for e in p.events()) - min(e.time_range.start for e in p.events())  # us
        profiles.append((span, p.events()))
    total, events = min(profiles, key=lambda t: t[0])
    events = [e for e in events if e.name.startswith("labkit_cpu::")]
    per_weight = {"fp32": 4, "int8": 1 + 2 / 32, "int4": 0.5 + 4 / 32, "q4_0": 0.5 + 2 / 32}  # bytes per weight
    decoder = step.decoder
    rows, c = {}, step.decoder.c
    for e in events:
        if e.name == "labkit_cpu::decode_attention":  # reads the keys and values 0..pos of one layer
            kind = f"attention over {CONTEXT + 1} keys"
            nbytes = 2 * c.num_key_value_heads * (CONTEXT + 1) * c.head_dim * 4
        else:
            (_, n_in), w = e.input_shapes[0], e.input_shapes[1]
            # float32 comes packed (out / 16, in, 16), Q4_0 (out / 8, in / 32, 128): rows interleaved
            n_out = w[0] * 8 if e.name.endswith("q4_0_matvec") else w[0] * (w[2] if len(w) == 3 else 1)
            kind = "LM head" if n_out == c.vocab_size else f"({n_out}, {n_in}) matrices"
            nbytes = int(n_out * n_in * per_weight[decoder.weights])
        row = rows.setdefault(kind, {"op": kind, "calls": 0, "us": 0.0, "bytes": 0})
        row["calls"], row["us"], row["bytes"] = row["calls"] + 1, row["us"] + e.cpu_time_total, row["bytes"] + nbytes
    rest = {"op": "rest of the graph (norms, RoPE, cache writes, residual adds, guards)", "calls": 1,
            "us": total - sum(r["us"] for r in rows.values()), "bytes": 0}  # fmt: skip
    out = []
    for r in [*rows.values(), rest]:
        floor = floors.floor_s(bytes=r["bytes"]) * 1e6
        out.append({"op": r["op"], "calls": r["calls"], "ms": round(r["us"] / 1e3, 3), "MB": round(r["bytes"] / 1e6, 2),
                    "GB/s": round(r["bytes"] / r["us"] / 1e3, 1), "vs floor": round(r["us"] / floor, 2) if floor else ""})  # fmt: skip
    return out


def course_decoders(model, contexts: list[int]) -> dict[str, StaticDecoder]:
    """One compiled cpp decoder per precision, each with a cache long enough for the longest context. Its
    window is the whole cache: the cpp attention loops over the keys written so far whatever the window
    (only PyTorch's masked one reads the window), so one compile serves every context."""
    n = max(contexts) + 1
    return {w: StaticDecoder(model, model.new_cache(1, n), "compile", window=n, weights=w, kernels="cpp")
            for w in COURSE}  # fmt: skip


def fill(model, decoders: dict, n: int) -> None:
    """n tokens into every decoder's cache: one eager prefill, its keys and values copied to the others."""
    first, *rest = [d.cache for d in decoders.values()]
    first.truncate(0)
    with torch.no_grad():
        model(torch.ones(1, n, dtype=torch.long), first)
    for cache in rest:
        for a, b in zip(cache.k + cache.v, first.k + first.v, strict=True):
            a.copy_(b)
        cache.length = n


def at(run, context: int, weight_bytes: int):
    """A step of the StaticDecoder `run` at `context` cached positions. Its cache was filled past every
    context (fill), and a step at c writes position c only: setting the length first makes each call, of
    any context, do the same work, whichever context the call before it ran."""
    ids = torch.ones(1, 1, dtype=torch.long)

    def step():
        run.cache.length = context
        with torch.no_grad():
            run(ids)

    step.weight_bytes, step.decoder = weight_bytes, run
    return step


def eager_step(model):
    """labkit.model's eager step at CONTEXT, rewound after each call."""
    cache = model.new_cache(1, 1024)
    with torch.no_grad():
        model(torch.ones(1, CONTEXT, dtype=torch.long), cache)
    ids = torch.ones(1, 1, dtype=torch.long)

    def step():
        with torch.no_grad():
            model(ids, cache)
        cache.truncate(CONTEXT)

    step.weight_bytes = floors.weight_bytes(model)
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

    step.weight_bytes = floors.weight_bytes(hf)
    return step


def in_process(fn):
    """A block of timed calls of fn after `settle` untimed ones, for round_robin."""

    def block(steps: int, settle: int) -> list[float]:
        for _ in range(settle):
            fn()
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    return block


def round_robin(blocks: dict, rounds: int, steps: int, settle: int) -> dict[str, list[float]]:
    """Every block(steps, settle) in turn, `rounds` times, the order rotated each round so that no variant
    always follows the same one; {name: every timed call's seconds}."""
    names, times = list(blocks), {name: [] for name in blocks}
    for name in names:  # warm: a compiled step's first call at a new window compiles
        blocks[name](1, 1)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name] += blocks[name](steps, settle)
    return times


def stats(ts: list[float]) -> dict:
    s = sorted(ts)
    med, p10, p90 = s[len(s) // 2], s[len(s) // 10], s[(9 * len(s)) // 10]
    return {"ms": round(med * 1e3, 3), "min ms": round(s[0] * 1e3, 3), "spread %": round(100 * (p90 - p10) / med, 1)}


def dequantized(model, weights: str):
    """A copy of model that computes what cpu_kernels' quantized loops do: its matrices and LM head hold the
    dequantized weights, and each one's input is rounded to int8 blocks of 32 first (round_activation), as
    the loops (and llama.cpp) round x before their integer dot products."""
    model = copy.deepcopy(model)
    quantize = {
        "int8": cpu_kernels.quantize_q8_0,
        "int4": cpu_kernels.quantize_q4_1,
        "q4_0": cpu_kernels.quantize_q4_0,
    }[weights]
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # unties the embedding
        for linear in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
            linear.weight.copy_(cpu_kernels.dequantize(*quantize(linear.weight)))
            linear.register_forward_pre_hook(lambda _, args: (cpu_kernels.round_activation(args[0]),))
    return model


def greedy_check(model, step: StaticDecoder, prompt: list[int], weights: str) -> tuple[dict, list[int], list]:
    """A compiled step's greedy tokens against the eager model's on the same (dequantized) weights: the
    reference decodes and keeps its logits; the step is teacher-forced on the reference's tokens for its
    logit error, then decodes greedily and must agree up to a near-tie within 2x that error, or this raises.
    Returns (the figures, the reference's tokens, the step's teacher-forced logits after each of them)."""
    ref = model if weights == "fp32" else dequantized(model, weights)
    with torch.no_grad():
        cache = ref.new_cache(1, len(prompt) + GREEDY_TOKENS)
        logits, want = [ref(torch.tensor([prompt]), cache)[0, -1]], []
        for _ in range(GREEDY_TOKENS):
            want.append(logits[-1].argmax().item())
            logits.append(ref(torch.tensor([[want[-1]]]), cache)[0, -1])
        runs = {}
        for forced in (True, False):
            step.cache.truncate(0)
            first = ref(torch.tensor([prompt]), step.cache)[0, -1]  # the same prefill as the reference
            got, out = [], [first]
            for i in range(GREEDY_TOKENS):
                got.append(want[i] if forced else out[-1].argmax().item())
                out.append(step(torch.tensor([[got[-1]]]))[0, -1])
            runs[forced] = got, out
        step.cache.truncate(0)
    err = max((a - b).abs().max().item() for a, b in zip(runs[True][1][1:], logits[1:], strict=True))
    got = runs[False][0]
    assert_greedy_within(got, want, logits, 2 * err, f"greedy {weights}: compiled cpp step against eager")
    figures = {"equal": sum(a == b for a, b in zip(got, want, strict=True)), "max_logit_error": round(err, 4),
               "first_difference": next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)}  # fmt: skip
    return figures, want, runs[True][1][1:]


def course_prefill(model, tokens: int, logits_to_keep: int = 1):
    """The prompt through labkit.model into a fresh cache; the LM head over the last position only, as
    llama.cpp's eval and stage 04's engine do (logits_to_keep=0: over every position)."""
    ids = torch.ones(1, tokens, dtype=torch.long)

    def prefill():
        with torch.no_grad():
            model(ids, model.new_cache(1, tokens), logits_to_keep=logits_to_keep)

    return prefill


def llamacpp_variants(files: dict) -> dict[str, dict]:
    """{row name: worker config}: every GGUF mmap'd (4 kB pages), and the four compared ones on 2 MB pages."""
    out = {f"llama.cpp {mix}": {"gguf": str(path), "mmap": True} for mix, path in files.items()}
    for mix in ("F32", "Q8_0", "Q4_1", "Q4_0"):
        if mix in files:
            out[f"llama.cpp {mix}, 2 MB pages"] = {"gguf": str(files[mix]), "mmap": False, "huge": True}
    return out


def decode_rows(model, decoders, files, contexts, threads, quick, figures, hf=None) -> list[dict]:
    """One thread count's decode rows: the course's steps and a worker per llama.cpp variant, round-robin;
    with hf (a transformers model), at one thread, the slower course paths and transformers too."""
    blocks, sizes = {}, {}
    for ctx in contexts:
        for w, d in decoders.items():
            blocks[(f"StaticDecoder, compiled, cpp {w}", ctx)] = in_process(at(d, ctx, d.weight_bytes()))
            sizes[(f"StaticDecoder, compiled, cpp {w}", ctx)] = d.weight_bytes() + floors.kv_bytes(model, ctx)
    if hf is not None:
        extras = {"labkit.model, eager": eager_step(model), "Hugging Face transformers": hf_step(hf)}
        torch_fp32 = StaticDecoder(model, model.new_cache(1, 1024), "compile", weights="fp32", kernels="torch")
        with torch.no_grad():
            model(torch.ones(1, CONTEXT, dtype=torch.long), torch_fp32.cache)
        extras["StaticDecoder, compiled, torch fp32"] = at(torch_fp32, CONTEXT, torch_fp32.weight_bytes())
        for name, s in extras.items():
            blocks[(name, CONTEXT)] = in_process(s)
            sizes[(name, CONTEXT)] = s.weight_bytes + floors.kv_bytes(model, CONTEXT)
        figures["aten_ops"].update({name: aten_ops(s) for name, s in extras.items()})
    workers = {name: Worker({**cfg, "threads": threads, "contexts": list(contexts)})
               for name, cfg in llamacpp_variants(files).items()}  # fmt: skip
    try:
        for name, wk in workers.items():
            figures.setdefault("llamacpp_processes", {})[f"{name}, {threads} thread(s)"] = wk.info
            for ctx in contexts:
                blocks[(name, ctx)] = wk.decode_block(ctx)
                sizes[(name, ctx)] = wk.weight_bytes + floors.kv_bytes(model, ctx, element_size=2)
        times = round_robin(blocks, 3 if quick else ROUNDS, BLOCK, SETTLE)
    finally:
        for wk in workers.values():
            wk.close()
    rows = [decode_row(name, ctx, threads, times, sizes) for name, ctx in times]
    for r in rows:  # counted at CONTEXT on a warm step; llama.cpp runs no aten ops
        r["aten ops"] = figures["aten_ops"].get(r["variant"], "") if r["context"] == CONTEXT else ""
    return rows


def decode_row(name: str, ctx: int, threads: int, times: dict, sizes: dict) -> dict:
    s = stats(times[(name, ctx)])
    w = name.rsplit(" ", 1)[-1]
    same = times.get((f"llama.cpp {COURSE.get(w, 'F32')}", ctx))
    row = {"what": "decode", "threads": threads, "context": ctx, "variant": name, **s,
           "vs llama.cpp same precision": round(s["ms"] / stats(same)["ms"], 2) if same else "",
           "weight+KV MB": round(sizes[(name, ctx)] / 1e6, 1), **floors.row(s["ms"] / 1e3, bytes=sizes[(name, ctx)])}  # fmt: skip
    q40 = times.get(("llama.cpp Q4_0", ctx))
    if w == "int4" and q40:
        row["vs llama.cpp Q4_0"] = round(s["ms"] / stats(q40)["ms"], 2)
    return row


def prefill_rows(model, files, threads, quick) -> list[dict]:
    blocks = {f"labkit.model {n}": in_process(course_prefill(model, n)) for n in PREFILLS}
    n = max(PREFILLS)  # the LM head over every position too: what computing unused logits costs
    blocks[f"labkit.model, every position's logits {n}"] = in_process(course_prefill(model, n, logits_to_keep=0))
    worker = (
        Worker({"gguf": str(files["F32"]), "threads": threads, "n_batch": n, "n_ctx": n}) if "F32" in files else None
    )
    try:
        if worker:
            blocks.update({f"llama.cpp F32 {n}": worker.prefill_block(n) for n in PREFILLS})
        times = round_robin(blocks, 2 if quick else 5, 1, 0)
    finally:
        if worker:
            worker.close()
    rows = []
    for name, ts in times.items():
        n, s = int(name.rsplit(" ", 1)[-1]), stats(ts)
        cpp = times.get(f"llama.cpp F32 {n}")
        rows.append({"what": f"prefill {n}", "threads": threads, "variant": name, **s,
                     "tokens/s": round(n / s["ms"] * 1e3), "vs llama.cpp same precision": round(s["ms"] / stats(cpp)["ms"], 2) if cpp else "",
                     **floors.row(s["ms"] / 1e3, flops=floors.forward_flops(model, n, logits=n if "every" in name else 1))})  # fmt: skip
    return rows


def main(quick: bool = False) -> bench.Result:
    model, which = bench.model()
    folder = model_folder("MODEL")  # the folder bench.model() read: every row runs these weights
    contexts = [c for c in CONTEXTS if c < model.rope_cos.shape[0]]  # the tiny model's RoPE table: 1024
    figures = {"model": which, "context": CONTEXT, "contexts": contexts, "llamacpp_build": build_info()}
    t0 = time.perf_counter()
    pin_threads(1)
    decoders = course_decoders(model, contexts)
    prompt = bench.tokenizer().encode(PROMPT).ids
    checks = {w: greedy_check(model, decoders[w], prompt, w) for w in COURSE}  # compiles each step once
    figures["compile_s"] = round(time.perf_counter() - t0, 1)
    figures["greedy"] = {w: c[0] for w, c in checks.items()}
    fill(model, decoders, max(contexts))
    figures["course_pages"] = {w: pages_at(d.lm_head[0] if isinstance(d.lm_head, tuple) else d.lm_head)
                               for w, d in decoders.items()}  # fmt: skip
    figures["profile_1_thread"] = {w: profile_step(at(d, CONTEXT, d.weight_bytes())) for w, d in decoders.items()}
    figures["aten_ops"] = {
        f"StaticDecoder, compiled, cpp {w}": aten_ops(at(d, CONTEXT, 0)) for w, d in decoders.items()
    }
    from transformers import AutoModelForCausalLM

    hf, rows = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), []
    with tempfile.TemporaryDirectory() as tmp:
        files = gguf_files(folder, Path(tmp))
        figures["gguf"] = {mix: describe_gguf(path) for mix, path in files.items()}
        figures["kl_vs_llamacpp"] = {w: kl_per_token(files, COURSE[w], prompt, *checks[w][1:]) for w in COURSE
                                     if COURSE[w] in files}  # fmt: skip
        for threads in THREADS:
            pin_threads(threads)  # llama.cpp gets the same count: the comparison is per core
            figures[f"floors_{threads}_threads"] = floors.figures()  # while no llama.cpp process runs
            rows += decode_rows(model, decoders, files, contexts, threads, quick, figures, hf if threads == 1 else None)
            rows += prefill_rows(model, files, threads, quick)
    decode = [r for r in rows if r["what"] == "decode"]  # the two kinds of row have different columns
    print(bench.table(decode, title=f"decode, {which}, median of {ROUNDS * BLOCK}; vs: ratio of medians"))
    print(bench.table([r for r in rows if r["what"] != "decode"], title=f"prefill, {which}, median"))
    print(f"greedy, compiled cpp step against eager: {figures['greedy']}")
    print(f"KL per token, course against llama.cpp on the same GGUF: {figures['kl_vs_llamacpp']}")
    return bench.Result(rows, figures, plot_decode(decode, which))


def plot_decode(rows: list[dict], which: str):
    """ms per step against context, one thread: the course's compiled cpp steps (solid) and llama.cpp (dashed)."""
    plt = plot.setup()
    fig, ax = plt.subplots()
    lines = [(f"StaticDecoder, compiled, cpp {w}", "-", f"C{i}") for i, w in enumerate(COURSE)]
    lines += [(f"llama.cpp {m}", "--", f"C{i}") for i, m in enumerate(COURSE.values())]
    for name, style, color in lines:
        pts = sorted((r["context"], r["ms"]) for r in rows if r["variant"] == name and r["threads"] == 1)
        if pts:
            ax.plot(*zip(*pts, strict=True), style, color=color, marker="o", label=name)
    ax.set(xscale="log", xlabel="context (cached tokens)", ylabel="ms per decode step, 1 thread",
           title=f"One decode step: {which}")  # fmt: skip
    ax.legend(fontsize=7)
    return fig
