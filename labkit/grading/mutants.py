"""`make mutants [STAGE=NN]`: how many realistic learner bugs each stage's graded tests catch.

The catalogue lives in tests/meta/mutants/stageNN.py (a part 2 row such as 02b: stage02b.py): a list MUTANTS of
    dict(file=..., find=..., replace=..., bug=...[, equivalent="why no test can tell"])
where `file` is under the stage's solutions folder and `find` occurs in it exactly once.

For each mutant the runner writes that one edit into a private copy of the course, runs the
row's graded tests on the solution (`-x`; test_NNb_* for a part 2 row, the others for part 1;
the test files that import the mutated module first, slow files last) and counts the mutant caught if any test fails or the run times out.
It prints caught/planted per stage and every survivor with its description. Mutants marked
`equivalent` change no observable behaviour; they are listed, not run, and not counted.

    python -m labkit.grading.mutants [--stage 04] [--stage 04b] [--sample 2] [--jobs 2] [--check]
"""

import argparse
import ast
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .. import ROOT, STAGES, row_of, triton_interpret
from .junit import _cases
from .todo import section, stage_files

CATALOGUE = ROOT / "tests" / "meta" / "mutants"
ROWS = tuple(STAGES)  # 01, 02, 02b, ...: a part 2 row has a catalogue of its own
MIN_MUTANTS = {"part 1": 25, "part 2": 15}  # part 2 rows have fewer TODOs
# Files that take tens of seconds whatever the mutant (process groups, AOT compiles, the real model): run them last.
_SLOW_FILE = re.compile(r"pytestmark\s*=.*\b(dist|slow|gpu|real)\b")
_TODO = re.compile(r'(raise NotImplementedError\(|tl\.static_assert\(False,)\s*f?"stage\d\d')


@dataclass
class Mutant:
    stage: str
    index: int
    file: str  # relative to the stage's solutions folder
    find: str
    replace: str
    bug: str
    equivalent: str = ""

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.index:02d}"


def load(stage: str) -> list[Mutant]:
    """The catalogue of one stage, read from tests/meta/mutants/stageNN.py."""
    path = CATALOGUE / f"stage{stage}.py"
    if not path.exists():
        raise SystemExit(f"no mutant catalogue {path}; the format is in labkit/grading/mutants.py's docstring.")
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return [Mutant(stage, i, **entry) for i, entry in enumerate(namespace["MUTANTS"], 1)]


def part_two(stage: str) -> bool:
    return not stage.isdigit()


def file_row(name: str) -> str:
    """The row a test file grades: test_02_x.py is row 02, test_07c_x.py row 07c."""
    return re.match(r"test_(\d\d[a-z]?)_", name).group(1)


def todo_functions(stage: str) -> dict[str, list[str]]:
    """{file: [qualified names]} of every skeleton function of this row that holds a TODO (the innermost
    one); a TODO belongs to the row of the notebook its message names (labkit.row_of)."""
    todos: dict[str, list[str]] = {}
    folder = ROOT / STAGES[stage][0]
    for path in stage_files(folder):  # and a sub-package's: fleet/router.py
        text = path.read_text()
        funcs = list(_functions(ast.parse(text)))
        for lineno, line in enumerate(text.splitlines(), 1):
            if not _TODO.search(line) or row_of(stage[:2], (section(line) or (1, 0))[0]) != stage:
                continue
            around = [(n.end_lineno - n.lineno, q) for q, n in funcs if n.lineno <= lineno <= n.end_lineno]
            if around:
                todos.setdefault(str(path.relative_to(folder)), []).append(min(around)[1])
    return todos


def _functions(tree, prefix=""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def validate(stage: str, mutants: list[Mutant]) -> list[str]:
    """Problems with a catalogue: a find that is missing or ambiguous, an edit that does not parse,
    a TODO function no mutant touches, fewer than 25 mutants."""
    problems = []
    sol = ROOT / "solutions" / STAGES[stage][0]
    hit: set[tuple[str, str]] = set()
    for m in mutants:
        path = sol / m.file
        if not path.exists():
            problems.append(f"{m.name}: no file {path.relative_to(ROOT)}")
            continue
        text = path.read_text()
        n = text.count(m.find)
        if n != 1:
            problems.append(f"{m.name}: `find` occurs {n} times in {m.file}, must be exactly once: {m.find!r}")
            continue
        if m.find == m.replace:
            problems.append(f"{m.name}: `replace` equals `find`")
            continue
        try:
            compile(text.replace(m.find, m.replace), m.file, "exec")
        except SyntaxError as e:
            problems.append(f"{m.name}: the mutated {m.file} does not parse: {e}")
        start = text.index(m.find)
        line0, line1 = text.count("\n", 0, start) + 1, text.count("\n", 0, start + len(m.find)) + 1
        for qual, node in _functions(ast.parse(text)):
            if node.lineno <= line1 and line0 <= node.end_lineno:
                hit.add((m.file, qual))
    for file, quals in todo_functions(stage).items():
        for qual in quals:
            if (file, qual) not in hit:
                problems.append(f"stage {stage}: no mutant inside the TODO function {file}:{qual}")
    least = MIN_MUTANTS["part 2" if part_two(stage) else "part 1"]
    if len(mutants) < least:
        problems.append(f"stage {stage}: {len(mutants)} mutants; the course promises at least {least} per row")
    return problems


def test_files(stage: str, mutant: Mutant) -> list[str]:
    """The stage's graded test files, the ones that load the mutated module first, slow ones last."""
    folder = STAGES[stage][0]
    module = f"{folder}.{mutant.file.removesuffix('.py').replace('/', '.')}"
    files = stage_files(ROOT / "tests" / folder, "test_*.py")
    files = [f for f in files if file_row(f.name) == stage]

    def rank(f: Path):
        text = f.read_text()
        return (bool(_SLOW_FILE.search(text)), module not in text)

    return [str(f.relative_to(ROOT)) for f in sorted(files, key=rank)]


# What the graded tests import; the fork server loads it once so each mutant's pytest starts warm.
PRELOAD = (
    "numpy", "torch", "torch.nn.functional", "torch.distributed", "pytest", "hypothesis", "httpx", "uvicorn",
    "fastapi", "transformers", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.mistral.modeling_mistral", "transformers.generation.logits_process", "triton",
    "labkit.model", "labkit.testing", "labkit.calibration", "labkit.checkpoint", "labkit.quality",
)  # fmt: skip


def serve() -> None:
    """Fork server, run inside a workspace: import PRELOAD once, then for each request line
    {"args", "timeout", "log"} fork a child that runs pytest.main(args) and answer {"rc", "timed_out"}.
    No stage module is imported here, so every child imports the (mutated) solution afresh."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # an optional dependency (triton, uvicorn) missing: the child imports or skips
            pass
    import pytest

    child = 0

    def stop(*_):  # the runner is going away: take the running tests (and their servers) with us
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        child = pid = os.fork()
        if pid == 0:  # the child: its own process group, so a timeout kills its servers and ranks too
            os.setsid()
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1), os.dup2(fd, 2)
            code = 3
            try:
                code = int(pytest.main(req["args"]))
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        deadline, timed_out = time.monotonic() + req["timeout"], False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out}), flush=True)


class Workspace:
    """A private copy of the course and its fork server; one mutant at a time is written into the
    copy, its tests run, and the edit is undone."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.root = tmp / "course"
        shutil.copytree(
            ROOT,
            self.root,
            ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "bench_results", "*.ipynb", ".ruff_cache"),
        )
        self.env = {
            **os.environ,
            "PYTHONPATH": str(self.root),  # before the venv's .pth entry for the real checkout
            "PYTHONDONTWRITEBYTECODE": "1",  # no stale .pyc when a mutant keeps the file's size and mtime
            "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "TRITON_INTERPRET": triton_interpret(),
            "OMP_NUM_THREADS": "1",
            "LABS_IMPL": "solution",
        }
        probe = subprocess.run(
            [sys.executable, "-c", "import solutions, labkit; print(solutions.__file__, labkit.__file__)"],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
        )
        if probe.returncode or not all(p.startswith(str(self.root)) for p in probe.stdout.split()):
            raise RuntimeError(f"the copy of the course does not import its own code: {probe.stdout}{probe.stderr}")
        self.server = subprocess.Popen(
            [sys.executable, "-c", "from labkit.grading.mutants import serve; serve()"],
            cwd=self.root,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.server.stdout.readline()  # {"ready": true}

    def close(self) -> None:
        self.server.terminate()  # also ends a test run still in flight (after Ctrl-C or a kill)
        self.server.wait(timeout=60)

    def run(self, m: Mutant, timeout: float) -> tuple[str, float, str]:
        """('caught' | 'timeout' | 'survived' | 'error', seconds, first failing test)."""
        path = self.root / "solutions" / STAGES[m.stage][0] / m.file
        original = path.read_text()
        xml, log = self.tmp / "junit.xml", self.tmp / "pytest.log"
        xml.unlink(missing_ok=True)
        args = [*test_files(m.stage, m), "--impl", "solution", "--file-order", "-x", "-q", "-p", "no:cacheprovider"]
        path.write_text(original.replace(m.find, m.replace))
        t0 = time.perf_counter()
        try:
            self.server.stdin.write(
                json.dumps({"args": [*args, f"--junitxml={xml}"], "timeout": timeout, "log": str(log)}) + "\n"
            )
            self.server.stdin.flush()
            answer = json.loads(self.server.stdout.readline())
        finally:
            path.write_text(original)
        seconds = time.perf_counter() - t0
        if answer["timed_out"]:
            return "timeout", seconds, ""
        rc = answer["rc"]
        failed = next((c.name for c in _cases(xml) if c.outcome == "failed"), "")
        if rc == 0:
            return "survived", seconds, ""
        if rc == 1 or (rc == 2 and failed):
            return "caught", seconds, failed
        if rc < 0:  # the test process died of a signal (a kernel writing out of bounds): a learner sees a crash
            return "caught", seconds, f"crashed with signal {-rc}"
        return "error", seconds, f"pytest exit {rc}: " + " | ".join(log.read_text().strip().splitlines()[-3:])[-300:]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", action="append", help="row (repeatable), e.g. 04 or 04b; default: every row")
    ap.add_argument("--sample", type=int, default=0, help="a fixed, seeded sample of K mutants per stage")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at once")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per mutant; a timeout counts as caught")
    ap.add_argument("--min-rate", type=float, default=95.0, help="exit 1 if a stage catches less (percent)")
    ap.add_argument("--only", help="comma-separated mutant names (e.g. 02-20,02-25) to run alone")
    ap.add_argument("--check", action="store_true", help="only validate the catalogue")
    ap.add_argument("--include-equivalent", action="store_true", help="run the documented equivalents too")
    return ap.parse_args(argv)


def selected(stages: list[str], catalogue: dict[str, list[Mutant]], args) -> list[Mutant]:
    """The mutants to run: the documented equivalents left out unless asked for, then --only, then --sample."""
    todo: list[Mutant] = []
    for s in stages:
        ms = [m for m in catalogue[s] if args.include_equivalent or not m.equivalent]
        if args.only:
            ms = [m for m in ms if m.name in args.only.split(",")]
        if args.sample:
            ms = sorted(random.Random(f"mutants-{s}").sample(ms, min(args.sample, len(ms))), key=lambda m: m.index)
        todo += ms
    return todo


def run_all(todo: list[Mutant], jobs: int, timeout: float) -> tuple[dict[str, tuple[str, float, str]], int]:
    """Each mutant planted and tested in one of `jobs` workspaces: name -> (outcome, seconds, detail), printed
    as it comes; and how many workspaces ran."""
    results: dict[str, tuple[str, float, str]] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        n_spaces = max(1, min(jobs, len(todo)))
        with ThreadPoolExecutor(n_spaces) as pool:  # the servers' imports take a while: start them together
            pool_spaces = list(pool.map(Workspace, [Path(tmp) / f"w{i}" for i in range(n_spaces)]))
        free = list(pool_spaces)

        def one(m: Mutant):
            with lock:
                ws = free.pop()
            try:
                res = ws.run(m, timeout)
            finally:
                with lock:
                    free.append(ws)
            with lock:
                results[m.name] = res
                outcome, seconds, detail = res
                print(
                    f"{m.name} {outcome:<8} {seconds:6.1f} s  {m.file}: {m.bug}" + (f"  [{detail}]" if detail else ""),
                    flush=True,
                )

        pool = ThreadPoolExecutor(len(pool_spaces))
        try:
            list(pool.map(one, todo))
        finally:  # stop the servers first: a thread waiting on one then returns at once
            for ws in pool_spaces:
                ws.close()
            pool.shutdown(cancel_futures=True)
    return results, len(pool_spaces)


def report(stages, catalogue, todo, results, min_rate: float) -> bool:
    """Print each stage's kill rate and the survivors; True if a stage caught less than min_rate or errored."""
    print("\n" + "=" * 72)
    print(f"{'stage':<6} {'caught':>7} {'planted':>8} {'rate':>7} {'equivalent':>11}")
    bad = False
    for s in stages:
        ran = [m for m in todo if m.stage == s]
        caught = sum(results[m.name][0] in ("caught", "timeout") for m in ran)
        errors = [m for m in ran if results[m.name][0] == "error"]
        rate = 100.0 * caught / len(ran) if ran else 100.0
        bad |= rate < min_rate or bool(errors)
        n_eq = sum(bool(m.equivalent) for m in catalogue[s])
        print(f"{s:<6} {caught:>7} {len(ran):>8} {rate:>6.1f}% {n_eq:>11}")
    survivors = [m for m in todo if results[m.name][0] in ("survived", "error")]
    if survivors:
        print("\nsurvivors (no graded test failed):")
        for m in survivors:
            print(f"  {m.name} {results[m.name][0]} {m.file}: {m.bug}")
    return bad


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the cleanup below on a plain kill too
    stages = [s.zfill(2) if s.isdigit() else s for s in args.stage] if args.stage else list(ROWS)

    catalogue, problems = {}, []
    for s in stages:
        if s not in STAGES:
            raise SystemExit(f"unknown stage {s!r}; stages are {', '.join(STAGES)}")
        catalogue[s] = load(s)
        problems += validate(s, catalogue[s])
    if problems:
        print("the mutant catalogue is not valid:\n  " + "\n  ".join(problems))
        return 1
    print(f"catalogue valid: {sum(len(v) for v in catalogue.values())} mutants in {len(stages)} stages")
    if args.check:
        return 0

    todo = selected(stages, catalogue, args)
    t0 = time.perf_counter()
    results, n_spaces = run_all(todo, args.jobs, args.timeout)
    bad = report(stages, catalogue, todo, results, args.min_rate)
    print(f"wall time {time.perf_counter() - t0:.0f} s, {n_spaces} jobs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
