"""The learner's edit-check loop: how long a section's check and a row's grade take, wall clock.

    make bench STAGE=grading            every row (about 20 min on 2 busy cores); QUICK=1: rows 01, 04 and 07b

Two commands a learner runs after each edit, timed as a learner sees them (a fresh process, the
start of Python and pytest included), medians of repeats:
  check   `pytest tests/<stage> -m <mark> --impl solution`: the row's first section that has tests
  grade   `python -m labkit.grading.grade --stage NN` on the row half done: a copy of the course
          whose stage folder holds the solution's modules for the first half of the row's sections
          and the skeleton's for the rest (what a learner midway through a notebook has)
Targets (issue 45): check <= 5 s, grade <= 30 s, on a quiet machine. Each figure comes as wall seconds and as the
CPU seconds of the command's processes, which on a shared machine is closer to what a quiet one would take.
"""

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import ROOT, STAGES, bench, row_of

QUICK_ROWS = ("01", "04", "07b")
SKIP = shutil.ignore_patterns(".git", ".venv", "__pycache__", "bench_results", ".grade", "*.png", ".ruff_cache")


def _wall(cmd: list[str], cwd: Path, env: dict, ok=(0, 1)) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and its children): on a shared machine the CPU time is
    what a quiet one would take as wall time, about, for these one-thread commands."""
    t0, cpu0 = time.perf_counter(), _children_cpu()
    run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if run.returncode == 5 and 5 in ok:  # no test of that mark: the caller tries the next section
        return -1.0, cpu
    if run.returncode not in ok:  # 1: a test failed, which a half-done row's grade does not do anyway
        raise SystemExit(f"{' '.join(cmd)} ended with {run.returncode}:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return seconds, cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def row_sections(number: str) -> dict[str, list[tuple[int, int]]]:
    """module -> the sections of its TODOs that belong to the row (lab.ipynb for 02, lab2/lab3 for 02b), from
    the skeleton's TODO list the course ships (tests/todos.json: [name, notebook, k])."""
    found = json.loads((ROOT / "tests" / "todos.json").read_text())[STAGES[number][0]]
    return {m: [(nb, k) for _, nb, k in todos if row_of(number[:2], nb) == number] for m, todos in found.items()}


def half_done(course: Path, number: str) -> list[str]:
    """Put the solution's modules whose row TODOs all lie in the first half of the row's sections into
    the copy's stage folder; return those modules."""
    folder = STAGES[number][0]
    modules = {m: s for m, s in row_sections(number).items() if s}
    sections = sorted({s for found in modules.values() for s in found})
    done = sections[: max(1, len(sections) // 2)]
    chosen = [m for m, found in modules.items() if all(s in done for s in found)]
    chosen = chosen or [min(modules, key=lambda m: min(modules[m]))]
    for m in chosen:
        path = f"{m.replace('.', '/')}.py"  # stage 07's fleet.router is fleet/router.py
        shutil.copy(ROOT / "solutions" / folder / path, course / folder / path)
    return chosen


def main(quick: bool = False) -> bench.Result:
    rows_ = QUICK_ROWS if quick else tuple(STAGES)
    repeats = 2 if quick else 3
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("LABS_IMPL", None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        course = Path(tmp) / "course"
        shutil.copytree(ROOT, course, ignore=SKIP)
        for number in rows_:
            folder = STAGES[number][0]
            for section in sorted({s for found in row_sections(number).values() for s in found}):
                # the row's first section with tests of its own (a section's TODOs may be graded only by a later one's)
                mark = f"s{section[1]}" if section[0] == 1 else f"lab{section[0]}_s{section[1]}"
                check = [sys.executable, "-m", "pytest", f"tests/{folder}", "-m", mark, "-q", "--impl", "solution"]
                check += ["-p", "no:cacheprovider"]
                if _wall(check, ROOT, env, ok=(0, 1, 5))[0] >= 0:
                    break
            checks = [_wall(check, ROOT, env) for _ in range(repeats)]
            for path in (ROOT / folder).rglob("*.py"):  # the skeleton, before this row's half is filled in
                shutil.copy(path, course / path.relative_to(ROOT))
            done = half_done(course, number)
            grade = [sys.executable, "-m", "labkit.grading.grade", "--stage", number]
            grades = [_wall(grade, course, env | {"PYTHONPATH": str(course)})]  # one: a row takes tens of seconds
            rows.append(
                {
                    "row": number,
                    "check": f"-m {mark}",
                    "check_s": round(statistics.median(w for w, _ in checks), 2),
                    "check_cpu_s": round(statistics.median(c for _, c in checks), 2),
                    "half_done": " ".join(done),
                    "grade_s": round(statistics.median(w for w, _ in grades), 1),
                    "grade_cpu_s": round(statistics.median(c for _, c in grades), 1),
                }
            )
            print(rows[-1], flush=True)
    print(bench.table(rows, "the edit-check loop, wall seconds (medians)"))
    figures = {
        "repeats": {"check": repeats, "grade": 1},
        "worst_check_s": max(r["check_s"] for r in rows),
        "worst_check_cpu_s": max(r["check_cpu_s"] for r in rows),
        "worst_grade_s": max(r["grade_s"] for r in rows),
        "worst_grade_cpu_s": max(r["grade_cpu_s"] for r in rows),
        "targets_s": {"check": 5, "grade": 30},
    }
    return bench.Result(rows=rows, figures=figures)
