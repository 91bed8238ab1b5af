"""Grade the learner's stage code with the course's tests.

    make grade                 every row (stage, or a stage's part 2 such as 02b), a table
    make grade STAGE=02        one row, with every failing test listed
    python -m labkit.grading.grade --json report.json
    python -m labkit.grading.grade --submission ~/my-course-copy    (instructors)

A row's score is computed over its canonical test IDs, collected before any learner code is
imported. Outcomes come back one test at a time through a pipe (labkit.grading.outcomes), and a test
that never reports (a crash, an early exit, a time limit) counts as failed.

With --submission, the learner's code runs in a worker process the tests call (labkit.grading.worker),
so it cannot reach pytest or the pipe. The tests in IN_PROCESS cannot work that way; they run
in a pytest run of their own with the learner's code in-process, and that run's reports count
for those tests alone.

`make grade` is self-assessment: it runs in your own checkout. --submission is the instructor's
tool: it copies only the learner-editable files (stage modules with a TODO) from PATH into a
clean copy of the course without the solutions, and runs each row sandboxed (labkit.grading.sandbox):
nothing outside the copy is writable and no process outlives the row. README, "Threat model".
"""

import argparse
import ast
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

PART_RE = re.compile(r"^test_(\d\d[a-z])_\w+\.py$")  # test_02b_mla.py belongs to row 02b
MESSAGE_CHARS = 200  # a failure message in the report is one line, cut to this length
# Environment a sandboxed row inherits: nothing of the instructor's beyond what the tests need.
PASS_ENV = ("PATH", "LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED")
IMPORTS_SOLUTIONS = (
    "this module imports from `solutions`, the reference implementation, which a graded copy does not "
    "contain: a module must be the learner's own code, so every test that uses it scores zero"
)
# Tests that need the learner's objects themselves, not data copied out of a worker: they run
# in-process (README, threat model). A key is a stage folder, a test file, or a test without
# its parameters.
IN_PROCESS = {
    "stage04_batching": "the engine runs behind an asyncio server and the tests drive it with stub "
    "schedulers, fault injection and threads: it stays in the test process",
    "stage07_tensor_parallel": "torch.distributed runs the learner's code in processes of its own",
    # Whether append writes into the cache's own buffers: their data_ptr, which a copy cannot keep.
    "tests/stage02_kv_cache/test_02_kv_cache.py::test_append_writes_into_the_preallocated_buffers": "data_ptr",
    "tests/stage02_kv_cache/test_02b_sinks.py::test_02b_memory_stays_bounded_past_the_model_context": "data_ptr",
    # The test counts the tokens each layer sees with hooks on the model it passes.
    "tests/stage02_kv_cache/test_02_generate.py::test_cached_generation_never_reruns_the_prefix": "hooks",
    "tests/stage02_kv_cache/test_02_generate.py::test_no_cache_baseline_recomputes_the_whole_sequence": "hooks",
    # The learner's code changes the test's model in place (swaps its linears, folds scales into
    # its weights), and the test then runs that model.
    "tests/stage03_quantization/test_03_awq.py": "changes the model in place",
    "tests/stage03_quantization/test_03_smoothquant.py": "changes the model in place",
    "tests/stage03_quantization/test_03_quant_linear.py": "changes the model in place",
    "tests/stage03_quantization/test_03_gptq.py::test_gptq_on_a_model_is_gptq_layer_by_layer_on_propagated_inputs": "",
    "tests/stage03_quantization/test_03_evaluate.py::test_weight_bytes_after_int8_counts_codes_scales_and_float_rest": "",
    # The tests' forward counters and caches, changed by the learner's decoding loop, then read.
    "tests/stage06_speculative/test_06_greedy.py::test_cache_rollback_after_rejection": "",
    "tests/stage06_speculative/test_06_greedy.py::test_target_forwards_at_most_generated_and_stats_add_up": "",
    "tests/stage06_speculative/test_06_greedy.py::test_target_forwards_strictly_fewer_when_draft_agrees": "",
    "tests/stage06_speculative/test_06_prompt_lookup.py::test_lookup_decode_equals_target_greedy_with_fewer_forwards": "",
    "tests/stage06_speculative/test_06_sampling.py::test_propose_sampled_returns_the_warped_draft_distributions": "",
    # Part 2 writes into the test's paged store and KV cache (rollback, commit_path), then the test reads them.
    "tests/stage06_speculative/test_06b_batch_verify.py": "changes the test's paged store in place",
    "tests/stage06_speculative/test_06b_batch_engine.py": "the engine holds the test's models and stores",
    "tests/stage06_speculative/test_06b_medusa_tree.py": "changes the test's KV cache in place",
    "tests/stage06_speculative/test_06b_medusa_generate.py": "changes the test's KV cache in place",
}
SOLUTIONS_STUB = f'''"""Not part of a graded copy."""

raise ImportError({IMPORTS_SOLUTIONS!r})
'''


def row_tests(course: Path, number: str) -> list[str]:
    """The test files of a row, relative to the course: test_NNb_* for part 2, the others for NN."""
    folder = STAGES[number][0]
    files = sorted((course / "tests" / folder).glob("test_*.py"))
    part = [(f, m.group(1) if (m := PART_RE.match(f.name)) else number[:2]) for f in files]
    return [str(f.relative_to(course)) for f, row in part if row == number]


def canonical_ids(course: Path, numbers: list[str], env: dict) -> dict[str, list[str]]:
    """Every row's test IDs, collected in one pytest run that imports no stage code."""
    files = {f: n for n in numbers for f in row_tests(course, n)}
    if not files:
        return {n: [] for n in numbers}
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    out = subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"collecting the course's tests failed (this is the course, not the learner):\n{out.stdout}")
    ids = {n: [] for n in numbers}
    for line in out.stdout.split("\n\n", 1)[0].splitlines():  # the IDs, before the summary and any warnings
        if (row := files.get(line.split("::", 1)[0])) and line not in ids[row]:
            ids[row].append(line)
    return ids


def in_process(test_id: str, folder: str) -> bool:
    """Whether a --submission test runs with the learner's code in the test process (IN_PROCESS)."""
    file, _, name = test_id.partition("::")
    return any(key in IN_PROCESS for key in (folder, file, f"{file}::{name.split('[', 1)[0]}"))


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


def status(cases: list[dict], ended: dict, tampered: str | None) -> tuple[str, str]:
    """(status, hint) for one row."""
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
    first = min(failed, key=lambda c: todo.section(c.get("todo", "")) or (9, 0))  # earliest handout section
    hint = f"{first['test'].rsplit('::', 1)[-1]}: {first.get('todo') or first['message']}".strip()
    if first.get("where"):
        hint += f"  [{first['where']}]"
    return ("not started" if len(failed) == len(graded) else "in progress"), hint


def grade_row(course: Path, number: str, ids: list[str], env: dict, timeout: float, submission=None) -> dict:
    """One row's report. `submission`: {"hide": paths or None (no sandbox), "todos": canonical TODOs}."""
    folder, title = STAGES[number]
    files = row_tests(course, number)
    if submission is None:
        records, ended = run_row(course, files, env, timeout, None)
        cases, tampered = outcomes(ids, records, ended)
    else:
        cases, ended, tampered = grade_submission_row(course, folder, files, ids, env, timeout, submission["hide"])
        cases = [redact(c, submission["todos"]) for c in cases]
    graded = [c for c in cases if c["outcome"] != "skipped"]
    passed = sum(c["outcome"] == "passed" for c in graded)
    st, hint = status(cases, ended, tampered)
    return {
        "stage": number,
        "folder": folder,
        "title": title,
        "passed": passed,
        "total": len(graded),
        "skipped": len(cases) - len(graded),
        "score": round(100.0 * passed / len(graded), 1) if graded else 0.0,
        "status": st,
        "hint": hint[:MESSAGE_CHARS],
        "seconds": round(ended["seconds"], 1),
        "failures": [{"test": c["test"], "message": c["message"]} for c in graded if c["outcome"] == "failed"],
    }


def grade_submission_row(course, folder, files, ids, env, timeout, hide):
    """(cases, how it ended, tampered): the tests that can, against a worker; the rest in-process.
    Each run's reports count only for its own tests, so an in-process run cannot forge the others."""
    local = [i for i in ids if in_process(i, folder)]
    remote = [i for i in ids if i not in local]
    by_id, ends, tampered, t0 = {}, [], None, time.perf_counter()
    for group, tests, extra in (
        (remote, [*files, *(arg for i in local for arg in ("--deselect", i))], {"LABKIT_WORKER": "1"}),
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
    cases = [by_id[i] for i in ids]
    if tampered:
        cases = [c | {"outcome": "failed", "message": tampered[:MESSAGE_CHARS]} for c in cases]
    return cases, ended, tampered


def print_table(rows: list[dict], verbose: bool) -> None:
    print(f"{'stage':<28} {'passed':>9} {'score':>6}  status")
    print("-" * 78)
    for r in rows:
        frac = f"{r['passed']}/{r['total']}"
        print(f"{r['stage'] + ' ' + r['folder']:<28} {frac:>9} {r['score']:>5.0f}%  {r['status']}")
        if r["hint"] and r["status"] != "complete":
            print(f"{'':<30}↳ {r['hint']}")
        for f in r["failures"] if verbose else []:
            print(f"{'':<32}✗ {f['test'].rsplit('::', 1)[-1]}: {f['message'][:160]}")
    done = sum(r["status"] == "complete" for r in rows)
    print("-" * 78)
    print(f"{done}/{len(rows)} rows complete. Work a stage in its lab.ipynb, then `make grade STAGE=NN`.")


def prepare_submission(submission: Path, workdir: Path, source: Path) -> Path:
    """A clean copy of the course, without the solutions, ready for the learner's files."""
    if not submission.is_dir():
        raise SystemExit(f"--submission {submission}: not a folder. Pass the learner's copy of the course.")
    course = workdir / "course"
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", "bench_results", ".grade", "solutions", "mutants")
    shutil.copytree(source, course, ignore=skip)
    (course / "solutions").mkdir()
    (course / "solutions" / "__init__.py").write_text(SOLUTIONS_STUB)  # a clear error for `import solutions`
    return course


def copy_learner_files(submission: Path, course: Path, source: Path) -> int:
    """Copy the learner-editable modules from the submission; return how many were found."""
    copied = 0
    for folder in dict.fromkeys(folder for folder, _ in STAGES.values()):
        for path in todo.learner_files(source / folder):
            src = submission / folder / path.name
            if src.is_file():
                text = src.read_text(errors="replace")
                if imports_solutions(text):
                    print(f"{folder}/{path.name}: {IMPORTS_SOLUTIONS}", file=sys.stderr)
                    text = SOLUTIONS_STUB
                (course / folder / path.name).write_text(text)
                copied += 1
    if copied == 0:
        raise SystemExit(
            f"--submission {submission}: found none of the stage modules (e.g. stage01_forward_numpy/*.py)."
        )
    return copied


def imports_solutions(source: str) -> bool:
    """Whether a module names the reference package in an import or an import string."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False  # it fails every test on its own
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        if any(n == "solutions" or n.startswith("solutions.") for n in names):
            return True
    return False


def submission_env(course: Path) -> dict:
    from ..checkpoint import REAL_MODEL_ENV, real_model_folder

    scratch = course / ".grade"
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    return env | {
        REAL_MODEL_ENV: str(real_model_folder()),  # resolved here: HOME below is the scratch's, not the user's
        "LABS_IMPL": "student",
        "PYTHONPATH": str(course),
        "TRITON_INTERPRET": triton_interpret(),
        "HOME": str(scratch / "home"),
        "TMPDIR": str(scratch / "tmp"),
        "MPLBACKEND": "Agg",
        "TOKENIZERS_PARALLELISM": "false",
    }


def grade(numbers: list[str], submission: Path | None, timeout: float, sandboxed=True, source: Path = ROOT) -> list:
    """Rows for `numbers`: of the course at `source` itself, or of a submission graded in a clean copy."""
    if submission is None:
        env = os.environ | {"LABS_IMPL": "student", "PYTHONPATH": str(source), "TRITON_INTERPRET": triton_interpret()}
        ids = canonical_ids(source, numbers, env)
        return [_progress(n) or grade_row(source, n, ids[n], env, timeout) for n in numbers]
    with tempfile.TemporaryDirectory() as tmp:
        course = prepare_submission(submission, Path(tmp), source)
        env = submission_env(course)
        ids = canonical_ids(course, numbers, env)  # before any learner file is in the copy
        copied = copy_learner_files(submission, course, source)
        print(f"graded submission {submission}: {copied} learner files copied into a clean course copy")
        roots = {Path(p or ".").resolve() for p in sys.path} | {source}
        hide = sorted(p / "solutions" for p in roots if (p / "solutions").is_dir())
        pristine = [f for folder, _ in STAGES.values() for f in todo.learner_files(source / folder)]
        todos = {msg for f in pristine for _, msg in todo.todos(f.read_text())}
        context = {"hide": hide if sandboxed else None, "todos": todos}
        return [_progress(n) or grade_row(course, n, ids[n], env, timeout, context) for n in numbers]


def _progress(number: str) -> None:
    print(f"grading {number} ...", file=sys.stderr, flush=True)


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
    print_table(rows, verbose=bool(args.stage))
    if args.json:
        Path(args.json).write_text(json.dumps({"stages": rows}, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
