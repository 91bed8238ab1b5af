"""The grader on a toy course: untouched, finished, stuck, split in two rows, and tampered with.

The tampering routes are those of issue 21: each is a tiny submission whose functions are wrong,
and each must grade as failing with the instructor's course left as it was. A submission's code
runs in a worker process (labkit.grading.worker) unless the test is marked `in_process`; both routes are
tried.
"""

import ast
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from labkit import ROOT
from labkit.grading import grade, progress, sandbox, todo, worker

SKELETON = """
def sub(a: int, b: int) -> int:
    raise NotImplementedError("stage01: sub — see lab.ipynb §2")


def add(a: int, b: int) -> int:
    raise NotImplementedError("stage01: add — see lab.ipynb §1")
"""
SOLUTION = "def sub(a, b):\n    return a - b\n\n\ndef add(a, b):\n    return a + b\n"
TESTS = {
    "test_01_toy.py": """
def test_sub_is_exact(impl):
    assert impl("stage01_forward_numpy.toy").sub(2, 3) == -1


def test_add_is_exact(impl):
    assert impl("stage01_forward_numpy.toy").add(2, 3) == 5
""",
    "test_01b_toy.py": """
def test_add_of_negatives(impl):
    assert impl("stage01_forward_numpy.toy").add(-2, -3) == -5
""",
}
WRONG = "def add(a, b):\n    return 0\n\n\ndef sub(a, b):\n    return 0\n"
FLIP = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
CONFTEST = """
import pytest


def pytest_addoption(parser):
    parser.addoption("--impl", choices=["student", "solution"], default=None)


@pytest.fixture
def impl():
    from labkit.impl import load

    return load
"""
SANDBOX = sandbox.unavailable()
needs_sandbox = pytest.mark.skipif(SANDBOX is not None, reason=f"no sandbox here: {SANDBOX}")


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A one-module stage 01 with two rows (01 and 01b), a solution, and the course's conftest."""
    root = tmp_path / "course"
    for base, text in (("stage01_forward_numpy", SKELETON), ("solutions/stage01_forward_numpy", SOLUTION)):
        (root / base).mkdir(parents=True)
        (root / base / "__init__.py").write_text("")
        (root / base / "toy.py").write_text(text)
    (root / "solutions" / "__init__.py").write_text("")
    (root / "tests" / "stage01_forward_numpy").mkdir(parents=True)
    for name, text in TESTS.items():
        (root / "tests" / "stage01_forward_numpy" / name).write_text(text)
    (root / "conftest.py").write_text(CONFTEST)  # the course's, without torch: the toy needs only `impl`
    shutil.copy(ROOT / "tests" / "conftest.py", root / "tests")  # the section marks and the handout order
    todo.write_manifest(root, ["stage01_forward_numpy"])  # as the learner edition ships it
    shutil.copy(ROOT / "pyproject.toml", root)
    monkeypatch.setitem(grade.STAGES, "01b", ("stage01_forward_numpy", "toy part 2"))
    return root


def write_learner(course, code: str):
    (course / "stage01_forward_numpy" / "toy.py").write_text(textwrap.dedent(code))


def rows(course, numbers=("01",), timeout=120, submission=None):
    return grade.grade(list(numbers), submission, timeout, source=course)


def test_untouched_stage_is_not_started_with_the_earliest_handout_hint(course):
    (row,) = rows(course)
    assert (row["status"], row["passed"], row["seconds"]) == ("not started", 0, 0.0), row
    assert row["total"] is None, "an untouched stage is reported without collecting (pytest would import torch)"
    assert "stage01: add — see lab.ipynb §1" in row["hint"], "the hint should point to the earliest section (§1)"
    assert "stage01_forward_numpy/toy.py:" in row["hint"], "the hint should name the learner's file and line"


def test_finished_stage_is_complete(course):
    write_learner(course, SOLUTION)
    assert [(r["status"], r["score"]) for r in rows(course, ("01", "01b"))] == [("complete", 100.0)] * 2


def test_part_two_tests_form_their_own_row(course):
    write_learner(course, "def add(a, b):\n    return a + b if a > 0 else 0\n\n\ndef sub(a, b):\n    return a - b\n")
    first, second = rows(course, ("01", "01b"))
    assert (first["status"], first["total"], second["status"], second["total"]) == ("complete", 2, "not started", 1)
    assert [f["test"].rsplit("::", 1)[-1] for f in second["failures"]] == ["test_add_of_negatives"]


def test_only_started_sections_run_and_each_todo_gets_one_line_in_handout_order(course):
    """add (§1) written and right, sub (§2) untouched: test_sub is not started without running, and
    the report's lines follow the handout, not the file."""
    write_learner(
        course, SKELETON.replace('raise NotImplementedError("stage01: add — see lab.ipynb §1")', "return a + b")
    )
    (row,) = rows(course)
    assert (row["status"], row["passed"], row["not_started"]) == ("in progress", 1, 1), row
    assert [(t["section"], t["name"], t["state"]) for t in row["todos"]] == [
        ("§1", "add", "passes"),
        ("§2", "sub", "not started"),
    ]
    assert row["failures"] == [
        {"test": "tests/stage01_forward_numpy/test_01_toy.py::test_sub_is_exact", "message": "not started"}
    ]
    assert row["hint"].startswith("stage01: sub — see lab.ipynb §2  [stage01_forward_numpy/toy.py:"), row["hint"]


def test_a_wrong_answer_is_the_hint_before_a_later_untouched_todo(course):
    """The hint is the first TODO in handout order that is not done, started or not (issue 35)."""
    write_learner(course, SKELETON.replace('raise NotImplementedError("stage01: add — see lab.ipynb §1")', "return 0"))
    (row,) = rows(course)
    assert row["hint"].startswith("§1 add: test_add_is_exact\nAssertionError"), row["hint"]
    assert "assert 0 == 5" in row["hint"], "the failure's own lines should follow"


def test_infinite_loop_is_a_timeout_not_a_hang(course):
    write_learner(course, "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    while True:\n        pass\n")
    (row,) = rows(course, timeout=8)
    assert row["status"] == "timeout", row
    assert {f["test"].rsplit("::", 1)[-1]: f["message"] for f in row["failures"]} == {
        "test_sub_is_exact": "not reached before the time limit"
    }, "add (§1) runs first and passes; sub (§2) hangs"


def test_both_todo_forms_are_found_and_sorted_by_section():
    source = 'def f():\n    raise NotImplementedError("stage05: f — see lab.ipynb §3")\n\n\n'
    source += '@triton.jit\ndef k(x):\n    tl.static_assert(False, "stage05: k — see lab2.ipynb §1")\n'
    assert [msg for _, msg in todo.todos(source)] == ["stage05: f — see lab.ipynb §3", "stage05: k — see lab2.ipynb §1"]
    interpreted = "InterpreterError: AssertionError('stage05: k — see lab2.ipynb §1')"
    assert todo.section(interpreted) == (2, 1) and todo.section("stage05: f — see lab.ipynb §3") == (1, 3)


# --- --submission: the instructor's tool, against the tampering routes of issue 21 -----------------


def learner(attack: str, rest: str = WRONG) -> str:
    return textwrap.dedent(attack) + "\n\n" + rest


def submit(course, tmp_path, code: str, timeout=120) -> dict:
    sub = tmp_path / f"submission-{uuid.uuid4().hex[:6]}"
    (sub / "stage01_forward_numpy").mkdir(parents=True)
    (sub / "stage01_forward_numpy" / "toy.py").write_text(code)
    (row,) = rows(course, submission=sub, timeout=timeout)
    return row


def snapshot(course) -> dict:
    return {str(p): p.read_bytes() for p in course.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@needs_sandbox
def test_honest_submission_is_complete_and_a_wrong_one_fails(course, tmp_path):
    assert submit(course, tmp_path, SOLUTION)["status"] == "complete"
    wrong = submit(course, tmp_path, WRONG)
    assert (wrong["status"], wrong["passed"]) == ("in progress", 0), wrong


@needs_sandbox
def test_planting_a_conftest_in_the_instructors_course_fails_and_writes_nothing(course, tmp_path):
    attack = f"""
        import os, pathlib
        for base in [{str(course)!r}, os.readlink(f"/proc/{{os.getppid()}}/cwd"), os.getcwd()]:
            for sub in ("tests", "tests/stage01_forward_numpy", "."):
                try:
                    (pathlib.Path(base) / sub / "conftest.py").write_text({FLIP!r})
                except OSError:
                    pass
    """
    before = snapshot(course)
    row = submit(course, tmp_path, learner(attack))
    assert row["passed"] == 0, row
    assert snapshot(course) == before, "the submission wrote into the instructor's course"
    later = submit(course, tmp_path, WRONG)
    assert later["passed"] == 0, "a later grading was affected"
    # A TODO raised in the worker comes back with the learner's line: sub calls add, which is untouched.
    calls = SKELETON.replace('raise NotImplementedError("stage01: sub — see lab.ipynb §2")', "return add(a, -b)")
    sub = next(t for t in submit(course, tmp_path, calls)["todos"] if t["name"] == "sub")
    assert "stage01: add — see lab.ipynb §1 at stage01_forward_numpy/toy.py:7" in sub["message"], sub


@needs_sandbox
@pytest.mark.parametrize(
    "attack",
    [
        "from solutions.stage01_forward_numpy.toy import *\n",
        "import importlib\nglobals().update(vars(importlib.import_module('solu' + 'tions.stage01_forward_numpy.toy')))\n",
        "import importlib.util as u\n"
        "s = u.spec_from_file_location('t', {course!r} + '/solutions/stage01_forward_numpy/toy.py')\n"
        "m = u.module_from_spec(s)\ns.loader.exec_module(m)\nadd, sub = m.add, m.sub\n",
    ],
    ids=["import", "dynamic-import", "by-path"],
)
def test_importing_the_reference_scores_zero(course, tmp_path, attack):
    row = submit(course, tmp_path, attack.format(course=str(course)))
    assert row["passed"] == 0, row
    if "import *" in attack:
        assert "imports from `solutions`" in row["hint"], row["hint"]


PLANT_HOOK = """
    import gc, pytest
    config = next(o for o in gc.get_objects() if type(o).__name__ == "Config" and hasattr(o, "pluginmanager"))

    class Flip:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            outcome = yield
            outcome.get_result().outcome = "passed"

    config.pluginmanager.register(Flip(), "flip")
"""
# Passing records for every canonical ID, written at import and again at call time into every
# file descriptor the code can open: its own, its parent's, any process's it can see; and, at
# call time, pytest's report class patched so that every report says "passed".
FORGE = """
    import json, os

    IDS = [f"tests/stage01_forward_numpy/test_01_toy.py::test_{name}_is_exact" for name in ("add", "sub")]
    RECORDS = "".join(json.dumps({"id": i, "outcome": "passed", "message": ""}) + "\\n" for i in IDS).encode()


    def forge():
        for pid in ["self", str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    with open(f"/proc/{pid}/fd/{fd}", "wb", buffering=0) as f:
                        f.write(RECORDS)
                except OSError:
                    pass


    def add(a, b):
        forge()
        import _pytest.reports

        _pytest.reports.TestReport.outcome = property(lambda self: "passed", lambda self, value: None)
        return 0


    def sub(a, b):
        forge()
        return 0


    forge()
"""


def test_the_test_process_reads_no_pickled_code_from_the_worker():
    """What the worker sends is data: a pickled global (here os.system) or an object to unpickle
    is refused before anything runs."""
    trusted = worker.Peer.__new__(worker.Peer)
    trusted.trusted, trusted.objects = True, {}
    with pytest.raises(pickle.UnpicklingError):
        worker._NoGlobals(io.BytesIO(pickle.dumps(("ok", os.system, [])))).load()
    with pytest.raises(worker.WorkerError):
        trusted.decode(("pickle", pickle.dumps(os.system)))


def test_results_cross_as_data_with_their_types_and_strides():
    """NumPy scalars (a float subclass), a transposed tensor (a wrapper that rejects non-contiguous
    input must see one) and a random generator's state arrive as they left."""
    import torch

    worker_end, tests_end = worker.Peer.__new__(worker.Peer), worker.Peer.__new__(worker.Peer)
    worker_end.trusted, tests_end.trusted = False, True
    rng = np.random.default_rng(3)
    for value in [np.float64(1.5), np.int8(-3), torch.arange(6.0).reshape(2, 3).t(), rng]:
        message = worker._NoGlobals(io.BytesIO(pickle.dumps(worker_end.encode(value)))).load()
        got = tests_end.decode(message)
        assert type(got) is type(value), (value, got)
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, value) and got.stride() == value.stride(), got
        elif isinstance(value, np.random.Generator):
            assert got.integers(1 << 30) == rng.integers(1 << 30)
        else:
            assert got == value


@needs_sandbox
def test_a_pytest_hook_planted_from_the_module_finds_no_pytest(course, tmp_path):
    """The learner's module is imported in the worker: there is no pytest there to hook."""
    row = submit(course, tmp_path, learner(PLANT_HOOK))
    assert row["passed"] == 0, row


def mark_in_process(course, test: str = ""):
    """Mark the toy's test file (or one test) `in_process`, as stage 04's are."""
    path = course / "tests" / "stage01_forward_numpy" / "test_01_toy.py"
    text = path.read_text()
    if test:
        text = text.replace(f"def {test}(", f"@pytest.mark.in_process('the toy')\ndef {test}(")
    else:
        text += "\npytestmark = pytest.mark.in_process('the toy, as if it were stage 04')\n"
    path.write_text("import pytest\n" + text)


@needs_sandbox
def test_in_process_tests_still_zero_the_row_on_a_planted_hook(course, tmp_path):
    """The fallback for tests that cannot use a worker (README, threat model) keeps its tamper check."""
    mark_in_process(course)
    row = submit(course, tmp_path, learner(PLANT_HOOK))
    assert (row["status"], row["passed"]) == ("tampered", 0), row


@needs_sandbox
def test_outcomes_forged_into_any_file_descriptor_or_by_patching_pytest_count_for_nothing(course, tmp_path):
    row = submit(course, tmp_path, textwrap.dedent(FORGE))
    assert (row["passed"], row["total"]) == (0, 2), row


@needs_sandbox
def test_a_result_that_claims_to_equal_anything_fails(course, tmp_path):
    attack = """
        class Anything:
            def __eq__(self, other):
                return True

            __hash__ = object.__hash__


        def add(a, b):
            return Anything()


        def sub(a, b):
            return Anything()
    """
    assert submit(course, tmp_path, textwrap.dedent(attack))["passed"] == 0


@needs_sandbox
def test_an_in_process_run_cannot_forge_the_outcome_of_a_worker_test(course, tmp_path):
    """test_add runs in-process, where the code can reach the pipe (README); test_sub runs against a
    worker, and the in-process run's forged record for it must not count."""
    mark_in_process(course, "test_add_is_exact")
    row = submit(course, tmp_path, textwrap.dedent(FORGE))
    assert "tests/stage01_forward_numpy/test_01_toy.py::test_sub_is_exact" in [f["test"] for f in row["failures"]], row


@needs_sandbox
def test_rewriting_the_report_at_exit_changes_nothing(course, tmp_path):
    attack = """
        import atexit, sys

        def forge():
            for arg in sys.argv:
                if arg.startswith("--junitxml="):
                    open(arg.split("=", 1)[1], "w").write('<testsuite><testcase name="t"/></testsuite>')

        atexit.register(forge)
    """
    assert submit(course, tmp_path, learner(attack))["passed"] == 0


@needs_sandbox
def test_a_forged_report_and_an_early_exit_fail_every_test_not_yet_reported(course, tmp_path):
    attack = """
        import os, sys
        for arg in sys.argv + ["--junitxml=junit.xml"]:
            if arg.startswith("--junitxml="):
                try:
                    open(arg.split("=", 1)[1], "w").write('<testsuite><testcase classname="x" name="t"/></testsuite>')
                except OSError:
                    pass
        os._exit(0)
    """
    row = submit(course, tmp_path, learner(attack))
    assert (row["status"], row["passed"], row["total"]) == ("crashed", 0, 2), row
    assert "ended" in row["hint"], row["hint"]


@needs_sandbox
def test_a_test_skipped_from_the_module_counts_as_failed(course, tmp_path):
    attack = """
        import pytest


        def add(a, b):
            pytest.skip("not today")


        def sub(a, b):
            return a - b
    """
    row = submit(course, tmp_path, learner(attack, ""))
    assert (row["status"], row["passed"], row["total"]) == ("in progress", 1, 2), row


OPTIONAL_TESTS = """
import pytest


@pytest.fixture(scope="module")
def absent():
    return pytest.importorskip("labkit_absent_package")


def test_needs_a_package_in_the_test(impl):
    pytest.importorskip("labkit_absent_package.sub")


def test_needs_a_package_in_a_fixture(impl, absent):
    pass


def test_needs_it_too(impl, absent):
    pass
"""


def toy_records(course) -> dict[str, dict]:
    """The grader's outcome records of the toy's row 01, run as make grade runs it (in-process), by test name."""
    files = grade.row_tests(course, "01")
    env = os.environ | {"LABS_IMPL": "student", "PYTHONPATH": str(course)}
    records, _ = grade.run_row(course, files, env, 120, None)
    return {r["id"].rsplit("::", 1)[-1]: r for r in records if "id" in r}


def test_a_missing_optional_package_is_reported_as_needed_not_as_the_learners_failure(course):
    """pytest.importorskip in a course test or fixture, for a package the machine lacks (llguidance without
    `make guided`), is reported as what to install; the row stays complete (issue 62)."""
    (course / "tests" / "stage01_forward_numpy" / "test_01_optional.py").write_text(OPTIONAL_TESTS)
    write_learner(course, SOLUTION)
    (row,) = rows(course)
    assert (row["status"], row["passed"], row["total"], row["skipped"]) == ("complete", 2, 2, 3), row
    want = "needs labkit_absent_package (pip install labkit_absent_package); not graded"
    assert row["skipped_because"] == [want], row["skipped_because"]  # make grade STAGE=NN prints it
    records = toy_records(course)
    for name in ("test_needs_a_package_in_the_test", "test_needs_a_package_in_a_fixture", "test_needs_it_too"):
        assert records[name]["outcome"] == "skipped", records[name]
        want = "needs labkit_absent_package (pip install labkit_absent_package)"
        assert records[name]["message"].startswith(want), records[name]


def test_the_make_targets_of_the_optional_packages_are_named():
    from labkit.grading.outcomes import OPTIONAL

    assert OPTIONAL == {"llguidance": "make guided", "xgrammar": "make guided", "llama_cpp": "make llamacpp"}
    makefile = (ROOT / "Makefile").read_text()
    for target in set(OPTIONAL.values()):
        assert re.search(rf"^{target.split()[1]}:", makefile, re.M), f"the Makefile has no {target!r}"


def test_waiting_on_a_todo_of_another_notebook_names_that_notebook():
    """lab4's TODO waiting on lab.ipynb §5's warp reads "lab.ipynb §5 warp", not "§5 warp" (lab4's own §5?)."""
    case = {"todo": "stage06: warp — see lab.ipynb §5", "outcome": "failed"}
    assert progress.waiting_label(case, 4) == "lab.ipynb §5 warp"
    assert progress.waiting_label(case, 1) == progress.waiting_label(case) == "§5 warp"
    other = {"todo": "stage06: verify_batch — see lab2.ipynb §2", "outcome": "failed"}
    assert progress.waiting_label(other, 4) == "lab2.ipynb §2 verify_batch"
    assert progress.waiting_label(other, 2) == "lab2 §2 verify_batch"


def test_a_skip_raised_by_the_learners_code_still_fails(course):
    """The same importorskip, called from the learner's module, counts as the code under test's failure: only
    the course's tests and fixtures may ask for an optional package."""
    code = "import pytest\n\n\ndef add(a, b):\n    pytest.importorskip('labkit_absent_package')\n    return a + b\n"
    write_learner(course, code + "\n\ndef sub(a, b):\n    return a - b\n")
    (row,) = rows(course)
    assert (row["passed"], row["total"], row["skipped"]) == (1, 2, 0), row
    (failure,) = row["failures"]
    assert failure["test"].endswith("test_add_is_exact") and "only the course's markers may" in failure["message"]


@needs_sandbox
def test_no_process_outlives_its_grading(course, tmp_path):
    token = f"grader-test-{uuid.uuid4().hex}"
    attack = f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", {token!r}], start_new_session=True)
    """
    submit(course, tmp_path, learner(attack))
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            alive += [pid] if token in open(f"/proc/{pid}/cmdline").read() else []
        except OSError:
            continue
    assert not alive, f"processes started by the submission outlived its grading: {alive}"


@needs_sandbox
def test_failure_messages_carry_no_file_contents(course, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET line one\n" + "TOPSECRET more\n" * 50)
    attack = f"""
        def add(a, b):
            raise ValueError(open({str(secret)!r}).read())


        def sub(a, b):
            return open({str(secret)!r}).read()


        class TopSecretError(Exception):
            pass
    """
    row = submit(course, tmp_path, learner(attack, ""))
    assert row["passed"] == 0
    assert "TOPSECRET" not in json.dumps(row), json.dumps(row)[:2000]


@pytest.mark.slow
@needs_sandbox
@pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="the learner edition has no solutions to submit")
def test_the_reference_solution_submitted_as_a_submission_is_complete(tmp_path):
    """A whole row, sandboxed, as an instructor grades it: 02b has tests of both routes, most
    against the worker and one in-process (marked `in_process`)."""
    shutil.copytree(ROOT / "solutions" / "stage02_kv_cache", tmp_path / "stage02_kv_cache")
    tests = grade.collect(ROOT, ["02b"], os.environ | {"PYTHONPATH": str(ROOT)})["02b"]
    assert {t["in_process"] for t in tests} == {True, False}, "02b no longer has both routes"
    (row,) = grade.grade(["02b"], tmp_path, timeout=600)
    assert (row["status"], row["passed"]) == ("complete", row["total"]), row


# --- the learner's first hour (issue 35): the grader shows each failure's own message -------------


def planted_course(tmp_path, stage: str = "01") -> tuple[object, list]:
    """A copy of the course whose stage folder holds the solution with one catalogued learner bug in each
    handout section (plus the causal mask's offset bug), and the skeleton's TODO list as the edition ships it.
    Returns (the copy, the planted mutants)."""
    from labkit import STAGES
    from labkit.grading import mutants

    folder = STAGES[stage][0]
    course = tmp_path / "course"
    skip = shutil.ignore_patterns(".venv", ".git", "__pycache__", "bench_results", "*.ipynb", ".grade", ".ruff_cache")
    shutil.copytree(ROOT, course, ignore=skip)
    todo.write_manifest(course, [folder])
    sections = {name: sec for found in todo.stage_todos(ROOT, folder).values() for name, sec in found}
    texts = {p.name: p.read_text() for p in (ROOT / "solutions" / folder).glob("*.py") if p.name != "__init__.py"}
    planted, seen = [], set()
    for m in mutants.load(stage):
        text = texts[m.file]
        if m.find not in text:
            continue  # an earlier planted edit changed these lines
        line = text[: text.index(m.find)].count("\n") + 1
        function = next(
            (
                n.name
                for n in ast.parse(text).body
                if isinstance(n, ast.FunctionDef) and n.lineno <= line <= n.end_lineno
            ),
            None,
        )
        section = sections.get(function)
        causal = "causal mask ignores the offset" in m.bug
        if m.equivalent or section is None or (section in seen and not causal):
            continue
        seen.add(section)
        texts[m.file] = text.replace(m.find, m.replace)
        planted.append((m, function))
    for name, text in texts.items():
        (course / folder / name).write_text(text)
    return course, planted


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="plants bugs in the solutions, which the edition lacks")
def test_make_grade_shows_each_planted_bugs_own_assertion_message(tmp_path):
    """One catalogued bug per stage 01 section, all at once: every failing TODO's line carries the
    test's own words (more than the exception's name, as pytest prints them), each bug shows in its
    section or a later one, and the causal mask's offset bug shows the query positions."""
    course, planted = planted_course(tmp_path)
    env = os.environ | {"PYTHONPATH": str(course), "OMP_NUM_THREADS": "1"}
    env.pop("LABS_IMPL", None)
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "labkit.grading.grade", "--stage", "01", "--json", str(report)]
    out = subprocess.run(cmd, cwd=course, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {t["name"]: t for t in json.loads(report.read_text())["stages"][0]["todos"]}
    assert len(planted) >= 10, [m.name for m, _ in planted]
    failing = [t for t in lines.values() if t["state"] == "fails"]
    for m, function in planted:  # caught by its section's tests, or by a later section's (rms_norm's eps: §9)
        k = int(lines[function]["section"].lstrip("§"))
        assert any(int(t["section"].lstrip("§")) >= k for t in failing), f"{m.name} ({m.bug}) shows nowhere"
    for line in failing:
        words = [w for w in line["message"].splitlines() if w.strip() and not re.fullmatch(r"\w+Error:?", w.strip())]
        assert words, f"{line['name']}: only the exception's name reached the report: {line['message']!r}"
        assert all(w[:150] in out.stdout for w in words[:3]), f"{line['name']}: {words[:3]} not in the output"
    assert "Tq=3 queries at positions 8..10" in out.stdout, out.stdout[-4000:]


def test_the_instructors_report_does_not_end_with_the_learners_next_step(capsys):
    row = {"stage": "01", "folder": "stage01_forward_numpy", "passed": 1, "total": 1, "score": 100.0}
    grade.print_table([row | {"status": "complete", "hint": "", "todos": []}], verbose=False, learner=False)
    assert "lab.ipynb" not in capsys.readouterr().out
    grade.print_table([row | {"status": "complete", "hint": "", "todos": []}], verbose=False)
    assert "Work a stage in its lab.ipynb" in capsys.readouterr().out


# --- the edit-check loop (issue 45) ----------------------------------------------------------------

MIXED = """
def test_sub_then_add(impl):
    toy = impl("stage01_forward_numpy.toy")
    assert toy.add(toy.sub(5, 3), 1) == 3
"""


def test_a_failure_raised_by_another_todo_waits_on_it_apart_from_the_learners_own(course):
    """sub (§2) written, add (§1) untouched: a §2 test that also calls add fails on add's
    NotImplementedError, which is add's to fix. It counts as waiting on §1 add, apart; sub's own
    failure is the one its line shows, and `pytest -x -m s2` runs sub's own test first."""
    (course / "tests" / "stage01_forward_numpy" / "test_01_toy.py").write_text(MIXED + TESTS["test_01_toy.py"])
    write_learner(course, SKELETON.replace('raise NotImplementedError("stage01: sub — see lab.ipynb §2")', "return 0"))
    (row,) = rows(course)
    sub = next(t for t in row["todos"] if t["name"] == "sub")
    assert (sub["state"], sub["failed"], sub["waiting"], sub["waiting_on"]) == ("fails", 1, 1, "§1 add"), sub
    assert sub["test"] == "test_sub_is_exact", "the learner's own failure is the one shown"
    assert "1 waiting on §1 add" in progress.todo_line(sub)

    write_learner(
        course, SKELETON.replace('raise NotImplementedError("stage01: sub — see lab.ipynb §2")', "return a - b")
    )
    (row,) = rows(course)
    sub = next(t for t in row["todos"] if t["name"] == "sub")
    assert (sub["state"], sub["failed"], sub["waiting"]) == ("waiting", 0, 1), sub
    assert "waiting on §1 add" in progress.todo_line(sub) and "✗" not in progress.todo_line(sub)
    assert "stage01: add — see lab.ipynb §1" in row["hint"], "the hint is still the untouched TODO"

    env = os.environ | {"PYTHONPATH": str(course)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-m", "s2", "-p", "no:cacheprovider"],
        cwd=course,
        env=env,
        capture_output=True,
        text=True,
    )
    ids = [line.rsplit("::", 1)[-1] for line in out.stdout.splitlines() if "::" in line]
    assert ids == ["test_sub_is_exact", "test_sub_then_add"], out.stdout + out.stderr


@pytest.mark.slow
def test_every_rows_tests_run_in_handout_order():
    """`pytest -x` on any row stops at the first failure in handout order: notebook, then section
    (07b's lab2 before its lab5, 04b's lab2 before its lab3, stage 07 opens on §1), and within a
    section the tests of its own TODOs before those that also need another section's."""
    from labkit import STAGES, row_of

    collected = grade.collect(ROOT, list(STAGES), os.environ | {"PYTHONPATH": str(ROOT)})
    for number, tests in collected.items():
        found = [(n, s) for f in todo.stage_todos(ROOT, STAGES[number][0]).values() for n, s in f]
        # a name may be a TODO of two parts (02's and 02b's kv_bytes_per_token): the row's own section counts
        sections = {n: tuple(s) for n, s in found if row_of(number[:2], s[0]) == number}
        keys = []
        for t in tests:
            section = tuple(t["section"]) if t["section"] else (10**6, 0)
            keys.append((section, any(sections[n] != section for n in t["todos"])))
        wrong = next((i for i in range(1, len(keys)) if keys[i] < keys[i - 1]), None)
        assert wrong is None, f"row {number}: {tests[wrong]['id']} {keys[wrong]} runs after {keys[wrong - 1]}"
    assert collected["07"][0]["section"] == [1, 1], f"stage 07's -x opens on {collected['07'][0]['id']}"


def test_a_sections_check_imports_no_test_file_of_other_sections(course):
    """`pytest -m s1` reads which section each test is of from the files' text: a file with no §1 test
    is never imported (stage 01's files import transformers and build models, seconds a §1 check
    does not need). A file whose tests are not all plain defs is imported, as before."""
    tests = course / "tests" / "stage01_forward_numpy"
    (tests / "test_01_toy.py").write_text(TESTS["test_01_toy.py"].replace("def test_sub_is_exact", "def _sub"))
    heavy = 'raise RuntimeError("imported")\n\n\ndef test_sub(impl):\n    impl("stage01_forward_numpy.toy").sub\n'
    (tests / "test_01_heavy.py").write_text(heavy)
    write_learner(course, SOLUTION)
    env = os.environ | {"PYTHONPATH": str(course)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    for marks, ok in (("s1", True), ("s1 and not slow", True), ("s2", False), ("not s1", False)):
        out = subprocess.run([*cmd, "-m", marks], cwd=course, env=env, capture_output=True, text=True)
        assert (out.returncode == 0) == ok, f"-m {marks!r}: {out.stdout[-1500:]}"
    (tests / "test_01_heavy.py").write_text(heavy + "\n\ntest_alias = test_sub\n")
    out = subprocess.run([*cmd, "-m", "s1"], cwd=course, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "imported" in out.stdout, "a test bound by assignment must not be pruned"


@pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="plants a bug in the solutions, which the edition lacks")
def test_stage01_mask_offset_bug_fails_attention_weights_own_tests(tmp_path):
    """The causal mask that ignores Tk - Tq (right only when Tq = Tk) is attention_weights's bug: the
    grade must show it on attention_weights's line, not only on attention's, which calls it."""
    from labkit.grading import mutants

    (bug,) = [m for m in mutants.load("01") if "ignores the offset" in m.bug]
    course = tmp_path / "course"
    skip = shutil.ignore_patterns(".venv", ".git", "__pycache__", "bench_results", "*.ipynb", "solutions", "*.png")
    shutil.copytree(ROOT, course, ignore=skip)
    text = (ROOT / "solutions" / "stage01_forward_numpy" / bug.file).read_text()
    (course / "stage01_forward_numpy" / bug.file).write_text(text.replace(bug.find, bug.replace))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/stage01_forward_numpy/test_01_gpt2.py",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    env = os.environ | {"PYTHONPATH": str(course), "LABS_IMPL": "student"}
    out = subprocess.run([*cmd, "-k", "attention_weights"], cwd=course, env=env, capture_output=True, text=True)
    assert out.returncode == 1 and " failed" in out.stdout, out.stdout[-2000:]


@pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="runs the reference in a worker")
def test_kept_leaves_a_result_in_the_worker_and_passes_a_handle(monkeypatch):
    """labkit.testing.kept: stage 01's real-model tests keep the 540 MB params dict in the worker; what crosses
    is a handle, which the worker resolves to its own dict when a test passes it back."""
    from labkit import TARGET
    from labkit.testing import kept

    monkeypatch.setenv("LABS_IMPL", "solution")
    mod = worker.load("stage01_forward_numpy.llama_numpy")
    try:
        params = kept(mod.load_llama_params, TARGET)
        assert isinstance(params, worker.Remote), f"the params crossed by value: {type(params)}"
        logits = mod.llama_forward(params, np.array([1, 5, 9]))
        assert logits.shape == (3, 2048), logits.shape
    finally:
        worker._worker["proc"].kill()
    assert kept(lambda x: x + 1, 1) == 2, "in-process, kept is the call itself"


def test_a_row_whose_own_todos_are_untouched_is_not_started_though_the_other_part_is(course):
    """Part 1 done, part 2 untouched: row 01b is reported not started without running its tests (an instructor's
    --submission once ran every such row for a minute and more, its tests failing only on part 2's TODOs)."""
    part2 = '\n\ndef mul(a: int, b: int) -> int:\n    raise NotImplementedError("stage01: mul — see lab2.ipynb §1")\n'
    (course / "stage01_forward_numpy" / "toy.py").write_text(SKELETON + part2)
    todo.write_manifest(course, ["stage01_forward_numpy"])
    write_learner(course, SOLUTION + part2)
    first, second = rows(course, ("01", "01b"))
    assert (first["status"], second["status"], second["total"]) == ("complete", "not started", None), second


def test_a_section_without_todos_waits_for_its_notebook(course):
    """Part 2 with lab2 §1 (mul) written and lab3 §1 (div) untouched: a test of lab3 §2, a section without a TODO
    of its own (stage 07's disaggregated fleet, lab5 §2, runs on lab5 §1's connector), is not started, not run and
    counted, though it would pass; once a lab3 TODO is started it runs."""
    part2 = (
        '\n\ndef mul(a: int, b: int) -> int:\n    raise NotImplementedError("stage01: mul — see lab2.ipynb §1")\n'
        '\n\ndef div(a: int, b: int) -> int:\n    raise NotImplementedError("stage01: div — see lab3.ipynb §1")\n'
    )
    (course / "stage01_forward_numpy" / "toy.py").write_text(SKELETON + part2)
    todo.write_manifest(course, ["stage01_forward_numpy"])
    tests = course / "tests" / "stage01_forward_numpy"
    (tests / "test_01b_toy.py").write_text(
        'def test_mul(impl):\n    assert impl("stage01_forward_numpy.toy").mul(2, 3) == 6\n'
    )
    (tests / "test_01b_lab3.py").write_text(
        '"""§2 of lab3.ipynb: given code only."""\n\n\ndef test_given(impl):\n'
        '    assert impl("stage01_forward_numpy.toy").add(2, 3) == 5\n'
    )
    mul = "\n\ndef mul(a, b):\n    return a * b\n"
    div = '\n\ndef div(a: int, b: int) -> int:\n    raise NotImplementedError("stage01: div — see lab3.ipynb §1")\n'
    write_learner(course, SOLUTION + mul + div)
    (row,) = rows(course, ("01b",))
    given = "tests/stage01_forward_numpy/test_01b_lab3.py::test_given"
    assert (row["passed"], row["total"], row["not_started"]) == (1, 2, 1), row
    assert row["failures"] == [{"test": given, "message": "not started"}], row["failures"]
    write_learner(course, SOLUTION + mul + "\n\ndef div(a, b):\n    return a // b\n")
    (row,) = rows(course, ("01b",))
    assert (row["passed"], row["total"], row["not_started"]) == (2, 2, 0), row


def test_the_json_report_says_what_was_graded_when_and_how(tmp_path, capsys):
    report = tmp_path / "report.json"
    assert grade.main(["--stage", "01", "--json", str(report)]) == 0
    meta = json.loads(report.read_text())
    assert set(meta) == {"date", "course_commit", "submission", "sandboxed", "stages"}, meta.keys()
    assert (meta["submission"], meta["sandboxed"]) == (None, False)
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", meta["course_commit"] or ""), meta["course_commit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"]), meta["date"]
