"""Stage 04 part 2: what a constraint costs when its masks are computed lazily, and whether it stalls others.

    python -m labkit.bench 04b_constraints [--quick]     (LABS_IMPL=solution for the answer key)

A. For the tiny target's vocabulary and SmolLM2's (the largest the course ships; skipped if `make setup`
   has not converted it), two patterns: `[ -~]*a[ -~]{10}` (about 2,048 DFA states) and a JSON Schema's
   regex. Compile (regex -> DFA) time; the vocabulary trie's one-off build; the mask cost per generated
   token of a sequence walking random allowed tokens, cold (each new state's row computed on the way)
   and warm (a second sequence over the same states, rows memoized); and what computing every row
   up front (the eager index this replaces) would cost: measured in full on the tiny vocabulary,
   estimated from a sample of states on SmolLM2's.
B. The server on the tiny target: a plain 8-token streaming request's time to first token idle and
   while three clients' ~2,048-state patterns compile, and the slowest /health meanwhile (medians).

The libraries a user would pick instead (llguidance, XGrammar) are measured beside the course's masks, in
one run on SmolLM2's vocabulary, by `python -m labkit.bench 04b_guided`; this benchmark is about the lazy
index itself (what each row costs when first reached, and what the eager index it replaces would cost).
"""

import random
import statistics
import threading
import time

from labkit import bench, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import load

HEAVY = "[ -~]*a[ -~]{10}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PROMPT = "Once upon a time, there was"


def walk(index, structured, tokens: int, seed: int) -> list[float]:
    """Seconds per token of a guide that takes `tokens` random allowed tokens (never EOS)."""
    rng = random.Random(seed)
    guide = structured.Guide(index)
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        allowed = guide.allowed()
        times.append(time.perf_counter() - start)
        choices = [t for t in allowed.nonzero().flatten().tolist() if t != index.eos_token_id]
        if not choices:
            break
        guide.advance(rng.choice(choices))
    return times


def vocab_rows(name: str, tok, vocab_size: int, eos: int, tokens: int, eager_sample: int | None) -> list[dict]:
    byte_dfa, structured = load("stage04_batching.byte_dfa"), load("stage04_batching.structured")
    start = time.perf_counter()
    trie = structured.token_trie(structured.token_bytes(tok, vocab_size))
    trie_s = time.perf_counter() - start
    rows = []
    for label, pattern in (("printable, 'a', 10 more", HEAVY), ("JSON schema", structured.schema_to_regex(SCHEMA))):
        compiles = []
        for _ in range(3):
            start = time.perf_counter()
            dfa = byte_dfa.compile_regex(pattern)
            compiles.append(time.perf_counter() - start)
        index = structured.TokenIndex(dfa, trie, vocab_size, eos)
        cold = walk(index, structured, tokens, seed=0)
        warm = walk(index, structured, tokens, seed=0)
        everything = range(dfa.num_states)
        states = everything if eager_sample is None else random.Random(1).sample(everything, eager_sample)
        start = time.perf_counter()
        for s in states:
            structured.state_mask(dfa, trie, s, vocab_size, eos)
        eager_s = (time.perf_counter() - start) / len(states) * dfa.num_states
        # the floor of a cold token: the rows' bytes (a bool mask + a 2-byte next state per token) written
        # once, shared over the walk (in us: floors.row's ms would round it to 0); a warm token returns a
        # memoized row by reference, with no bytes to move
        cold_floor = floors.floor_s(bytes=len(index.rows) * 3 * vocab_size / len(cold))
        rows.append(
            {
                "vocab": f"{name} ({vocab_size})",
                "pattern": label,
                "dfa_states": dfa.num_states,
                "compile_s": round(statistics.median(compiles), 3),
                "trie_build_s": round(trie_s, 3),
                "tokens": len(cold),
                "rows_computed": len(index.rows),
                "cold_us_per_token": round(statistics.mean(cold) * 1e6),
                "cold_floor_us": round(cold_floor * 1e6, 2),
                "cold_vs_floor": round(statistics.mean(cold) / cold_floor),
                "warm_us_per_token": round(statistics.mean(warm) * 1e6, 1),
                "row_kb": round(3 * vocab_size / 1024, 1),
                "eager_index_s": round(eager_s, 1),
                "eager_index_mb": round(3 * vocab_size * dfa.num_states / 2**20, 1),
                "eager_measured": "all states"
                if eager_sample is None
                else f"estimated from {len(states)} random states",
            }
        )
    return rows


def ttft(url: str) -> float:
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError(f"no chunk: {r.status_code}")


def server_figures(model, tok, rounds: int) -> dict:
    import httpx

    from labkit.serving import serving

    api, engine_mod = load("stage04_batching.api_server"), load("stage04_batching.engine")
    idle, busy, health, totals = [], [], [], []
    for r in range(rounds):
        engine = engine_mod.LLMEngine(model, tok, num_blocks=256, max_num_seqs=8)
        with serving(api.create_app(engine, tok), timeout=60) as url:
            for _ in range(2):
                ttft(url)
            idle.append(statistics.median(ttft(url) for _ in range(5)))
            done = []

            def constrained(pattern: str, done: list = done) -> None:
                start = time.perf_counter()
                body = {"prompt": PROMPT, "max_tokens": 14, "temperature": 1.0, "seed": 0, "guided_regex": pattern}
                code = httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code
                done.append((code, time.perf_counter() - start))

            # a different letter each round and client, so no compile is cached
            letters = "xyz" if r % 2 == 0 else "uvw"
            threads = [threading.Thread(target=constrained, args=(f"[ -~]*{c}[ -~]{{10}}",)) for c in letters]
            for t in threads:
                t.start()
            time.sleep(0.05)
            busy.append(statistics.median(ttft(url) for _ in range(3)))
            start = time.perf_counter()
            httpx.get(f"{url}/health", timeout=60)
            health.append(time.perf_counter() - start)
            for t in threads:
                t.join()
            totals.append(max(s for _, s in done))
            assert all(code == 200 for code, _ in done), done
    # floor of a TTFT: the prompt's prefill FLOPs or one read of the weights, the larger
    prefill = dict(
        bytes=floors.weight_bytes(model), flops=floors.forward_flops(model, len(tok.encode(PROMPT).ids), logits=1)
    )
    return {
        "rounds": rounds,
        "ttft_idle_s": round(statistics.median(idle), 3),
        "ttft_during_compiles_s": round(statistics.median(busy), 3),
        **floors.row(statistics.median(idle), **prefill, name="ttft_idle"),
        **floors.row(statistics.median(busy), **prefill, name="ttft_during_compiles"),
        "ttft_ratio": round(statistics.median(b / i for b, i in zip(busy, idle, strict=True)), 2),
        "health_during_compiles_s": round(statistics.median(health), 3),
        "slowest_constrained_request_s": round(statistics.median(totals), 2),
    }


def main(quick: bool = False) -> bench.Result:
    from labkit.checkpoint import load_tokenizer, real_model_folder

    pin_threads(1)
    model, label = bench.model()
    tok = bench.tokenizer()
    tokens = 32 if quick else 128
    rows = vocab_rows("tiny target", tok, model.config.vocab_size, model.config.eos_token_id, tokens, None)
    real = real_model_folder()
    if (real / "tokenizer.json").is_file():
        import json

        config = json.loads((real / "config.json").read_text())
        rows += vocab_rows(
            "SmolLM2",
            load_tokenizer(real),
            config["vocab_size"],
            config["eos_token_id"],
            tokens // 2,
            8 if quick else 16,
        )
    print(bench.table(rows, title="stage 04b: lazy token-index rows, per generated token"))
    server = server_figures(model, tok, 1 if quick else 3)
    print(server)
    plt = plot.setup()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [f"{r['vocab']}\n{r['pattern']}" for r in rows]
    ax.bar(names, [r["cold_us_per_token"] for r in rows], label="cold (rows computed on the way)")
    ax.bar(names, [r["warm_us_per_token"] for r in rows], label="warm (rows memoized)")
    ax.set(ylabel="us per generated token", yscale="log", title="mask cost per generated token")
    ax.legend(fontsize=8)
    return bench.Result(
        rows,
        {
            "model": label,
            "tokens_per_walk": tokens,
            "server": server,
        },
        fig,
    )
