"""The figures a handout quotes under "What you should see" from shipped artefacts (a trained head's report in
labkit/assets, a benchmark's JSON in bench_results) are the artefacts' own: a retrained head or a re-run
benchmark that moves them fails here until the text follows. Figures a learner's own run prints are not
shipped and are not checked here."""

import json
import re

import pytest

from labkit import ROOT

EAGLE = ROOT / "labkit" / "assets" / "smollm2-eagle" / "config.json"
MEDUSA = ROOT / "labkit" / "assets" / "smollm2-medusa" / "config.json"
EAGLE_BENCH = ROOT / "bench_results" / "stage06b_eagle.json"


def handout(path: str) -> str:
    """The text of a notebook's markdown cells, soft line breaks as spaces."""
    cells = json.loads((ROOT / path).read_text())["cells"]
    text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.sub(r"(?<!\n)\n(?!\n)", " ", text)


def agrees(figure: str, value: float, scale: float = 1.0) -> bool:
    """A figure as printed ("0.71", "4,204,224") is value * scale rounded to the digits it shows."""
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    return abs(float(figure.replace(",", "")) - value * scale) <= 0.5 * 10**-decimals + 1e-9


def quoted(text: str, pattern: str) -> re.Match:
    m = re.search(pattern, text)
    assert m, f"the handout no longer says /{pattern}/: update this test with it"
    return m


def test_stage06_lab4_quotes_the_shipped_eagle_head():
    text, report = handout("stage06_speculative/lab4.ipynb"), json.loads(EAGLE.read_text())
    params = quoted(text, r"about 4 M trained weights \(([\d,]+)\)")
    assert agrees(params[1], report["params"]), f"the head has {report['params']:,} weights"
    m = quoted(text, r"acceptance per draft position is ([\d.]+), ([\d.]+), ([\d.]+), ([\d.]+)")
    shipped = report["heldout"]["acceptance_per_position"]
    assert all(map(agrees, m.groups(), shipped)), f"the report says {shipped}"
    product = 1.0
    for a in report["heldout"]["acceptance_per_position"]:
        product *= a
    m = quoted(text, r"all four are right is the product, about (\d+\.\d+)")
    assert agrees(m[1], product), f"the product is {product:.3f}"
    m = quoted(text, r"covers most held-out tokens \((\d+) % here")
    assert agrees(m[1], report["vocab_coverage_heldout"], 100), f"coverage {report['vocab_coverage_heldout']}"


def test_stage06_lab4_says_eagle_beats_medusa_at_every_position_and_it_does():
    text = handout("stage06_speculative/lab4.ipynb")
    quoted(text, r"EAGLE's acceptance above Medusa's at every draft position")
    eagle = json.loads(EAGLE.read_text())["heldout"]["acceptance_per_position"]
    medusa = json.loads(MEDUSA.read_text())["heldout"]["acceptance_per_position"]
    assert all(e > m for e, m in zip(eagle, medusa, strict=True)), f"EAGLE {eagle}, Medusa {medusa}"


@pytest.mark.skipif(not EAGLE_BENCH.is_file(), reason="the learner edition may ship without bench_results")
def test_stage06_lab4_quotes_the_last_eagle_benchmark():
    text, bench = handout("stage06_speculative/lab4.ipynb"), json.loads(EAGLE_BENCH.read_text())
    rows = {r["decoder"]: r for r in bench["rows"]}
    k4, k2 = rows["EAGLE, k=4"], rows["EAGLE, k=2"]
    m = quoted(text, r"\$\\bar n\$ = ([\d.]+) at k = 4 \(drafts 1–4: (\d+)/(\d+)/(\d+)/(\d+) %\)")
    assert agrees(m[1], k4["accepted_per_verify"]), f"the benchmark: {k4['accepted_per_verify']}"
    drafts = k4["acceptance_per_position"]
    assert all(agrees(x, a, 100) for x, a in zip(m.groups()[1:], drafts, strict=True)), f"the benchmark: {drafts}"
    costs = bench["costs_in_compiled_target_steps"]
    m = quoted(
        text,
        r"\$c\$ = ([\d.]+), \$v\$ = ([\d.]+) with the verification compiled \(`labkit/fast_verify.py`; ([\d.]+) eager\)",
    )
    want = [costs["draft step, EAGLE"], costs["verify 5 tokens, compiled"], costs["verify 5 tokens, eager"]]
    assert all(map(agrees, m.groups(), want)), f"the benchmark's costs: {costs}"
    m = quoted(text, r"\*\*([\d.]+)×\*\* the compiled plain decode \(([\d.]+) ms a step\) at k = 4, ([\d.]+)× at k = 2")
    want = [k4["speedup"], 1e3 * bench["target_step_compiled_s"], k2["speedup"]]
    assert all(map(agrees, m.groups(), want)), f"the benchmark: {want}"
    m = quoted(text, r"at concurrency 1, where both sides run eager, the same head gives ([\d.]+)×")
    engine = next(e for e in bench["engine"] if e["concurrency"] == 1)
    assert agrees(m[1], engine["fixed_speedup"]), f"the benchmark: {engine['fixed_speedup']}"
