"""Stage 04 part 2 benchmark: what structured output costs per decode step, and what it buys.

    python -m labkit.bench 04b [--quick]     (LABS_IMPL=solution for the answer key)

A. The paged engine on $MODEL (the tiny target) decoding a batch of 1 and of 16 requests: one
   engine step unconstrained, one step where every request is guided by a regex (a JSON string that
   never closes, so no request ends while timed), and mask_logits alone on that batch. Medians of
   interleaved repeats; the mask's share is mask_logits / the unconstrained step.
B. Validity: N sampled generations (temperature 1) of a JSON object for one schema, with and without
   the constraint, validated with `jsonschema`. Also the one-off cost of the schema's token index.
"""

import json
import time

import jsonschema
import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import load

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "pet": {"enum": ["cat", "dog", "owl"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
OPEN_STRING = r'\{"story": "[^"\\]*'  # never complete: every timed step masks every row
PROMPT = "Once upon a time, there was"


def engine_at_decode(model, tok, batch: int, pattern: str | None):
    """An engine whose `batch` requests have all finished prefill, so each step() is one decode step."""
    engine_mod, sequence = load("stage04_batching.engine"), load("stage04_batching.sequence")
    engine = engine_mod.LLMEngine(model, tok, num_blocks=512, max_num_seqs=batch)
    for i in range(batch):
        params = sequence.SamplingParams(max_tokens=400, temperature=1.0, seed=i, ignore_eos=True, guided_regex=pattern)
        engine.add_request(PROMPT, params)
    while any(s.num_computed_tokens < s.num_tokens - 1 or not s.output_token_ids for s in engine.requests.values()):
        engine.step()
    return engine


def step_costs(model, tok, repeats: int) -> list[dict]:
    structured = load("stage04_batching.structured")
    rows = []
    for batch in (1, 16):
        free = engine_at_decode(model, tok, batch, None)
        guided = engine_at_decode(model, tok, batch, OPEN_STRING)
        guides = [s.guide for s in guided.requests.values()]
        logits = torch.randn(batch, model.config.vocab_size)
        t = bench.interleaved(
            {"free": free.step, "guided": guided.step, "mask": lambda g=guides, x=logits: structured.mask_logits(x, g)},
            repeats=repeats,
            warmup=2,
        )
        # floors: a step reads the weights once and each request's cache (the prompt's K/V at least); the mask
        # reads the logits and a bool mask and writes the logits, 9 bytes per (request, token)
        step_bytes = floors.decode_bytes(model, len(tok.encode(PROMPT).ids), batch)
        mask_bytes = 9 * batch * model.config.vocab_size
        rows.append(
            {
                "batch": batch,
                "step_ms": round(t["free"].median * 1e3, 3),
                "guided_step_ms": round(t["guided"].median * 1e3, 3),
                "mask_ms": round(t["mask"].median * 1e3, 4),
                "mask_pct_of_step": round(100 * t["mask"].median / t["free"].median, 2),
                "guided_overhead_pct": round(100 * (t["guided"].median / t["free"].median - 1), 1),
                **floors.row(t["free"].median, bytes=step_bytes, name="step"),
                **floors.row(t["guided"].median, bytes=step_bytes + mask_bytes, name="guided_step"),
                **floors.row(t["mask"].median, bytes=mask_bytes, name="mask"),
            }
        )
    return rows


def validity(model, tok, n: int) -> dict:
    engine_mod, sequence, structured = (load(f"stage04_batching.{m}") for m in ("engine", "sequence", "structured"))
    engine = engine_mod.LLMEngine(model, tok, num_blocks=512, max_num_seqs=16)
    pattern = structured.schema_to_regex(SCHEMA)
    t0 = time.perf_counter()
    engine.token_index(pattern)
    index_s = time.perf_counter() - t0
    out = {"index_build_s": round(index_s, 2), "n": n}
    prompt = 'A pet owner, as JSON: {"name": "'
    for label, guided in (("unconstrained", None), ("constrained", pattern)):
        params = [
            sequence.SamplingParams(max_tokens=96, temperature=1.0, seed=i, guided_regex=guided) for i in range(n)
        ]
        valid = 0
        for o in engine.generate([prompt] * n, params):
            try:
                jsonschema.validate(json.loads(o.text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        out[f"{label}_valid_pct"] = round(100 * valid / n, 1)
        if guided:
            out["example"] = o.text
    return out


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)
    model, label = bench.model()
    tok = bench.tokenizer()
    repeats, n = (5, 8) if quick else (21, 32)
    rows = step_costs(model, tok, repeats)
    print(bench.table(rows, title=f"stage 04b: one decode step of {label}, median of {repeats}"))
    valid = validity(model, tok, n)
    print(json.dumps(valid, indent=2, ensure_ascii=False))
    plt = plot.setup()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = torch.arange(len(rows)).numpy()
    ax1.bar(x - 0.27, [r["step_ms"] for r in rows], 0.27, label="decode step")
    ax1.bar(x, [r["guided_step_ms"] for r in rows], 0.27, label="guided decode step")
    ax1.bar(x + 0.27, [r["mask_ms"] for r in rows], 0.27, label="mask_logits")
    ax1.set_xticks(x, [f"batch {r['batch']}" for r in rows])
    ax1.set(ylabel="ms", title="cost of masking per step")
    ax1.legend()
    ax2.bar(["unconstrained", "constrained"], [valid["unconstrained_valid_pct"], valid["constrained_valid_pct"]])
    ax2.set(ylabel="% schema-valid", ylim=(0, 105), title=f"{n} samples at temperature 1")
    return bench.Result(
        rows,
        {
            "model": label,
            "repeats": repeats,
            "validity": valid,
        },
        fig,
    )
