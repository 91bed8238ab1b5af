"""A floor is never beaten: no whole-step row of any committed benchmark JSON reads under 1.0x its floor.

A floor (labkit/bench/floors.py) is the least time a step can take on the machine that ran it: its bytes
at the fastest streaming read measured there, or its FLOPs at the measured GEMM rate. A row under it means
the floor was measured wrong (too slow a read, too few threads reading), so every figure quoted against
it is suspect. This reads the JSONs only: nothing is timed here.

Left out, and why: the per-op rows of the decode benchmark's profile (its "profile_1_thread" tables).
They time one op of a step, not a whole step; the tiny model's 26 MB of weights sit partly in the L3
cache, so an op re-reading them beats the DRAM streaming rate without any floor being wrong.
"""

import json

import pytest

from labkit import ROOT

# the committed ones: a --quick run's JSON (git-ignored) times too few repeats to hold anything to
RESULTS = sorted(p for p in (ROOT / "bench_results").glob("*.json") if not p.stem.endswith("_quick"))
PER_OP = ("profile_1_thread",)  # single ops, not whole steps (see above)


def ratios(x, path: str = ""):
    """(where, value) of every number under a key ending in "vs floor", anywhere in the JSON but PER_OP."""
    if isinstance(x, dict):
        for key, value in x.items():
            if key in PER_OP:
                continue
            if key.endswith("vs floor") and isinstance(value, int | float):
                yield f"{path}/{key}", value
            else:
                yield from ratios(value, f"{path}/{key}")
    elif isinstance(x, list):
        for i, value in enumerate(x):
            label = value.get("variant") or value.get("what") if isinstance(value, dict) else None
            yield from ratios(value, f"{path}[{i}{f': {label}' if label else ''}]")


def test_the_ratio_walk_finds_rows_and_skips_the_profile():
    data = {"rows": [{"variant": "a", "vs floor": 0.5}], "x": {"step vs floor": 2.0},
            "profile_1_thread": {"fp32": [{"op": "LM head", "vs floor": 0.9}]}}  # fmt: skip
    assert sorted(v for _, v in ratios(data)) == [0.5, 2.0]


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_no_whole_step_row_beats_its_floor(path):
    below = [(where, value) for where, value in ratios(json.loads(path.read_text())) if value < 1.0]
    assert not below, (
        f"{path.name}: {len(below)} row(s) under 1.0x their floor, e.g. {below[:5]}: the floor was measured "
        "too low (re-run the benchmark with labkit/bench/floors.py's current rates) or the row counts too "
        "few bytes or FLOPs"
    )
