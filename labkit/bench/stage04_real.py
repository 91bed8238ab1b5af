"""Stage 04 on the real model (SmolLM2-135M-Instruct, `make setup`): the engine, the prefix cache and
structured output on a 49,152-token vocabulary.

    make bench STAGE=04_real [QUICK=1]     (IMPL=student times your own engine)

A. Throughput: 8 chats in the checkpoint's chat template, all arriving at once, greedy, a fixed number
   of output tokens (EOS ignored, as serving benchmarks do). The engine with max_num_seqs 1, 4 and 8
   against the same chats one after another on labkit's contiguous cache (baselines.sequential),
   interleaved, medians of repeats; every variant must give the same tokens.
B. Time to first token with a shared system prompt of ~500 tokens (a few of the course's stories):
   chats one after another, each its own question, prefix cache on vs off (the first chat fills it).
C. Structured output: a decode step with every row guided (the rows it reads memoized) against a free
   one, and mask_logits alone (stage04b's step_costs, on SmolLM2); then what a client meets cold: a
   JSON-schema answer from a fresh token index, whose rows are computed as the answer reaches its DFA
   states, against the same number of free tokens.
"""

import statistics
import time

import torch

from labkit import bench, corpus, plot
from labkit.bench import floors
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.impl import load
from labkit.model import from_pretrained

from .stage04 import workload_floor
from .stage04b import step_costs

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What does a CPU do?",
    "Tell me a fun fact about owls.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
}


def chat(question: str, system: str | None = None) -> str:
    """A one-turn chat in SmolLM2's template (the text the server renders from tokenizer_config.json)."""
    system = system or "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def throughput(model, tok, new: int, repeats: int) -> tuple[list[dict], dict]:
    engine_mod, sequence = load("stage04_batching.engine"), load("stage04_batching.sequence")
    baselines = load("stage04_batching.baselines")
    prompts = [tok.encode(chat(q)).ids for q in QUESTIONS]
    params = [sequence.SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)] * len(prompts)

    def engine(c):
        def run():
            outs = engine_mod.LLMEngine(model, tok, num_blocks=128, max_num_seqs=c).generate(prompts, params)
            return [o.token_ids for o in outs]

        return run

    variants = {
        "one after another": lambda: [r.token_ids for r in baselines.sequential(model, prompts, [new] * len(prompts))],
        "engine, 1 at a time": engine(1),
        "engine, 4 concurrent": engine(4),
        "engine, 8 concurrent": engine(8),
    }
    engine(2)()  # warm-up, untimed
    times = bench.interleaved(variants, repeats, warmup=0)
    tokens = times["one after another"].last
    for name, t in times.items():
        if t.last != tokens:
            raise AssertionError(f"{name}: the tokens differ from one-after-another greedy decoding")
    total = new * len(prompts)
    base = times["one after another"].median
    batch = {"one after another": 1, "engine, 1 at a time": 1, "engine, 4 concurrent": 4, "engine, 8 concurrent": 8}
    rows = [{"variant": name, "seconds": t.median, "tokens_per_s": total / t.median, "speedup": base / t.median,
             **floors.row(t.median, **workload_floor(model, prompts, [new] * len(prompts), batch[name]))}
            for name, t in times.items()]  # fmt: skip
    figures = {"chats": len(prompts), "new_tokens": new, "prompt_tokens": [len(p) for p in prompts]}
    return rows, figures


def prefix_ttft(model, tok, n: int) -> list[dict]:
    engine_mod, sequence = load("stage04_batching.engine"), load("stage04_batching.sequence")
    system = "Answer questions about these stories.\n\n" + "\n\n".join(corpus.stories(4, 4))
    prompts = [tok.encode(chat(q, system)).ids for q in QUESTIONS[: n + 1]]
    params = sequence.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    rows, answers = [], []
    for on in (False, True):
        engine = engine_mod.LLMEngine(model, tok, num_blocks=128, enable_prefix_caching=on)
        outs = [engine.generate([p], [params])[0] for p in prompts]
        answers.append([o.token_ids for o in outs])
        ttft = [o.first_token_time - o.arrival_time for o in outs[1:]]  # the first chat fills the cache
        rows.append({"prefix_cache": "on" if on else "off", "ttft_p50_ms": statistics.median(ttft) * 1e3,
                     "cached_tokens_p50": statistics.median(o.num_cached_tokens for o in outs[1:])})  # fmt: skip
    if answers[0] != answers[1]:
        raise AssertionError("the prefix cache changed the greedy tokens")
    rows[0]["ttft_speedup"], rows[1]["ttft_speedup"] = 1.0, rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"]
    for r in rows:
        r["prompt_tokens_p50"] = statistics.median(len(p) for p in prompts[1:])
        # floor: the FLOPs of the prompt's uncached tokens (after the cached prefix) at the GEMM rate
        n, cached = int(r["prompt_tokens_p50"]), int(r["cached_tokens_p50"])
        r |= floors.row(
            r["ttft_p50_ms"] / 1e3, flops=floors.forward_flops(model, n - cached, cached, logits=1), name="ttft"
        )
    return rows


def cold_json(model, tok) -> dict:
    """One JSON answer guided by a fresh token index against as many free tokens, per output token."""
    engine_mod, sequence = load("stage04_batching.engine"), load("stage04_batching.sequence")
    structured = load("stage04_batching.structured")
    prompt = chat("What is the capital of France? Answer in JSON with the keys city, country and is_capital.")
    engine = engine_mod.LLMEngine(model, tok, num_blocks=128)
    t0 = time.perf_counter()
    engine.vocab_trie()  # once per engine: the vocabulary's bytes as a trie
    trie_s = time.perf_counter() - t0
    pattern = structured.schema_to_regex(SCHEMA)
    t0 = time.perf_counter()
    guided = engine.generate([prompt], [sequence.SamplingParams(max_tokens=60, temperature=0, guided_regex=pattern)])[0]
    guided_s = time.perf_counter() - t0
    n = len(guided.token_ids)
    t0 = time.perf_counter()
    engine.generate([prompt], [sequence.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)])
    free_s = time.perf_counter() - t0
    return {"vocab_trie_s": trie_s, "tokens": n, "rows_computed": len(engine.token_index(pattern).rows),
            "guided_ms_per_token": guided_s / n * 1e3, "free_ms_per_token": free_s / n * 1e3,
            "answer": guided.text}  # fmt: skip


@torch.inference_mode()
def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # as every benchmark: one thread, so other work on a 2-core machine disturbs it least
    folder = require_real_model()
    model, tok = from_pretrained(folder).eval(), load_tokenizer(folder)
    which = f"{folder.name} ({model.num_params() / 1e6:.1f}M params)"
    new, repeats = (8, 1) if quick else (24, 3)
    rows, figures = throughput(model, tok, new, repeats)
    print(bench.table(rows, f"A. {len(QUESTIONS)} chats x {new} greedy tokens on {which}, median of {repeats}"))
    prefix = prefix_ttft(model, tok, 3 if quick else 7)
    print(bench.table(prefix, "B. time to first token with a shared system prompt"))
    steps = step_costs(model, tok, 3 if quick else 11)
    print(bench.table(steps, "C. one decode step, free vs every row guided (memoized rows)"))
    cold = cold_json(model, tok)
    print(bench.table([{k: v for k, v in cold.items() if k != "answer"}], f"C. a cold JSON answer: {cold['answer']}"))
    by = {r["variant"]: r for r in rows}
    figures |= {
        "model": which,
        "repeats": repeats,
        "batched_vs_one_after_another_at_4": by["engine, 4 concurrent"]["speedup"],
        "batched_vs_one_after_another_at_8": by["engine, 8 concurrent"]["speedup"],
        "prefix_cache": prefix,
        "structured_steps": steps,
        "structured_cold": cold,
    }
    return bench.Result(rows, figures, _plot(rows, prefix, steps, cold, which))


def _plot(rows, prefix, steps, cold, which):
    plt = plot.setup()
    fig, (ax, ax_ttft, ax_mask) = plt.subplots(1, 3, figsize=(16, 4.2))
    ax.barh([r["variant"] for r in rows], [r["tokens_per_s"] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="output tokens / s", title=f"{which.split(' (')[0]}: 8 chats, greedy, 1 thread")
    ax_ttft.bar([f"prefix cache {r['prefix_cache']}" for r in prefix], [r["ttft_p50_ms"] for r in prefix])
    ax_ttft.set(
        ylabel="median TTFT (ms)", title=f"a shared system prompt (~{prefix[0]['prompt_tokens_p50']:.0f} tokens)"
    )
    labels = [f"decode step\nbatch {s['batch']}" for s in steps] + ["JSON answer, cold\n(per token)"]
    free = [s["step_ms"] for s in steps] + [cold["free_ms_per_token"]]
    guided = [s["guided_step_ms"] for s in steps] + [cold["guided_ms_per_token"]]
    x = torch.arange(len(labels)).numpy()
    ax_mask.bar(x - 0.2, free, 0.4, label="free")
    ax_mask.bar(x + 0.2, guided, 0.4, label="guided")
    ax_mask.set_xticks(x, labels)
    ax_mask.set(ylabel="ms", title="structured output, 49,152-token vocabulary")
    ax_mask.legend()
    return fig
