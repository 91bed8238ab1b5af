"""Stage 04 part 3 on SmolLM2-135M-Instruct (`make setup`): the engine's KV pool in float32 (auto), fp8 e4m3 and
int8 (`--kv-cache-dtype`, kv_quant.py).

    make bench STAGE=04c [QUICK=1]     (IMPL=student measures your own kv_quant.py)

A. Capacity: one fixed pool (POOL_MIB), sized in blocks for each format (kv_quant.bytes_per_token); 16 chats in
   the checkpoint's template, each answering until it fills 8 blocks, all arriving at once, greedy, EOS ignored.
   The chats the pool fits whole (blocks // 8), the chats running per step (mean and most: the scheduler admits a
   chat on its prompt's blocks, so it may admit more and preempt them as they grow), the chats running when the
   first preemption came (none: it never did), preemptions, and output tokens per second against the workload
   floor (stage04.workload_floor).
B. Long-context decode: one sequence at 1k, 2k and 4k cached tokens (random keys and values written through
   cache.write: a decode step's time does not depend on what the values are), one decode step of forward_paged,
   the three formats in turn, median of repeats; its floor reads the weights and the pool's bytes for that context
   (1 byte an element, plus int8's scales). Also the attention alone (every layer's cache.read + paged_attention)
   against the bytes of K/V.
C. Stage 03's quality gate (evaluate.divergence and quality_gate, loaded as stage code is: IMPL=student runs
   yours) through the engine: forward_paged over
   held-out windows, every key and value read back from the pool, against the float32 pool's logits:
   perplexity, top-1 agreement and mean KL per token. fp8's scales are fixed first by a short chat prompt
   (a server's first request); per head (the engine's) and per tensor (vLLM's default layout). The engine serves
   float32 weights only, so weight formats enter as llama.cpp's Q8_0 / Q4_1 grids rounded into float32 copies
   (rounded_weights): the quality such weights give, not their speed or memory. The course's SmolLM2 is converted
   from a Q4_1 GGUF (MODELS.md), so Q4_1 reproduces its weights exactly: a check that the path is lossless.
"""

import copy
import dataclasses
import statistics
import textwrap
import time

import torch

from labkit import bench, cpu_kernels, plot, quality
from labkit.bench import floors
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.impl import load

from .stage04 import workload_floor
from .stage04_real import chat

FORMATS = ("auto", "fp8_e4m3", "int8")
POOL_MIB = 16
BLOCK = 16
CHATS = 16
CONTEXTS = (1024, 2048, 4096)
ENGINE_CONFIG: dict = {}  # the last capacity engine's settings, for the JSON


def capacity(model, tok, fmt: str, chats: int) -> dict:
    """A. The chats of a fixed pool through the engine, all arriving at once."""
    kv, eng, seq_mod = (load(f"stage04_batching.{m}") for m in ("kv_quant", "engine", "sequence"))
    blocks = POOL_MIB * 2**20 // (kv.bytes_per_token(model.config, fmt) * BLOCK)
    # PyTorch's matmuls, as in B and C, where the engine offers another kernel: the formats are what differ here
    torch_kernels = {"kernels": "torch"} if "kernels" in {f.name for f in dataclasses.fields(eng.EngineConfig)} else {}
    engine = eng.LLMEngine(
        model, tok, num_blocks=blocks, block_size=BLOCK, max_num_seqs=chats, kv_cache_dtype=fmt,
        enable_prefix_caching=False, **torch_kernels,
    )  # fmt: skip
    ENGINE_CONFIG.update({k: str(v) for k, v in dataclasses.asdict(engine.config).items()})  # what served the chats
    prompt = tok.encode(chat("Tell me a story about a lighthouse keeper.")).ids
    new = 8 * BLOCK - len(prompt)
    running, preempted = [], []  # chats running before each step; (step, chats running) at each preemption
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda s: (preempted.append((len(running), running[-1])), preempt(s))[1]
    for _ in range(chats):
        engine.add_request(prompt, seq_mod.SamplingParams(max_tokens=new, ignore_eos=True))
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        running.append(len(engine.scheduler.running))
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    row = {
        "kv_cache_dtype": fmt, "pool MiB": POOL_MIB, "blocks": blocks, "chats fit": blocks // 8,
        "mean running": round(statistics.mean(running), 1), "max running": max(running),
        "running at 1st preemption": preempted[0][1] if preempted else "none", "preemptions": len(preempted),
        "steps": steps, "output tokens/s": round(chats * new / seconds, 1), "seconds": round(seconds, 1),
    }  # fmt: skip
    floor = workload_floor(model, [prompt] * chats, [new] * chats, max(running))
    row.update(floors.row(seconds, **floor))
    return row


def decode_steps(model, context: int, repeats: int) -> list[dict]:
    """B. One decode step of forward_paged at `context` cached tokens in each format, and its attention alone,
    the formats timed in turn (bench.interleaved) so that load on the machine hits them alike."""
    kv, eng = load("stage04_batching.kv_quant"), load("stage04_batching.engine")
    pa = load("stage04_batching.paged_attention")
    c = model.config
    blocks = context // BLOCK + 1
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(context)
    values = [
        [torch.randn(context, c.num_key_value_heads, c.head_dim, generator=g) for _ in range(2)]
        for _ in range(c.num_hidden_layers)
    ]
    table, ctx, one = torch.arange(blocks)[None], torch.tensor([context + 1]), torch.tensor([1])
    args = (torch.tensor([5]), torch.tensor([context]), torch.tensor([context]), table, ctx, one)
    q = torch.randn(1, c.num_attention_heads, c.head_dim, generator=g)
    steps, attention = {}, {}

    def attend(cache):  # every layer's read (widening the blocks) and paged_attention, for one decode query
        for layer in range(c.num_hidden_layers):
            k, v, tables = cache.read(layer, table)
            pa.paged_attention(q, k, v, tables, ctx, one)

    for fmt in FORMATS:
        cache = kv.make_cache(c, blocks, BLOCK, fmt)
        for layer, (k, v) in enumerate(values):
            cache.write(layer, k, v, slots)
        steps[fmt] = lambda cache=cache: eng.forward_paged(model, cache, *args)
        attention[fmt] = lambda cache=cache: attend(cache)

    step_t = bench.interleaved(steps, repeats=repeats, warmup=2)
    attn_t = bench.interleaved(attention, repeats=repeats, warmup=2)
    rows = []
    for fmt in FORMATS:
        kv_bytes = kv.bytes_per_token(c, fmt) * (context + 1)
        row = {"kv_cache_dtype": fmt, "context": context, "step ms": round(step_t[fmt].median * 1e3, 2)}
        row.update(floors.row(step_t[fmt].median, bytes=floors.weight_bytes(model) + kv_bytes))
        row |= {"attention ms": round(attn_t[fmt].median * 1e3, 2), "K/V MB read": round(kv_bytes / 1e6, 1)}
        row.update(floors.row(attn_t[fmt].median, bytes=kv_bytes, name="attention"))
        rows.append(row)
    return rows


@torch.inference_mode()
def window_logits(model, fmt: str, windows: torch.Tensor, per_head: bool = True) -> torch.Tensor:
    """C. (N, T, vocab) logits of every window position through forward_paged over a `fmt` pool."""
    kv, eng = load("stage04_batching.kv_quant"), load("stage04_batching.engine")
    T = windows.shape[1]
    blocks = -(-T // BLOCK)
    if fmt == "auto":
        cache = kv.make_cache(model.config, blocks, BLOCK)
    else:
        cache = kv.QuantizedKVCache(model.config, blocks, BLOCK, fmt, per_head=per_head)
    table = torch.arange(blocks)[None]

    def run(ids: list[int]) -> torch.Tensor:
        n = len(ids)
        args = (torch.arange(n), torch.arange(n), table, torch.tensor([n]), torch.tensor([n]), torch.arange(n))
        return eng.forward_paged(model, cache, torch.tensor(ids), *args)

    run(load_tokenizer(require_real_model()).encode(chat("What is the capital of France?")).ids)  # fixes fp8 scales
    return torch.stack([run(w.tolist()) for w in windows])


def rounded_weights(model, fmt: str):
    """A copy of model whose decoder matrices hold llama.cpp's Q8_0 or Q4_1 grid (labkit.cpu_kernels), in float32:
    what a kernel that dequantizes them computes, up to its rounding of activations."""
    quantize = {"q8_0": cpu_kernels.quantize_q8_0, "q4_1": cpu_kernels.quantize_q4_1}[fmt]
    rounded = copy.deepcopy(model)
    for layer in rounded.model.layers:
        a, m = layer.self_attn, layer.mlp
        for linear in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            linear.weight.data = cpu_kernels.dequantize(*quantize(linear.weight.data))
    return rounded


# (name, weights, kv_cache_dtype, fp8 per head): the served configurations the gate measures
CONFIGS = [
    ("float32", None, "auto", True),
    ("fp8_e4m3 KV per head", None, "fp8_e4m3", True),
    ("fp8_e4m3 KV per tensor", None, "fp8_e4m3", False),
    ("int8 KV", None, "int8", True),
    ("Q8_0 weights", "q8_0", "auto", True),
    ("Q8_0 weights + fp8_e4m3 KV", "q8_0", "fp8_e4m3", True),
    ("Q4_1 weights (the source GGUF's grid)", "q4_1", "auto", True),
]


GATE_BOUNDS = {"max_ppl_increase_pct": 1.0, "max_top1_disagreement": 0.05}  # stage 03's quality_gate defaults


def gate(model, tok, n_tokens: int) -> list[dict]:
    """C. The deploy gate's figures for each served configuration against the float32 pool."""
    evaluate, nan = load("stage03_quantization.evaluate"), float("nan")  # the gate is stage 03's lesson, not labkit's
    windows = quality.heldout(tok, n_tokens=n_tokens, seq=256)
    targets = windows[:, 1:]
    variants = {w: rounded_weights(model, w) for w in ("q8_0", "q4_1")}
    logits = {
        name: window_logits(variants.get(weights, model), fmt, windows, per_head)
        for name, weights, fmt, per_head in CONFIGS
    }
    base = logits["float32"]

    def ppl(x):
        nll = torch.nn.functional.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), targets.reshape(-1))
        return float(nll.exp())

    rows, base_ppl = [], ppl(base)
    for name, x in logits.items():
        kl, top1 = evaluate.divergence(base, x)
        verdict = evaluate.quality_gate(evaluate.Report(base_ppl, 0, nan), evaluate.Report(ppl(x), 0, nan, kl, top1))
        passed, reasons = verdict.passed, verdict.reasons
        rows.append({
            "configuration": name, "perplexity": round(ppl(x), 4), "ppl increase %": round(100 * (ppl(x) / base_ppl - 1), 3),
            "top-1 agreement": round(top1, 4), "mean KL nats": float(f"{kl:.3g}"), "gate": "pass" if passed else "BLOCK",
            "reasons": reasons, "tokens": windows.numel(),
        })  # fmt: skip
    return rows


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # as every benchmark: one thread, so other work on a 2-core machine disturbs it least
    folder = require_real_model()
    model, tok = load_model(folder)  # outside inference mode: an engine may repack the weights and track them
    with torch.inference_mode():
        return measure(model, tok, folder, quick)


def measure(model, tok, folder, quick: bool) -> bench.Result:
    which = f"{folder.name} ({model.num_params() / 1e6:.1f}M params)"
    chats, contexts, repeats, n_tokens = (6, CONTEXTS[:1], 3, 512) if quick else (CHATS, CONTEXTS, 7, 2048)
    cap = [capacity(model, tok, fmt, chats) for fmt in FORMATS]
    print(bench.table(cap, f"A. {chats} chats of 8 blocks in a {POOL_MIB} MiB pool, {which}"))
    steps = [row for n in contexts for row in decode_steps(model, n, repeats)]
    print(bench.table(steps, f"B. one decode step at long context, median of {repeats}"))
    gates = gate(model, tok, n_tokens)
    print(bench.table([{k: v for k, v in r.items() if k != "reasons"} for r in gates], "C. the deploy gate"))
    figures = {
        "model": which, "engine_config": ENGINE_CONFIG, "repeats": repeats, "capacity": cap, "long_context": steps, "gate": gates,
        "gate_bounds": GATE_BOUNDS,
    }  # fmt: skip
    return bench.Result(cap + steps, figures, _plot(cap, steps, gates, which))


def load_model(folder):
    from labkit.model import from_pretrained

    return from_pretrained(folder).eval(), load_tokenizer(folder)


def _plot(cap, steps, gates, which):
    plt = plot.setup()
    fig, (ax_cap, ax_step, ax_gate) = plt.subplots(1, 3, figsize=(18, 4.8), gridspec_kw={"wspace": 0.45})
    ax_cap.bar([r["kv_cache_dtype"] for r in cap], [r["mean running"] for r in cap])
    for i, r in enumerate(cap):
        note = f"{r['output tokens/s']} tok/s\n{r['preemptions']} preemptions"
        ax_cap.annotate(note, (i, r["mean running"]), ha="center", va="bottom", fontsize=9)
    ax_cap.set(ylabel="chats running per step (mean)", title=f"{which.split(' (')[0]}: a {POOL_MIB} MiB KV pool")
    ax_cap.margins(y=0.2)
    for fmt in FORMATS:
        rows = [r for r in steps if r["kv_cache_dtype"] == fmt]
        line = ax_step.plot([r["context"] for r in rows], [r["step ms"] for r in rows], "o-", label=f"{fmt} step")
        ax_step.plot([r["context"] for r in rows], [r["floor ms"] for r in rows], ":", color=line[0].get_color())
    ax_step.set(xlabel="cached tokens", ylabel="ms (dotted: floor)", title="one decode step, 1 thread")
    ax_step.legend()
    x = torch.arange(len(gates)).numpy()
    ppl = [g["ppl increase %"] / GATE_BOUNDS["max_ppl_increase_pct"] for g in gates]
    top1 = [(1 - g["top-1 agreement"]) / GATE_BOUNDS["max_top1_disagreement"] for g in gates]
    ax_gate.barh(x - 0.2, ppl, 0.4, label="perplexity increase")
    ax_gate.barh(x + 0.2, top1, 0.4, label="top-1 disagreement")
    ax_gate.axvline(1, color="red", ls="--", label="the bound")
    names = [textwrap.fill(g["configuration"], 22) + ("" if g["gate"] == "pass" else " (BLOCK)") for g in gates]
    ax_gate.set_yticks(x, names, fontsize=8)
    ax_gate.invert_yaxis()
    ax_gate.set(xlabel="fraction of the gate's bound", title="the deploy gate through the engine")
    ax_gate.legend(fontsize=8)
    return fig
