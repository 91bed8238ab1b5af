"""`make test`: every graded test against the solutions, then the course's guarantees.

For each built stage, in order:
  1. tests/stageNN against the reference solution   (guarantee 1: all pass)
  2. tests/meta for that stage                       (2: every test fails on the skeleton,
                                                      3: same public API, 4: notebook runs clean)
then tests/meta for labkit itself. Prints a per-stage timing table; exit 1 if anything failed.
"""

import sys
import time

from . import ROOT, STAGES, triton_interpret
from .junit import Run, run_pytest


def main() -> int:
    env = {"TRITON_INTERPRET": triton_interpret()}
    built = [(n, folder) for n, (folder, _) in STAGES.items() if (ROOT / "tests" / folder).is_dir()]
    rows: list[tuple[str, str, Run]] = []
    t0 = time.perf_counter()

    def step(label: str, part: str, args: list[str]) -> None:
        print(f"\n=== {label}: {part} ===", flush=True)
        run = run_pytest([*args, "-q", "--durations=3"], cwd=ROOT, env=env, echo=True)
        rows.append((label, part, run))

    step("labkit", "toolbox and grader tests", ["tests/meta/test_labkit.py", "tests/meta/test_grader.py"])
    for number, folder in built:
        step(f"stage {number}", "graded tests, solution", [f"tests/{folder}", "--impl", "solution"])
        step(f"stage {number}", "guarantees", ["tests/meta/test_guarantees.py", "-k", folder])

    print("\n" + "=" * 72)
    print(f"{'where':<10} {'what':<26} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8}")
    for label, part, run in rows:
        failed = run.count("failed") + (1 if run.returncode not in (0, 5) and not run.count("failed") else 0)
        print(
            f"{label:<10} {part:<26} {run.count('passed'):>7} {failed:>7} {run.count('skipped'):>8} {run.seconds:>8.1f}"
        )
    passed = sum(r.count("passed") for *_, r in rows)
    failed = sum(r.count("failed") for *_, r in rows)
    broken = [f"{label} {part}" for label, part, r in rows if r.returncode != 0]
    print(f"total {time.perf_counter() - t0:.0f} s; stages built: {', '.join(n for n, _ in built) or 'none'}")
    if broken:
        print("FAILED: " + "; ".join(broken))
    print(f"{passed} passed, {failed} failed")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
