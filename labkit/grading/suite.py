"""`make test`: every graded test against the solutions, then the course's guarantees.

For each stage folder:
  1. tests/stageNN against the reference solution   (guarantee 1: all pass)
  2. tests/meta for that stage                       (2: every test fails on the skeleton,
                                                      3: same API and given code, 4: notebooks run clean)
and every other tests/meta file (labkit, the grader, the learner edition) as a job of its own. A
stage's part 2 (tests test_NNb_*, grader row NNb) lives in the same folders and runs with part 1.
In the learner edition (no solutions/) step 1 and the guarantees that compare with a solution are
skipped, and the run says so. Jobs run side by side, one per core, each with one thread (many
small ops run faster that way than two OpenMP threads fighting over two cores). Prints a
per-stage timing table; exits 1 if anything failed.
"""

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .. import ROOT, STAGES, triton_interpret
from .junit import Run, run_pytest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="pytest processes at once")
    args = ap.parse_args(argv)
    threads = "1" if args.jobs > 1 else os.environ.get("OMP_NUM_THREADS", "")
    env = {"TRITON_INTERPRET": triton_interpret(), **({"OMP_NUM_THREADS": threads} if threads else {})}
    rows: dict[str, list[str]] = {}
    for number, (folder, _) in STAGES.items():
        rows.setdefault(folder, []).append(number)
    edition = not (ROOT / "solutions").is_dir()

    # Every other tests/meta file is its own job (labkit, the grader, the learner edition, ...).
    meta = sorted(p for p in (ROOT / "tests" / "meta").glob("test_*.py") if p.name != "test_guarantees.py")
    jobs = [("meta", p.stem[5:], [str(p.relative_to(ROOT))]) for p in meta]
    for folder, numbers in rows.items():
        label = "stage " + "+".join(numbers)
        if not edition:
            jobs.append((label, "graded tests, solution", [f"tests/{folder}", "--impl", "solution"]))
        jobs.append((label, "guarantees", ["tests/meta/test_guarantees.py", "-k", folder]))
    if edition:
        print(
            "learner edition: no solutions/, so the graded tests against the solutions, the notebook runs "
            "and the skeleton/solution comparisons are skipped; the rest of the guarantees run."
        )

    def run(job) -> Run:
        label, part, args_ = job
        result = run_pytest([*args_, "-q", "--durations=3"], cwd=ROOT, env=env)
        print(f"\n=== {label}: {part} ({result.seconds:.0f} s) ===\n{result.output.rstrip()}", flush=True)
        return result

    print(f"running {len(jobs)} pytest jobs, {args.jobs} at a time; rows: {', '.join(STAGES)}")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, jobs))

    print("\n" + "=" * 72)
    print(f"{'where':<14} {'what':<26} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8}")
    for (label, part, _), r in zip(jobs, results, strict=True):
        print(
            f"{label:<14} {part:<26} {r.count('passed'):>7} {r.count('failed'):>7} {r.count('skipped'):>8} {r.seconds:>8.1f}"
        )
    passed = sum(r.count("passed") for r in results)
    failed = sum(r.count("failed") for r in results)
    broken = [f"{label} {part}" for (label, part, _), r in zip(jobs, results, strict=True) if r.returncode != 0]
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    if broken:
        print("FAILED: " + "; ".join(broken))
    print(f"{passed} passed, {failed} failed")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
