"""Decode and prefill against llama.cpp and against the machine's floor (issues 24 and 49).

    make bench STAGE=decode [MODEL=real]   (installs llama-cpp-python on demand: make llamacpp)

$MODEL defaults to the tiny target; `real` is SmolLM2-135M-Instruct. At one thread, then two:

- decode: one cached step at CONTEXT tokens of labkit.fast_decode.StaticDecoder, torch.compile'd, with
  labkit.cpu_kernels' fp32, int8 (Q8_0) and int4 (Q4_1) matrix-vector loops, beside llama.cpp on the same
  model as GGUF F32, Q8_0 and Q4_1 (the real model ships as Q4_1; llama.cpp requantizes it; the tiny one
  is exported by stage 03's exporter). At one thread also labkit.model eager, the compiled step on
  PyTorch's kernels, and Hugging Face transformers. Each floor is the bytes the step must read (every
  weight once at its width; the GGUF file's tensors for llama.cpp) over the measured streaming bandwidth.
- prefill: PREFILLS-token prompts through labkit.model (float32, PyTorch's GEMMs) beside llama.cpp F32
  with n_batch = the prompt, both computing the last position's logits only (as an engine does; one row
  also every position's, at the longest prompt); the floor is the forward's FLOPs over the measured
  float32 GEMM rate.

Every variant is timed round-robin (bench.interleaved) so load drift hits all alike, each decode step
right after an untimed one of its own (a decode loop's steps run back to back); the floors are measured
at each thread count before llama.cpp's threads exist; aten ops per step
are counted by torch.profiler on a warm step (a first call would count the tracing and compiling too).
Greedy tokens over GREEDY_TOKENS of a chat prompt: each fast path against the eager model on the same
(dequantized) weights, accepted up to a difference within the paths' measured logit error.
"""

import copy
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import profile

from labkit import bench, cpu_kernels, plot
from labkit.bench import floors
from labkit.checkpoint import model_folder, real_model_folder
from labkit.device import pin_threads
from labkit.fast_decode import StaticDecoder
from labkit.impl import load
from labkit.testing import assert_greedy_within

CONTEXT = 128
PREFILLS = (128, 512)
THREADS = (1, 2)
GREEDY_TOKENS = 64
PROMPT = "<|im_start|>user\nWhat is the capital of France, and why?<|im_end|>\n<|im_start|>assistant\n"
LLAMACPP = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_1"}  # the GGUF type of each course precision


def aten_ops(step) -> int:
    step()  # warm: the first call of a compiled step traces and compiles, thousands of ops
    with profile() as p:
        step()
    return sum(1 for e in p.events() if e.name.startswith("aten::"))


def profile_step(step) -> list[dict]:
    """Where a warm step's time goes, per op kind: each matrix-vector op (the bytes of its weights, their
    rate, and its time over its own floor), the attention (the cached keys and values it reads), and the
    rest of the compiled graph (norms, RoPE, cache writes, residual adds, dynamo's guard check) as one row."""
    step()
    profiles = []
    for _ in range(5):  # one step each; the quickest, so that a preemption does not land in "the rest"
        with profile(record_shapes=True) as p:
            step()
        span = max(e.time_range.end for e in p.events()) - min(e.time_range.start for e in p.events())  # us
        profiles.append((span, p.events()))
    total, events = min(profiles, key=lambda t: t[0])
    events = [e for e in events if e.name.startswith("labkit_cpu::")]
    decoder, per_weight = step.decoder, {"fp32": 4, "int8": 1 + 2 / 32, "int4": 0.5 + 4 / 32}  # bytes per weight
    rows = {}
    c = decoder.c
    for e in events:
        if e.name == "labkit_cpu::decode_attention":  # reads the keys and values 0..pos of one layer
            kind, nbytes = (
                f"attention over {CONTEXT + 1} keys",
                2 * c.num_key_value_heads * (CONTEXT + 1) * c.head_dim * 4,
            )
        else:
            (_, n_in), w = e.input_shapes[0], e.input_shapes[1]
            n_out = w[0] * (w[2] if len(w) == 4 else 1)  # float32 comes packed: (out / 4, in / 8, 4, 8)
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


def course_step(model, backend: str | None, weights: str = "fp32", kernels: str = "cpp"):
    """One cached step at position CONTEXT, rewound after each call; backend None = model(ids, cache)."""
    cache = model.new_cache(1, 1024)
    with torch.no_grad():
        model(torch.ones(1, CONTEXT, dtype=torch.long), cache)
    run = StaticDecoder(model, cache, backend, weights=weights, kernels=kernels) if backend else None
    ids = torch.ones(1, 1, dtype=torch.long)

    def step():
        with torch.no_grad():
            run(ids) if run else model(ids, cache)
        cache.truncate(CONTEXT)

    step.weight_bytes = run.weight_bytes() if run else floors.weight_bytes(model)
    step.decoder = run
    return step


def dequantized(model, weights: str):
    """A copy of model that computes what cpu_kernels' quantized loops do: its matrices and LM head hold the
    dequantized weights, and each one's input is rounded to int8 blocks of 32 first (round_activation), as
    the loops (and llama.cpp) round x before their integer dot products."""
    model = copy.deepcopy(model)
    quantize = {"int8": cpu_kernels.quantize_q8_0, "int4": cpu_kernels.quantize_q4_1}[weights]
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # unties the embedding
        for linear in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
            linear.weight.copy_(cpu_kernels.dequantize(*quantize(linear.weight)))
            linear.register_forward_pre_hook(lambda _, args: (cpu_kernels.round_activation(args[0]),))
    return model


def greedy_check(model, step: StaticDecoder, prompt: list[int], weights: str) -> dict:
    """A compiled step's greedy tokens against the eager model's on the same (dequantized) weights: the
    reference decodes and keeps its logits; the step is teacher-forced on the reference's tokens for its
    logit error, then decodes greedily and must agree up to a near-tie within 2x that error. The step's
    cache is reused (prefilled again with the prompt: the same window, no new compile), then restored."""
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
        model(torch.ones(1, CONTEXT, dtype=torch.long), step.cache)  # back to the benchmark's context
    err = max((a - b).abs().max().item() for a, b in zip(runs[True][1][1:], logits[1:], strict=True))
    got = runs[False][0]
    try:
        assert_greedy_within(got, want, logits, 2 * err, f"greedy {weights}: compiled cpp step against eager")
        within = True
    except AssertionError as e:  # recorded, not raised: the other rows still get measured
        print(e)
        within = False
    return {"equal": sum(a == b for a, b in zip(got, want, strict=True)), "max_logit_error": round(err, 4),
            "within_bound": within,
            "first_difference": next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)}  # fmt: skip


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


def llamacpp(path: Path, threads: int, n_batch: int = 512):
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=n_batch,
                 n_ubatch=n_batch, verbose=False)  # fmt: skip


def llamacpp_step(llm, path: Path):
    import gguf

    llm.reset()
    llm.eval([1] * CONTEXT)

    def step():
        llm.n_tokens = CONTEXT  # eval drops the KV cache beyond n_tokens
        llm.eval([1])

    step.weight_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)  # the file's tensors, tied once
    return step


def llamacpp_prefill(llm, tokens: int):
    def prefill():
        llm.reset()  # an empty cache: the whole prompt is computed
        llm.eval([1] * tokens)

    return prefill


def course_prefill(model, tokens: int, logits_to_keep: int = 1):
    """The prompt through labkit.model into a fresh cache; the LM head over the last position only, as
    llama.cpp's eval and stage 04's engine do (logits_to_keep=0: over every position)."""
    ids = torch.ones(1, tokens, dtype=torch.long)

    def prefill():
        with torch.no_grad():
            model(ids, model.new_cache(1, tokens), logits_to_keep=logits_to_keep)

    return prefill


def gguf_files(folder: Path, tmp: Path) -> dict[str, Path]:
    """{"F32" | "Q8_0" | "Q4_1": GGUF file} of the benchmark's model; {} (with the reason) without llama.cpp."""
    try:
        import llama_cpp  # noqa: F401  (before the exports, which take a while)
    except ImportError as e:
        print(f"llama.cpp rows left out ({e}); `make llamacpp` installs llama.cpp")
        return {}
    if folder == real_model_folder():  # stage 03's exporter writes byte-level BPE vocabularies only
        from labkit.gguf_model import installed_gguf

        shipped = installed_gguf()
        return {"F32": requantize(shipped, tmp / "F32", "F32"), "Q8_0": requantize(shipped, tmp / "Q8_0", "Q8_0"),
                "Q4_1": shipped}  # fmt: skip
    try:
        export = load("stage03_quantization.gguf_export")
        return {mix: export.export_gguf(folder, tmp / f"{mix}.gguf", mix) for mix in ("F32", "Q8_0")}
    except (NotImplementedError, ValueError) as e:  # a learner's unwritten exporter, or a model it refuses
        print(f"llama.cpp rows of stage 03's exporter left out ({type(e).__name__}: {e})")
        return {}


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
    model, which = bench.model()
    folder = model_folder("MODEL")  # the folder bench.model() read: every row runs these weights
    rows, figures, t0 = [], {"model": which, "context": CONTEXT}, time.perf_counter()
    pin_threads(1)
    course = {w: course_step(model, "compile", w) for w in LLAMACPP}
    for step in course.values():
        step()  # compiles: once per process, shared by both thread counts (the matvec ops follow torch's threads)
    figures["compile_s"] = round(time.perf_counter() - t0, 1)
    prompt = bench.tokenizer().encode(PROMPT).ids
    figures["greedy"] = {w: greedy_check(model, course[w].decoder, prompt, w) for w in LLAMACPP}
    figures["profile_1_thread"] = {w: profile_step(s) for w, s in course.items()}
    for w, table in figures["profile_1_thread"].items():
        print(
            bench.table(
                table, title=f"where the compiled cpp {w} step's time goes, 1 thread (floor: bytes / streaming rate)"
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        files = gguf_files(folder, Path(tmp))
        for threads in THREADS:
            pin_threads(threads)  # llama.cpp gets the same count: the comparison is per core
            figures[f"floors_{threads}_threads"] = floors.figures()  # measured before any llama.cpp thread exists
            steps = {f"StaticDecoder, compiled, cpp {w}": s for w, s in course.items()}
            if threads == 1:
                steps["labkit.model, eager"] = course_step(model, None)
                steps["StaticDecoder, compiled, torch fp32"] = course_step(model, "compile", "fp32", "torch")
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
                steps["Hugging Face transformers"] = hf_step(hf)
            llms = {mix: llamacpp(path, threads) for mix, path in files.items()}
            steps.update({f"llama.cpp {mix}": llamacpp_step(llm, files[mix]) for mix, llm in llms.items()})
            ops = {n: aten_ops(s) for n, s in steps.items() if not n.startswith("llama.cpp")}
            # each step timed right after an untimed one of its own: interleaved cold, torch's two OpenMP threads
            # woke from sleep after llama.cpp's turns (11.8 ms for the fp32 step alone, 18.0 in the round-robin)
            times = bench.interleaved(steps, repeats=30 if quick else 100, warmup=5, settle=1)
            for name, t in times.items():
                mix = LLAMACPP.get(name.rsplit(" ", 1)[-1], "F32")
                cpp = times.get(f"llama.cpp {mix}")
                rows.append({"what": "decode", "threads": threads, "variant": name, "ms": round(t.median * 1e3, 3),
                             "vs llama.cpp same precision": round(t.median / cpp.median, 2) if cpp else "",
                             **floors.row(t.median, bytes=steps[name].weight_bytes), "aten ops": ops.get(name, "")})  # fmt: skip
            prefills = {f"labkit.model {n}": course_prefill(model, n) for n in PREFILLS}
            n = max(PREFILLS)  # the LM head over every position too: what computing unused logits costs
            prefills[f"labkit.model, every position's logits {n}"] = course_prefill(model, n, logits_to_keep=0)
            if "F32" in files:
                llm = llamacpp(files["F32"], threads, n_batch=max(PREFILLS))  # n_batch, n_ubatch: the longest prompt
                prefills.update({f"llama.cpp F32 {n}": llamacpp_prefill(llm, n) for n in PREFILLS})
            times = bench.interleaved(prefills, repeats=2 if quick else 5, warmup=1)
            for name, t in times.items():
                n = int(name.rsplit(" ", 1)[-1])
                cpp = times.get(f"llama.cpp F32 {n}")
                rows.append({"what": f"prefill {n}", "threads": threads, "variant": name, "ms": round(t.median * 1e3, 1),
                             "tokens/s": round(n / t.median), "vs llama.cpp same precision": round(t.median / cpp.median, 2) if cpp else "",
                             **floors.row(t.median, flops=floors.forward_flops(model, n, logits=n if "every" in name else 1))})  # fmt: skip
            del llms, steps, prefills
    decode = [r for r in rows if r["what"] == "decode"]  # the two kinds of row have different columns
    print(bench.table(decode, title=f"decode at context {CONTEXT}, {which}, median; vs: ratio of times"))
    print(bench.table([r for r in rows if r["what"] != "decode"], title=f"prefill, {which}, median"))
    print(f"greedy over {GREEDY_TOKENS} tokens, compiled cpp step against the eager model on the same weights: "
          f"{figures['greedy']}")  # fmt: skip
    return bench.Result(rows, figures, plot_decode(decode, which))


def plot_decode(rows: list[dict], which: str):
    """ms per step of the compiled cpp step and llama.cpp at each precision and thread count, floors dashed."""
    plt = plot.setup()
    fig, ax = plt.subplots()
    for i, (w, mix) in enumerate(LLAMACPP.items()):
        for j, threads in enumerate(THREADS):
            at = {r["variant"]: r for r in rows if r["threads"] == threads}
            x = 3 * i + 1.2 * j
            for dx, name in [(0, f"StaticDecoder, compiled, cpp {w}"), (0.5, f"llama.cpp {mix}")]:
                if name in at:
                    ax.bar(x + dx, at[name]["ms"], 0.45, color="C0" if dx == 0 else "C1")
                    ax.hlines(at[name]["floor ms"], x + dx - 0.22, x + dx + 0.22, colors="k", linestyles="dashed")
    ax.set_xticks([3 * i + 1.2 * j + 0.25 for i in range(3) for j in range(len(THREADS))],
                  [f"{w}\n{t} thr" for w in LLAMACPP for t in THREADS])  # fmt: skip
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="C0", label="course (compiled, labkit.cpu_kernels)"),
                       Patch(color="C1", label="llama.cpp (F32 / Q8_0 / Q4_1)"),
                       Line2D([], [], color="k", linestyle="dashed", label="floor: bytes / streaming rate")])  # fmt: skip
    ax.set(ylabel=f"ms per decode step at context {CONTEXT}", title=f"One decode step: {which}")
    return fig
