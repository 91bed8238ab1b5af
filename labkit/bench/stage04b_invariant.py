"""Stage 04 part 2, batch invariance on SmolLM2-135M-Instruct (`make setup`): what it buys and what it costs.

    make bench STAGE=04b_invariant [QUICK=1]     (IMPL=student times your own batch_invariant.py)

A. Determinism under random load, default engine against batch-invariant engine. Each run serves one
   target chat among 7-15 others (random questions, random arrival between steps, a random chunk size
   for chunked prefill, a pool as small as three of the longest requests); every request's output logprobs
   (the chosen token's and the top 5) are compared bit for bit with a batch-of-one forward of the same
   tokens. Counted: requests whose logprobs differ, the largest difference, the distinct logprob vectors
   and greedy continuations of the target. The same on the tiny target, with many more runs. Both engines
   run their linear layers through labkit's kernels (the default; the invariant engine's every pass,
   labkit/fast_paged.py), at 1 and then 2 threads.
B. Throughput: 16 chats, greedy, 16 output tokens each, at concurrency 1, 4 and 16 (max_num_seqs),
   default against invariant, interleaved, medians of repeats, at one thread.
C. Where the cost comes from: one decode step at batch 1, 4 and 16 (context ~45 tokens) split into its
   matmuls (F.linear on B rows against linear_padded, and against a fixed 16-row tile, the alternative the
   handout names) and its attention (paged_attention against split_kv_attention), beside the floor of a
   step (its weight and cache bytes at the measured one-thread streaming bandwidth, or its FLOPs at the GEMM
   rate, the larger), and the whole step on PyTorch's matmuls and on the kernels; and the same three matmul
   variants on a 512-token prefill.
"""

import math
import random

import torch
import torch.nn.functional as F

from labkit import TARGET, bench, plot
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.fast_paged import accelerate
from labkit.impl import load
from labkit.model import from_pretrained

from . import floors
from .stage04 import workload_floor
from .stage04_real import QUESTIONS, chat

MORE = [
    "How do bees make honey?",
    "What is a prime number?",
    "Describe a rainy day in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a cat.",
    "What is photosynthesis?",
    "How many legs does a spider have?",
    "What rhymes with moon?",
]
CHATS = QUESTIONS + MORE  # 16


def serve(engine_mod, params_cls, model, tok, prompts, rng, invariant, new):
    """One run under random load: prompts[0] is the target; [(prompt, output)] of every request."""
    block_size = 16
    longest = max(map(len, prompts)) + new
    engine = engine_mod.LLMEngine(
        model,
        tok,
        batch_invariant=invariant,
        block_size=block_size,
        num_blocks=-(-longest // block_size) * rng.choice([3, 6, 40]),
        max_num_batched_tokens=rng.choice([16, 64, 512]),
        max_num_seqs=16,
    )
    order = prompts[1:]
    order.insert(rng.randint(0, len(order)), prompts[0])
    ids, served = {}, []

    def step():
        for out in engine.step():
            if out.finished:
                served.append((ids[out.request_id], out))

    for p in order:
        ids[engine.add_request(p, params_cls(max_tokens=new, logprobs=5, ignore_eos=True))] = p
        for _ in range(rng.choice([0, 0, 1, 2])):
            step()
    while engine.has_unfinished_requests():
        step()
    return served


def determinism(model, tok, prompts, runs: int, new: int, seed: int = 0) -> list[dict]:
    engine_mod, params_cls = load("stage04_batching.engine"), load("stage04_batching.sequence").SamplingParams
    rows = []
    for invariant in (False, True):
        rng = random.Random(seed)
        alone: dict = {}  # (prompt, output) -> logprobs of a batch-of-one forward over prompt + output
        requests = differ = 0
        worst = 0.0
        vectors, outputs = set(), set()
        for _ in range(runs):
            companions = rng.sample(range(1, len(prompts)), rng.randint(min(7, len(prompts) - 1), len(prompts) - 1))
            batch = [prompts[0]] + [prompts[i] for i in companions]
            for prompt, out in serve(engine_mod, params_cls, model, tok, batch, rng, invariant, new):
                key = (tuple(prompt), tuple(out.token_ids))
                if key not in alone:
                    engine = engine_mod.LLMEngine(model, tok, batch_invariant=invariant, enable_prefix_caching=False)
                    ref = engine.generate([prompt + out.token_ids], params_cls(max_tokens=1, prompt_logprobs=5))[0]
                    alone[key] = ref.prompt_logprobs[len(prompt) :]
                got = [(t.token_id, t.logprob, tuple(t.top)) for t in out.logprobs]
                want = [(t.token_id, t.logprob, tuple(t.top)) for t in alone[key]]
                requests += 1
                differ += got != want
                worst = max(worst, *(abs(a[1] - b[1]) for a, b in zip(got, want, strict=True)))
                if prompt is prompts[0]:
                    vectors.add(tuple(t.logprob for t in out.logprobs))
                    outputs.add(out.text)
        rows.append({"mode": "invariant" if invariant else "default", "runs": runs, "requests": requests,
                     "requests_differing": differ, "max_logprob_diff": worst, "target_logprob_vectors": len(vectors),
                     "target_continuations": len(outputs)})  # fmt: skip
    return rows


def throughput(model, tok, prompts, new: int, repeats: int) -> list[dict]:
    engine_mod, params_cls = load("stage04_batching.engine"), load("stage04_batching.sequence").SamplingParams
    params = params_cls(max_tokens=new, ignore_eos=True)

    def run(c, invariant):
        n = max(c, 4)  # at concurrency 1, 4 chats are enough for a rate
        engine = engine_mod.LLMEngine(model, tok, num_blocks=256, max_num_seqs=c, batch_invariant=invariant)
        return lambda: [o.token_ids for o in engine.generate(prompts[:n], [params] * n)]

    variants = {(c, inv): run(c, inv) for c in (1, 4, 16) for inv in (False, True)}
    times = bench.interleaved(variants, repeats, warmup=0)
    rows = []
    for c in (1, 4, 16):
        base, inv = times[(c, False)], times[(c, True)]
        n = max(c, 4)
        floor = workload_floor(model, prompts[:n], [new] * n, c)  # the same work for both modes
        rows.append({"concurrency": c, "default_tok_s": n * new / base.median, "invariant_tok_s": n * new / inv.median,
                     "invariant_vs_default": base.median / inv.median, "same_tokens": base.last == inv.last,
                     **floors.row(base.median, **floor, name="default"),
                     **floors.row(inv.median, **floor, name="invariant")})  # fmt: skip
    return rows


def step_parts(model, tok, prompts, repeats: int) -> list[dict]:
    """One decode step's matmuls and attention, default against invariant, at batch 1, 4 and 16."""
    engine_mod, params_cls = load("stage04_batching.engine"), load("stage04_batching.sequence").SamplingParams
    bi, pa = load("stage04_batching.batch_invariant"), load("stage04_batching.paged_attention")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = []
    for B in (1, 4, 16):
        engine = engine_mod.LLMEngine(model, tok, num_blocks=256)
        for p in prompts[:B]:
            engine.add_request(p, params_cls(max_tokens=3, ignore_eos=True))
        seqs = engine.scheduler.running
        while len(seqs) < B or any(s.num_tokens - s.num_computed_tokens != 1 for s in seqs):
            engine.step()  # the prompts' prefill: then every sequence decodes
        seqs = engine.scheduler.schedule().seqs  # a decode batch, its slots allocated; each call rewrites them
        t = bench.interleaved(_parts(engine_mod, bi, pa, model, engine.cache, seqs, linears), repeats)
        context = max(s.num_tokens for s in seqs)
        floor = floors.floor_s(floors.decode_bytes(model, context, B), floors.forward_flops(model, B, context))
        rows.append({"batch": B, **{f"{k}_ms": v.median * 1e3 for k, v in t.items()}, "floor_ms": floor * 1e3})
    return rows


def _parts(engine_mod, bi, pa, model, cache, seqs, linears) -> dict:
    B, c = len(seqs), model.config
    inputs = [torch.randn(B, m.in_features) for m in linears]
    q = torch.randn(B, c.num_attention_heads, c.head_dim)
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
    ctx, ql = torch.tensor([s.num_tokens for s in seqs]), torch.ones(B, dtype=torch.int64)
    attention = (q, cache.k[0], cache.v[0], tables, ctx, ql)
    fast, every = accelerate(model), accelerate(model, max_rows=math.inf)  # what each engine runs by default
    return {
        "step_default": lambda: engine_mod.run_batch(model, cache, seqs, [1] * B),
        "step_invariant": lambda: engine_mod.run_batch(model, cache, seqs, [1] * B, None, bi.forward_invariant),
        "step_default_kernels": lambda: engine_mod.run_batch(fast, cache, seqs, [1] * B),
        "step_invariant_kernels": lambda: engine_mod.run_batch(every, cache, seqs, [1] * B, None, bi.forward_invariant),
        "matmuls_default": lambda: [F.linear(x, m.weight, m.bias) for x, m in zip(inputs, linears, strict=True)],
        "matmuls_padded": lambda: [bi.linear_padded(x, m.weight, m.bias) for x, m in zip(inputs, linears, strict=True)],
        "matmuls_tiled16": lambda: [_tiled(x, m.weight, m.bias) for x, m in zip(inputs, linears, strict=True)],
        "attention_default": lambda: [pa.paged_attention(*attention) for _ in range(c.num_hidden_layers)],
        "attention_split": lambda: [bi.split_kv_attention(*attention) for _ in range(c.num_hidden_layers)],
    }


def _tiled(x, weight, bias, tile: int = 16):
    """The fixed-tile alternative: exactly `tile` rows in every call, the last tile padded."""
    padded = F.pad(x, (0, 0, 0, -len(x) % tile))
    return torch.cat([F.linear(padded[i : i + tile], weight, bias) for i in range(0, len(padded), tile)])[: len(x)]


def prefill_matmuls(model, repeats: int, rows: int = 512) -> dict:
    """One prefill's matmuls over `rows` tokens: F.linear, linear_padded (one call) and 16-row tiles."""
    bi = load("stage04_batching.batch_invariant")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    inputs = [torch.randn(rows, m.in_features) for m in linears]
    pairs = list(zip(inputs, linears, strict=True))
    t = bench.interleaved({"default": lambda: [F.linear(x, m.weight, m.bias) for x, m in pairs],
                           "padded": lambda: [bi.linear_padded(x, m.weight, m.bias) for x, m in pairs],
                           "tiled16": lambda: [_tiled(x, m.weight, m.bias) for x, m in pairs]}, repeats)  # fmt: skip
    flops = 2 * rows * sum(m.weight.numel() for m in linears)
    return {"rows": rows, **{f"{k}_ms": v.median * 1e3 for k, v in t.items()}, "floor_ms": floors.floor_s(flops=flops) * 1e3,
            "tiled16_vs_padded": t["tiled16"].median / t["padded"].median}  # fmt: skip


@torch.inference_mode()
def main(quick: bool = False) -> bench.Result:
    folder = require_real_model()
    model, tok = from_pretrained(folder).eval(), load_tokenizer(folder)
    which = f"{folder.name} ({model.num_params() / 1e6:.1f}M params)"
    prompts = [tok.encode(chat(q)).ids for q in CHATS]
    runs, new, repeats = (2, 4, 1) if quick else (18, 8, 3)  # 18 runs: over 200 requests compared
    tiny_model, tiny_tok = from_pretrained(TARGET).eval(), load_tokenizer(TARGET)
    tiny_prompts = [tiny_tok.encode(q).ids for q in CHATS]
    det, tiny, rows = [], [], []
    for threads in (1, 2):  # the kernels' sums do not depend on the thread split: bitwise at both
        pin_threads(threads)
        det += [{"threads": threads, **r} for r in determinism(model, tok, prompts, runs, new)]
        tiny += [{"threads": threads, **r} for r in determinism(tiny_model, tiny_tok, tiny_prompts,
                                                                 4 if quick else 100, 12)]  # fmt: skip
        if threads == 1:  # timings at one thread: on this 2-core VM a second meets whatever else runs
            rows += [{"threads": threads, **r} for r in throughput(model, tok, prompts, 4 if quick else 16, repeats)]
    print(bench.table(det, f"A. {runs} runs under random load on {which}, {new} greedy tokens a request"))
    print(bench.table(tiny, "A. the same on the tiny target"))
    print(bench.table(rows, f"B. throughput, 16 greedy tokens a chat, median of {repeats}"))
    pin_threads(1)
    parts = step_parts(model, tok, prompts, 3 if quick else 7)
    print(bench.table(parts, "C. one decode step and its parts (ms), default vs invariant"))
    prefill = prefill_matmuls(model, 3 if quick else 5)
    print(bench.table([prefill], "C. a 512-token prefill's matmuls (ms, LM head aside)"))
    figures = {
        "model": which,
        "determinism": det,
        "determinism_tiny_target": tiny,
        "step_parts": parts,
        "prefill_matmuls": prefill,
        "invariant_vs_default_at_1": rows[0]["invariant_vs_default"],
        "invariant_vs_default_at_16": rows[-1]["invariant_vs_default"],
        "min_rows": load("stage04_batching.batch_invariant").MIN_ROWS,
        "split": load("stage04_batching.batch_invariant").SPLIT,
        **floors.figures(),
    }
    return bench.Result(rows, figures, _plot(rows, det, tiny, parts, which))


def _plot(rows, det, tiny, parts, which):
    plt = plot.setup()
    fig, (ax_tp, ax_det, ax_parts) = plt.subplots(1, 3, figsize=(16, 4.2))
    x = torch.arange(len(rows)).numpy()
    ax_tp.bar(x - 0.2, [r["default_tok_s"] for r in rows], 0.4, label="default")
    ax_tp.bar(x + 0.2, [r["invariant_tok_s"] for r in rows], 0.4, label="batch invariant")
    ax_tp.set_xticks(x, [f"concurrency {r['concurrency']}" for r in rows])
    ax_tp.set(ylabel="output tokens / s", title=f"{which.split(' (')[0]}, greedy, 1 thread")
    ax_tp.legend()
    labels = [f"{name}, {r['threads']}t\n{r['mode']}" for name, rs in (("SmolLM2", det), ("tiny", tiny)) for r in rs]
    share = [r["requests_differing"] / r["requests"] for rs in (det, tiny) for r in rs]
    ax_det.bar(labels, share, color=["C0", "C1"] * (len(labels) // 2))
    ax_det.tick_params(axis="x", labelsize=7)
    ax_det.set(ylabel="requests whose logprobs differ\nfrom a batch of one", title="under random load")
    x = torch.arange(len(parts)).numpy()
    for i, (key, label) in enumerate([("matmuls_default", "matmuls, default"), ("matmuls_padded", "matmuls, padded"),
                                       ("attention_default", "attention, default"), ("attention_split", "attention, split-KV")]):  # fmt: skip
        ax_parts.bar(x + (i - 1.5) * 0.2, [p[f"{key}_ms"] for p in parts], 0.2, label=label)
    ax_parts.plot(x, [p["floor_ms"] for p in parts], "k--", label="floor: bytes at streaming bandwidth")
    ax_parts.set_xticks(x, [f"decode, batch {p['batch']}" for p in parts])
    ax_parts.set(ylabel="ms", title="one decode step's parts")
    ax_parts.legend(fontsize=8)
    return fig
