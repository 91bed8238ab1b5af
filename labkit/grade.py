"""Grade the learner's stage code with the course's tests.

    make grade                 every stage, a table
    make grade STAGE=02        one stage, with every failing test listed
    python -m labkit.grade --json report.json
    python -m labkit.grade --submission ~/my-course-copy    (instructors)

Each stage runs in its own pytest subprocess with a time limit, so an infinite loop in a
learner's code shows up as a timeout instead of a hang. --submission copies only the
learner-editable files (the stage modules) from PATH into a clean copy of this course and grades
them with the canonical tests, so edited tests or labkit files in a submission change nothing.
"""

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from . import ROOT, STAGES, triton_interpret
from .junit import Run, run_pytest


def learner_files(course: Path, folder: str) -> list[Path]:
    """The skeleton modules of a stage: what a learner edits (relative paths)."""
    return sorted(p.relative_to(course) for p in (course / folder).rglob("*.py") if "__pycache__" not in p.parts)


def status(run: Run) -> tuple[str, str]:
    """(status, hint) for one stage's run."""
    graded = [c for c in run.cases if c.outcome != "skipped"]
    if run.timed_out:
        return (
            "timeout",
            "the tests ran past the time limit: look for an infinite loop (e.g. a scheduler that never finishes)",
        )
    if not run.cases:
        tail = run.output.strip().splitlines()[-1:] or ["no output"]
        return "error", f"pytest collected nothing: {tail[0]}"
    if not graded:
        return "blocked", run.cases[0].message or "every test was skipped"
    failed = [c for c in graded if c.outcome == "failed"]
    if not failed:
        return "complete", ""
    first = min(failed, key=_section)  # the earliest handout section still to do
    hint = f"{first.name.rsplit('::', 1)[-1]}: {first.message}".strip()
    where = re.findall(r"(stage\d\d_\w+/\w+\.py):(\d+)", first.details)
    if where:  # the deepest frame in the learner's own files
        hint += f"  [{where[-1][0]}:{where[-1][1]}]"
    return ("not started" if len(failed) == len(graded) else "in progress"), hint


def _section(case) -> tuple[int, int]:
    """Sort key: TODOs by their handout section (§k), anything else after them."""
    m = re.search(r"NotImplementedError: .*§(\d+)", case.message)
    return (0, int(m.group(1))) if m else (1, 0)


def grade_stage(course: Path, number: str, timeout: float, verbose: bool) -> dict:
    folder, title = STAGES[number]
    row = {"stage": number, "folder": folder, "title": title}
    tests = course / "tests" / folder
    if not tests.is_dir():
        return row | {"passed": 0, "total": 0, "score": 0.0, "status": "coming", "hint": "this stage is not built yet"}
    env = {
        "LABS_IMPL": "student",
        "PYTHONPATH": str(course),
        "TRITON_INTERPRET": triton_interpret(),
    }
    run = run_pytest([str(tests), "--impl", "student", "-q"], cwd=course, env=env, timeout=timeout)
    graded = [c for c in run.cases if c.outcome != "skipped"]
    passed = sum(c.outcome == "passed" for c in graded)
    st, hint = status(run)
    row |= {
        "passed": passed,
        "total": len(graded),
        "skipped": len(run.cases) - len(graded),
        "score": round(100.0 * passed / len(graded), 1) if graded else 0.0,
        "status": st,
        "hint": hint,
        "seconds": round(run.seconds, 1),
    }
    if verbose:
        row["failures"] = [{"test": c.name, "message": c.message} for c in graded if c.outcome == "failed"]
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'stage':<28} {'passed':>9} {'score':>6}  status")
    print("-" * 78)
    for r in rows:
        frac = f"{r['passed']}/{r['total']}"
        print(f"{r['stage'] + ' ' + r['folder']:<28} {frac:>9} {r['score']:>5.0f}%  {r['status']}")
        if r["hint"] and r["status"] != "complete":
            print(f"{'':<30}↳ {r['hint'][:200]}")
        for f in r.get("failures", []):
            print(f"{'':<32}✗ {f['test'].rsplit('::', 1)[-1]}: {f['message'][:160]}")
    done = sum(r["status"] == "complete" for r in rows)
    print("-" * 78)
    print(f"{done}/{len(rows)} stages complete. Work a stage in its lab.ipynb, then `make grade STAGE=NN`.")


def prepare_submission(submission: Path, workdir: Path) -> Path:
    """A clean copy of the course with the submission's stage modules dropped in."""
    if not submission.is_dir():
        raise SystemExit(f"--submission {submission}: not a folder. Pass the learner's copy of the course.")
    course = workdir / "course"
    shutil.copytree(
        ROOT, course, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "bench_results", ".grade")
    )
    copied = 0
    for folder, _ in STAGES.values():
        for rel in learner_files(ROOT, folder) if (ROOT / folder).is_dir() else []:
            src = submission / rel
            if src.is_file():
                shutil.copy(src, course / rel)
                copied += 1
    if copied == 0:
        raise SystemExit(
            f"--submission {submission}: found none of the stage modules (e.g. stage01_forward_numpy/*.py)."
        )
    print(f"graded submission {submission}: {copied} learner files copied into a clean course copy")
    return course


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Grade the learner's stage code with the course's tests.")
    ap.add_argument("--stage", help="one stage number, e.g. 02 (default: all)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--submission", metavar="PATH", help="grade another copy of the course (instructors)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per stage before it counts as a timeout")
    args = ap.parse_args(argv)

    numbers = list(STAGES)
    if args.stage:
        number = f"{int(args.stage):02d}" if args.stage.isdigit() else args.stage
        if number not in STAGES:
            print(f"unknown stage {args.stage!r}: pick one of {', '.join(STAGES)}", file=sys.stderr)
            return 2
        numbers = [number]

    with tempfile.TemporaryDirectory() as tmp:
        course = prepare_submission(Path(args.submission).resolve(), Path(tmp)) if args.submission else ROOT
        rows = []
        for n in numbers:
            print(f"grading stage {n} ...", file=sys.stderr, flush=True)
            rows.append(grade_stage(course, n, args.timeout, verbose=bool(args.stage)))
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"stages": rows}, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
