"""Grade the learner's stage code with the course's tests.

    make grade                 every row (stage, or a stage's part 2 such as 02b), a table
    make grade STAGE=02        one row: a line per TODO, failures in the test's own words
    python -m labkit.grading.grade --json report.json
    python -m labkit.grading.grade --submission ~/my-course-copy    (instructors)

A row's score is computed over its canonical test IDs, collected before any learner code is
imported, with the marks tests/conftest.py puts on them: each test's handout section (`s3`), the
TODOs it calls, and `in_process`. A TODO whose statement is still in the learner's file is not
started: the tests of a section whose TODOs are all untouched, and every test of a part 2 notebook none of
whose TODOs is started, are reported "not started" without running, and a stage with nothing started is reported without even collecting its tests (total
"–"). The others run; outcomes come back one test at a time through a pipe (labkit.grading.outcomes),
and a test that never reports (a crash, an early exit, a time limit) counts as failed. `make grade STAGE=NN` prints one line per TODO, in handout order, with the first
failing test's own message under a TODO that fails; a failure raised by another TODO's NotImplementedError
counts as "waiting on" that TODO, apart from the TODO's own failures; the first TODO not done is the hint.

With --submission, the learner's code runs in a worker process the tests call (labkit.grading.worker),
so it cannot reach pytest or the pipe. Tests marked `in_process` cannot work that way; they run
in a pytest run of their own with the learner's code in-process, and that run's reports count
for those tests alone.

`make grade` is self-assessment: it runs in your own checkout. --submission is the instructor's
tool: it copies only the learner-editable files (stage modules with a TODO) from PATH into a
clean copy of the course without the solutions, and runs each row sandboxed (labkit.grading.sandbox):
nothing outside the copy is writable and no process outlives the row. INSTRUCTORS.md, "Threat model".

This file runs the rows and scores them; progress.py words where the learner stands (the TODO lines and the
table), submission.py prepares an instructor's clean copy.
"""

import argparse
import builtins
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .. import ROOT, STAGES, triton_interpret
from . import sandbox, todo
from .progress import (
    not_started,
    print_table,
    row_todos,
    skip_marks,
    started,
    todo_message,
    todo_report,
)
from .submission import IMPORTS_SOLUTIONS, copy_learner_files, prepare_submission, submission_env

PART_RE = re.compile(r"^test_(\d\d[a-z])_\w+\.py$")  # test_02b_mla.py belongs to row 02b
MESSAGE_CHARS = 1500  # a failure message in the report: condensed by labkit.grading.outcomes, cut to this length


def row_tests(course: Path, number: str) -> list[str]:
    """The test files of a row, relative to the course: test_NNb_* for part 2, the others for NN."""
    folder = STAGES[number][0]
    files = todo.stage_files(course / "tests" / folder, "test_*.py")  # stage 07's fleet/ tests too
    part = [(f, m.group(1) if (m := PART_RE.match(f.name)) else number[:2]) for f in files]
    return [str(f.relative_to(course)) for f, row in part if row == number]


def collect(course: Path, numbers: list[str], env: dict) -> dict[str, list[dict]]:
    """Every row's tests, collected in one pytest run that imports no stage code: {"id", "section"
    ([notebook, k] or None), "todos" (the TODO names it calls), "in_process"} (tests/conftest.py's marks)."""
    files = {f: n for n in numbers for f in row_tests(course, n)}
    tests = {n: [] for n in numbers}
    if not files:
        return tests
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tests.json"
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        cmd += ["-p", "labkit.grading.outcomes", *files]
        run = subprocess.run(cmd, cwd=course, env=env | {"LABKIT_COLLECT": str(out)}, capture_output=True, text=True)
        if run.returncode != 0 or not out.is_file():
            raise SystemExit(
                f"collecting the course's tests failed (this is the course, not the learner):\n{run.stdout}"
            )
        collected = json.loads(out.read_text())
    seen = set()
    for test in collected:
        if (row := files.get(test["id"].split("::", 1)[0])) and test["id"] not in seen:
            seen.add(test["id"])
            tests[row].append(test)
    return tests


def canonical_ids(course: Path, numbers: list[str], env: dict) -> dict[str, list[str]]:
    """Every row's test IDs (collect)."""
    return {n: [t["id"] for t in tests] for n, tests in collect(course, numbers, env).items()}


def run_row(course: Path, tests: list[str], env: dict, timeout: float, hide: list[Path] | None):
    """Run tests (files, or IDs and --deselect options), sandboxed unless `hide` is None;
    (records from the pipe, how it ended)."""
    read, write = os.pipe()
    cmd = [sys.executable, "-m", "pytest", *tests, "--impl", "student", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "labkit.grading.outcomes"]
    env = env | {"LABKIT_OUTCOMES_FD": str(write), "LABKIT_PASS_FDS": str(write)}
    if hide is not None:  # a fresh writable corner per row; the copy itself stays read-only
        shutil.rmtree(course / ".grade", ignore_errors=True)
        for sub in ("home", "tmp"):
            (course / ".grade" / sub).mkdir(parents=True)
        cmd = sandbox.command(cmd, course / ".grade", hide)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=course,
        env=env,
        pass_fds=[write],
        stdout=subprocess.DEVNULL,  # what the learner's code prints is not part of the report
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(write)
    records: list[dict] = []
    reader = threading.Thread(target=_read_records, args=(read, records), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # unshare's --kill-child then takes the whole PID namespace down
        proc.wait()
        timed_out = True
    reader.join(5)  # a process the learner left holding the pipe (unsandboxed) cannot hold up the report
    return records, {"returncode": proc.returncode, "timed_out": timed_out, "seconds": time.perf_counter() - t0}


def _read_records(fd: int, records: list[dict]) -> None:
    with os.fdopen(fd, errors="replace") as pipe:
        for line in pipe:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)


def outcomes(ids: list[str], records: list[dict], ended: dict) -> tuple[list[dict], str | None]:
    """One case per canonical ID: what the pipe reported first, or failed if it never did."""
    tampered = next((str(r["tampered"]) for r in records if "tampered" in r), None)
    first: dict[str, dict] = {}
    for r in records:
        if isinstance(r.get("id"), str) and r.get("outcome") in ("passed", "failed", "skipped"):
            first.setdefault(r["id"], r)
    if ended["timed_out"]:
        missing = "not reached before the time limit"
    else:
        missing = f"never reported: the test process ended early (exit code {ended['returncode']})"
    cases = []
    for test_id in ids:
        r = first.get(test_id, {"outcome": "failed", "message": missing, "missing": True})
        case = {"test": test_id, "outcome": r["outcome"], "message": str(r.get("message", ""))[:MESSAGE_CHARS]}
        case |= {k: str(r[k])[:MESSAGE_CHARS] for k in ("todo", "where", "type", "ours") if r.get(k)}
        case |= {"crashed": True} if r.get("crashed") else {}
        if tampered:
            case |= {"outcome": "failed", "message": tampered[:MESSAGE_CHARS]}
        cases.append(case | {"missing": bool(r.get("missing"))})
    return cases, tampered


def redact(case: dict, todos: set[str]) -> dict:
    """A --submission case whose message holds nothing the learner's code chose: the exception's
    type if it is a built-in one, the TODO if it is one of the skeleton's, and where it happened."""
    if case["outcome"] != "failed" or case["missing"]:
        return case
    if case.get("ours"):  # the grader's own words, not the exception's
        return case | {"message": case["ours"]}
    if IMPORTS_SOLUTIONS[:40] in case["message"]:
        return case | {"message": IMPORTS_SOLUTIONS[:MESSAGE_CHARS]}
    kind = case.get("type", "")
    kind = kind if isinstance(getattr(builtins, kind, None), type) else "an exception"
    text = kind + (f": {case['todo']}" if case.get("todo") in todos else "")
    if case.get("where"):
        text += f" at {case['where']}"
    return case | {"message": text, "todo": case.get("todo") if case.get("todo") in todos else ""}


def status(cases: list[dict], ended: dict, tampered: str | None, lines: list[dict]) -> tuple[str, str]:
    """(status, hint) for one row: the hint is the first TODO in handout order that is not done."""
    graded = [c for c in cases if c["outcome"] != "skipped"]
    if not cases:
        return "error", "this row has no tests"
    if tampered:
        return "tampered", tampered
    if ended["timed_out"]:
        return (
            "timeout",
            "the tests ran past the time limit: look for an infinite loop (e.g. a scheduler that never finishes)",
        )
    if not graded:
        return "blocked", cases[0]["message"] or "every test was skipped"
    failed = [c for c in graded if c["outcome"] == "failed"]
    if not failed:
        return "complete", ""
    if crashes := [c for c in failed if c["missing"] or c.get("crashed")]:
        return "crashed", crashes[0]["message"]
    started = any(x["state"] != "not started" for x in lines) if lines else len(failed) < len(graded)
    if line := next((x for x in lines if x["state"] in ("fails", "not started")), None):
        if line["state"] == "not started":
            hint = f"{line['todo']}" + (f"  [{line['where']}]" if line.get("where") else "")
        else:
            hint = f"{line['section']} {line['name']}: {line['test']}\n{line['message']}"
    else:  # every TODO passes its own tests, and a test of no section fails
        first = failed[0]
        hint = f"{first['test'].rsplit('::', 1)[-1]}: {first.get('todo') or first['message']}"
        hint += f"  [{first['where']}]" if first.get("where") else ""
    return ("in progress" if started else "not started"), hint


def grade_row(course: Path, number: str, tests: list[dict], env: dict, timeout: float, submission=None, source=None):
    """One row's report. `submission`: {"hide": paths or None (no sandbox), "todos": canonical TODOs}."""
    folder, title = STAGES[number]
    files = row_tests(course, number)
    source = source or course
    todos = row_todos(course, source, number)
    # A row whose own TODOs are all untouched is not started, whatever the other part of its stage holds: its
    # tests (those of no section too) can only fail on its TODOs, so none runs.
    any_started = any(t["started"] for t in todos) if todos else started(course, source, folder)
    if not any_started:  # no pytest, which would import torch for nothing
        lines = [line | {"todo": todo_message(number, line)} for line in todo_report(todos, [], {}, folder, course)]
        first = lines[0] if lines else {"todo": "", "where": ""}
        return {
            "stage": number,
            "folder": folder,
            "title": title,
            "passed": 0,
            "total": None if tests is None else len(tests),
            "skipped": 0,
            "not_started": None if tests is None else len(tests),
            "score": 0.0,
            "status": "not started",
            "hint": first["todo"] + (f"  [{first['where']}]" if first.get("where") else ""),
            "seconds": 0.0,
            "todos": lines,
            "failures": [],
        }
    if tests is None:  # self-assessment: one pytest run collects, leaves out what is not started, runs the rest
        records, ended, tests = run_collecting(course, number, files, env, timeout, skip_marks(todos, any_started))
    skip = not_started(tests, todos, any_started)
    run = [t for t in tests if t["id"] not in skip]
    if submission is None:
        cases, tampered = outcomes([t["id"] for t in run], records, ended)
    else:
        cases, ended, tampered = grade_submission_row(course, files, run, skip, env, timeout, submission["hide"])
        cases = [redact(c, submission["todos"]) for c in cases]
    by_id = {c["test"]: c for c in cases}
    by_id |= {i: {"test": i, "outcome": "failed", "message": "not started", "missing": False} for i in skip}
    cases = [by_id[t["id"]] for t in tests]
    lines = todo_report(todos, tests, by_id, folder, course)
    for line in lines:
        line["todo"] = todo_message(number, line)
    graded = [c for c in cases if c["outcome"] != "skipped"]
    passed = sum(c["outcome"] == "passed" for c in graded)
    st, hint = status(cases, ended, tampered, lines)
    return {
        "stage": number,
        "folder": folder,
        "title": title,
        "passed": passed,
        "total": len(graded),
        "skipped": len(cases) - len(graded),
        "not_started": len(skip),
        "score": round(100.0 * passed / len(graded), 1) if graded else 0.0,
        "status": st,
        "hint": hint[:MESSAGE_CHARS],
        "seconds": round(ended["seconds"], 1),
        "todos": lines,
        "failures": [{"test": c["test"], "message": c["message"]} for c in graded if c["outcome"] == "failed"],
        # what the skipped tests need (labkit.grading.outcomes: "needs llguidance (make guided)", a GPU)
        "skipped_because": sorted({c["message"] for c in cases if c["outcome"] == "skipped" and c["message"]}),
    }


def run_collecting(course: Path, number: str, files: list[str], env: dict, timeout: float, skip: list[str]):
    """(records, how it ended, the row's tests): a run that reports its collection too, so self-assessment
    starts pytest once per row, as plain pytest does."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tests.json"
        extra = {"LABKIT_COLLECT": str(path), "LABKIT_SKIP_SECTIONS": " ".join(skip)}
        records, ended = run_row(course, files, env | extra, timeout, None)
        if path.is_file():
            return records, ended, json.loads(path.read_text())
    return records, ended, collect(course, [number], env)[number]  # the run died before its collection ended


def deselect(ids) -> list[str]:
    return [arg for i in sorted(ids) for arg in ("--deselect", i)]


def grade_submission_row(course, files, run, skip, env, timeout, hide):
    """(cases, how it ended, tampered): the tests that can, against a worker; the rest in-process.
    Each run's reports count only for its own tests, so an in-process run cannot forge the others."""
    local = [t["id"] for t in run if t["in_process"]]
    remote = [t["id"] for t in run if not t["in_process"]]
    by_id, ends, tampered, t0 = {}, [], None, time.perf_counter()
    for group, tests, extra in (
        (remote, [*files, *deselect([*local, *skip])], {"LABKIT_WORKER": "1"}),
        (local, local, {}),
    ):
        if not group:
            continue
        left = max(timeout - (time.perf_counter() - t0), 1.0)
        records, ended = run_row(course, tests, env | extra, left, hide)
        group_cases, group_tampered = outcomes(group, records, ended)
        by_id |= {c["test"]: c for c in group_cases}
        ends.append(ended)
        tampered = tampered or group_tampered
    ended = {
        "returncode": ends[-1]["returncode"] if ends else 0,
        "timed_out": any(e["timed_out"] for e in ends),
        "seconds": time.perf_counter() - t0,
    }
    cases = [by_id[t["id"]] for t in run]
    if tampered:
        cases = [c | {"outcome": "failed", "message": tampered[:MESSAGE_CHARS]} for c in cases]
    return cases, ended, tampered


def grade(numbers: list[str], submission: Path | None, timeout: float, sandboxed=True, source: Path = ROOT) -> list:
    """Rows for `numbers`: of the course at `source` itself, or of a submission graded in a clean copy."""
    if submission is None:
        begun = [n for n in numbers if started(source, source, STAGES[n][0])]
        env = os.environ | {"LABS_IMPL": "student", "PYTHONPATH": str(source)}
        env |= {"TRITON_INTERPRET": triton_interpret()} if begun else {}  # (asks torch whether there is a GPU)
        return [_progress(n) or grade_row(source, n, None, env, timeout) for n in numbers]
    with tempfile.TemporaryDirectory() as tmp:
        course = prepare_submission(submission, Path(tmp), source)
        env = submission_env(course)
        tests = collect(course, numbers, env)  # before any learner file is in the copy
        copied = copy_learner_files(submission, course, source)
        print(f"graded submission {submission}: {copied} learner files copied into a clean course copy")
        roots = {Path(p or ".").resolve() for p in sys.path} | {source}
        hide = sorted(p / "solutions" for p in roots if (p / "solutions").is_dir())
        pristine = [f for folder, _ in STAGES.values() for f in todo.learner_files(source / folder)]
        todos = {msg for f in pristine for _, msg in todo.todos(f.read_text())}
        context = {"hide": hide if sandboxed else None, "todos": todos}
        return [_progress(n) or grade_row(course, n, tests[n], env, timeout, context, source) for n in numbers]


def _progress(number: str) -> None:
    print(f"grading {number} ...", file=sys.stderr, flush=True)


def course_commit(root: Path) -> str | None:
    """The commit the course's tests come from ("+dirty" when the checkout has changes), or None outside git."""
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Grade the learner's stage code with the course's tests.")
    ap.add_argument("--stage", help="one row, e.g. 02 or 02b (default: all)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--submission", metavar="PATH", help="grade another copy of the course (instructors)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per row before it counts as a timeout")
    ap.add_argument(
        "--no-sandbox", action="store_true", help="--submission without the sandbox, where unshare is unavailable"
    )
    args = ap.parse_args(argv)

    numbers = list(STAGES)
    if args.stage:
        m = re.fullmatch(r"(\d{1,2})([a-z]?)", args.stage.strip().lower())
        number = f"{int(m.group(1)):02d}{m.group(2)}" if m else args.stage
        if number not in STAGES:
            print(f"unknown stage {args.stage!r}: pick one of {', '.join(STAGES)}", file=sys.stderr)
            return 2
        numbers = [number]

    if args.submission and not args.no_sandbox and (why := sandbox.unavailable()):
        print(f"cannot sandbox the submission: {why}.", file=sys.stderr)
        print("Grade on a machine where it can, or pass --no-sandbox to grade it unprotected.", file=sys.stderr)
        return 3
    submission = Path(args.submission).resolve() if args.submission else None
    rows = grade(numbers, submission, args.timeout, sandboxed=not args.no_sandbox)
    print_table(rows, verbose=bool(args.stage), learner=submission is None)
    if args.json:
        meta = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "course_commit": course_commit(ROOT),
            "submission": str(submission) if submission else None,
            "sandboxed": bool(submission) and not args.no_sandbox,
        }
        Path(args.json).write_text(json.dumps(meta | {"stages": rows}, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
