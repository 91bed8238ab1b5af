"""The speed figures the stage READMEs and MODELS.md quote from the serving and 4-bit benchmarks are those
benchmarks' JSONs' own (bench_results/serve.json, decode_q4_0.json): a re-run that moves them fails here until the
text follows. test_handout_figures.py does the same for the notebooks."""

import json
import re

from labkit import ROOT


def bench(name: str) -> dict:
    return json.loads((ROOT / "bench_results" / f"{name}.json").read_text())


def text(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def agrees(figure: str, value: float) -> bool:
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    return abs(float(figure) - value) <= 0.5 * 10**-decimals + 1e-9


def test_stage04_readme_quotes_the_serve_table():
    """Each server's tokens/s at 1, 4 and 8 chats and its one-chat TTFT, row by row."""
    rows, readme = bench("serve")["rows"], text("stage04_batching/README.md")
    names = {"`make serve` float32": "make serve (none)", "`make serve --threads 1` float32": "make serve (none, --threads 1)",
             "`make serve --quantization q8_0`": "make serve (q8_0)", "`make serve --quantization q4_0`": "make serve (q4_0)",
             "`llama-server` F32 (native build, `-np 8 -t 2 -fa on`)": "llama-server F32",
             "`llama-server` Q8_0": "llama-server Q8_0", "`llama-server` Q4_0": "llama-server Q4_0"}  # fmt: skip
    for label, server in names.items():
        m = re.search(re.escape(f"| {label} |") + r" ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) ms \|", readme)
        assert m, f"the README's serve table has no row {label!r}"
        got = {r["chats"]: r for r in rows if r["server"] == server}
        for figure, chats in zip(m.groups()[:3], (1, 4, 8), strict=True):
            assert agrees(figure, got[chats]["tokens/s"]), f"{label} at {chats}: the JSON says {got[chats]['tokens/s']}"
        assert agrees(m[4], got[1]["TTFT p50 ms"]), f"{label} TTFT: the JSON says {got[1]['TTFT p50 ms']}"


def test_stage04_readme_quotes_the_step_breakdown():
    """The in-process one-chat step with the layers as modules and fused, and its floor."""
    data, readme = bench("serve"), text("stage04_batching/README.md")
    steps = {(r["quantization"], r["layers"]): r for r in data["step_breakdown"]
             if r["chats"] == 1 and r["kernels"] == "cpp" and r.get("threads", data["threads"]) == data["threads"]}  # fmt: skip
    for label, q in (("float32", "none"), ("q8_0", "q8_0")):
        m = re.search(rf"\| {label} \| ([\d.]+) ms \| \*\*([\d.]+) ms\*\* \| ([\d.]+) ms \|", readme)
        assert m, f"the README's step table has no {label} row"
        want = steps[(q, "modules")]["step ms"], steps[(q, "fused")]["step ms"], steps[(q, "fused")]["floor ms"]
        assert all(map(agrees, m.groups(), want)), f"{label}: the JSON says {want}"


def test_models_quotes_the_q4_0_step_against_llama_cpp():
    rows, models = bench("decode_q4_0")["rows"], text("MODELS.md")
    m = re.search(
        r"([\d.]+) ms against Q4_0's ([\d.]+) at context 128 \(([\d.]+)×\) and ([\d.]+) against ([\d.]+) at 512 \(([\d.]+)×\)",
        models,
    )
    assert m, "MODELS.md no longer quotes the course's Q4_0 step against llama.cpp's"
    ms = {(r["variant"], r["context"]): r for r in rows}
    for ctx, (ours, theirs, ratio) in ((128, m.groups()[:3]), (512, m.groups()[3:])):
        course, cpp = ms[("StaticDecoder, compiled, cpp q4_0", ctx)], ms[("llama.cpp Q4_0", ctx)]
        assert agrees(ours, course["ms"]) and agrees(theirs, cpp["ms"]), f"context {ctx}: {course['ms']}, {cpp['ms']}"
        assert agrees(ratio, course["vs llama.cpp same precision"]), f"context {ctx}: the JSON's ratio differs"
