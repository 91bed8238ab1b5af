"""Stage 07 part 2 benchmark: the radix prefix cache against the hash chain and no cache, in one replica.

    make bench STAGE=07b_radix            (LABS_IMPL=solution; IMPL=student runs your RadixCache)

The workload is a chat service's: every session starts with the same system prompt, and each turn
sends the whole conversation so far (system prompt, earlier questions and answers) plus a new
question. Sessions run side by side, each sending its next turn when the previous answer is done
(closed loop). Token ids come from the held-out stories, tokenized for $MODEL (the tiny target).

Four engines serve the same workload, timed interleaved in one run (medians of repeats): radix at
page 1 (hits at token granularity), radix at page 16, the hash chain at block 16, and no cache.
Every engine must emit the same greedy tokens. Figures: hit rate (prompt tokens served from the
cache), prefill tokens the engine computed, and the median time to first token over all requests,
measured from add_request to the step that emits the token (queueing included).
"""

import statistics
import time

from labkit import bench, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import current, load
from labkit.quality import heldout

VARIANTS = {"radix, page 1": ("radix", 1), "radix, page 16": ("radix", 16), "hash chain, block 16": ("hash", 16),
            "no cache": ("none", 16)}  # fmt: skip


def chat_workload(tokens: list[int], sessions: int, turns: int, system: int, question: int):
    """(system prompt, questions[session][turn]): consecutive slices of `tokens`."""
    need = system + sessions * turns * question
    if len(tokens) < need:
        raise ValueError(f"the workload needs {need} tokens, got {len(tokens)}")
    it = iter(tokens[system:])
    return tokens[:system], [[[next(it) for _ in range(question)] for _ in range(turns)] for _ in range(sessions)]


def serve_chats(model, prefix_cache: str, page_size: int, system_prompt, questions, answer: int, **engine):
    """Run every session's turns through one ReplicaEngine, closed loop. Returns (stats, TTFTs in
    seconds, {request id: tokens})."""
    mod = load("stage07_tensor_parallel.fleet.replica_engine")
    eng = mod.ReplicaEngine(model, page_size=page_size, prefix_cache=prefix_cache, **engine)
    history = {s: list(system_prompt) for s in range(len(questions))}
    turn, sent, ttft, out = dict.fromkeys(history, 0), {}, [], {}

    def submit(s):
        rid = f"{s}-{turn[s]}"
        prompt = history[s] + questions[s][turn[s]]
        eng.add_request(mod.EngineRequest(rid, prompt, answer))
        history[s], sent[rid], out[rid] = prompt, time.perf_counter(), []

    for s in history:
        submit(s)
    while eng.has_work():
        for o in eng.step():
            if not out[o.request_id]:
                ttft.append(time.perf_counter() - sent[o.request_id])
            out[o.request_id].append(o.token_id)
            if o.finished:
                s = int(o.request_id.split("-")[0])
                history[s] += out[o.request_id]
                turn[s] += 1
                if turn[s] < len(questions[s]):
                    submit(s)
    return eng.stats, ttft, out


def cache_rows(model, t: dict, ttfts: dict, answers: int, prompt: int, max_num_seqs: int) -> list[dict]:
    """A row an engine: hit rate, prompt tokens computed, median TTFT and wall time with their floors; every
    engine's greedy tokens must equal the engine's without a cache. `answers`: the answer tokens of the run;
    `prompt`: the shortest prompt (system prompt and question)."""
    reference = t["no cache"].last[1]
    rows = []
    for name, timing in t.items():
        stats, out = timing.last
        if out != reference:
            raise AssertionError(f"{name}: the engine's greedy tokens differ from the engine without a cache")
        # floors of the model work each figure contains (queueing and Python are above them): a TTFT, what a
        # request whose prompt is all cached still does, one step reading the weights and the shortest prompt's
        # K/V; the whole run, every computed prompt token and answer token through the matrices (attention to
        # one key each, a lower bound) at the GEMM rate, or the weights read once per decode step of up to
        # max_num_seqs answers, whichever is slower
        ttft_floor = floors.row(
            statistics.median(ttfts[name][1:]), bytes=floors.decode_bytes(model, prompt), name="ttft"
        )
        wall_floor = floors.row(
            timing.median,
            bytes=answers / max_num_seqs * floors.weight_bytes(model),
            flops=stats["prefill_tokens_computed"] * floors.forward_flops(model, 1, logits=0)
            + answers * floors.forward_flops(model, 1),  # the LM head only where a token is sampled
            name="wall",
        )
        rows.append({
            "engine": name,
            "hit_rate": stats["cached_tokens"] / stats["prompt_tokens"],
            "prompt_tokens": stats["prompt_tokens"],
            "prefill_tokens_computed": stats["prefill_tokens_computed"],
            "median_ttft_ms": statistics.median(ttfts[name][1:]) * 1e3,  # the timed runs (the first was warm-up)
            "wall_s": timing.median, **ttft_floor, **wall_floor,
        })  # fmt: skip
    return rows


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # one thread, as every stage's benchmark: a shared 2-core machine
    sessions, turns, system, question, answer, repeats = (4, 3, 192, 24, 8, 1) if quick else (8, 4, 256, 24, 16, 3)
    model, which = bench.model()
    tokens = heldout(bench.tokenizer(), n_tokens=8192, seq=512).flatten().tolist()
    system_prompt, questions = chat_workload(tokens, sessions, turns, system, question)
    engine = dict(num_slots=8192, max_num_seqs=8, max_num_batched_tokens=512)
    ttfts: dict[str, list[float]] = {name: [] for name in VARIANTS}

    def variant(name):
        stats, ttft, out = serve_chats(model, *VARIANTS[name], system_prompt, questions, answer, **engine)
        ttfts[name].append(statistics.median(ttft))
        return stats, out

    t = bench.interleaved({name: lambda n=name: variant(n) for name in VARIANTS}, repeats, warmup=1)
    rows = cache_rows(model, t, ttfts, sessions * turns * answer, system + question, engine["max_num_seqs"])
    by = {r["engine"]: r for r in rows}
    radix, hashed, none = by["radix, page 1"], by["hash chain, block 16"], by["no cache"]
    title = (
        f"stage 07b: prefix caches in one replica, {which}, {sessions} chat sessions x {turns} turns, {system}-token "
        f"system prompt, {question}-token questions, {answer}-token answers, impl={current()}, median of {repeats}"
    )
    bench.show(rows, title)
    figures = {
        "model": which, "sessions": sessions, "turns": turns, "system_tokens": system, "question_tokens": question,
        "answer_tokens": answer, "repeats": repeats, "engine": engine,
        "prefill_none_over_radix": none["prefill_tokens_computed"] / radix["prefill_tokens_computed"],
        "prefill_hash16_over_radix1": hashed["prefill_tokens_computed"] / radix["prefill_tokens_computed"],
        "ttft_none_over_radix": none["median_ttft_ms"] / radix["median_ttft_ms"],
        "ttft_hash16_over_radix1": hashed["median_ttft_ms"] / radix["median_ttft_ms"],
    }  # fmt: skip
    bench.show_figures(figures, [k for k in figures if k.startswith(("prefill_", "ttft_"))])
    return bench.Result(rows, figures, plot_caches(rows))


def plot_caches(rows: list[dict]):
    """Hit rate, prefill tokens computed and median TTFT per engine."""
    plt = plot.setup()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = [r["engine"] for r in rows]
    for ax, key, label in zip(
        axes,
        ("hit_rate", "prefill_tokens_computed", "median_ttft_ms"),
        ("prompt tokens served from the cache", "prefill tokens computed", "median time to first token (ms)"),
        strict=True,
    ):
        ax.barh(names, [r[key] for r in rows])
        ax.set(xlabel=label)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticks([])
    fig.tight_layout()
    return fig
