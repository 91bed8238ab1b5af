"""The grader on a toy course: untouched, finished, and stuck in an infinite loop."""

import shutil
import textwrap

import pytest

from labkit import ROOT, grade

SKELETON = """
def sub(a: int, b: int) -> int:
    raise NotImplementedError("stage01: sub — see lab.ipynb §2")


def add(a: int, b: int) -> int:
    raise NotImplementedError("stage01: add — see lab.ipynb §1")
"""
TEST = """
def test_sub_is_exact(impl):
    assert impl("stage01_forward_numpy.toy").sub(2, 3) == -1


def test_add_is_exact(impl):
    assert impl("stage01_forward_numpy.toy").add(2, 3) == 5
"""


@pytest.fixture
def course(tmp_path):
    root = tmp_path / "course"
    (root / "stage01_forward_numpy").mkdir(parents=True)
    (root / "stage01_forward_numpy" / "__init__.py").write_text("")
    (root / "stage01_forward_numpy" / "toy.py").write_text(SKELETON)
    (root / "tests" / "stage01_forward_numpy").mkdir(parents=True)
    (root / "tests" / "stage01_forward_numpy" / "test_toy.py").write_text(TEST)
    shutil.copy(ROOT / "conftest.py", root)
    return root


def write_learner(course, add: str, sub: str = "return a - b"):
    code = "".join(
        f"def {name}(a: int, b: int) -> int:\n{textwrap.indent(body, '    ')}\n\n\n"
        for name, body in (("add", add), ("sub", sub))
    )
    (course / "stage01_forward_numpy" / "toy.py").write_text(code)


def test_untouched_stage_is_not_started_with_the_earliest_handout_hint(course):
    row = grade.grade_stage(course, "01", timeout=120, verbose=False)
    assert (row["status"], row["passed"], row["total"]) == ("not started", 0, 2)
    assert "stage01: add — see lab.ipynb §1" in row["hint"], "the hint should point to the earliest section (§1)"
    assert "stage01_forward_numpy/toy.py:" in row["hint"], "the hint should name the learner's file and line"


def test_finished_stage_is_complete(course):
    write_learner(course, add="return a + b")
    row = grade.grade_stage(course, "01", timeout=120, verbose=False)
    assert (row["status"], row["score"]) == ("complete", 100.0)


def test_half_done_stage_is_in_progress_and_lists_the_failure(course):
    write_learner(course, add="return a + b", sub="return b - a")
    row = grade.grade_stage(course, "01", timeout=120, verbose=True)
    assert (row["status"], row["passed"]) == ("in progress", 1)
    assert [f["test"].rsplit("::", 1)[-1] for f in row["failures"]] == ["test_sub_is_exact"]


def test_infinite_loop_is_a_timeout_not_a_hang(course):
    write_learner(course, add="while True:\n    pass")
    row = grade.grade_stage(course, "01", timeout=8, verbose=False)
    assert row["status"] == "timeout"


def test_unbuilt_stage_is_coming(course):
    row = grade.grade_stage(course, "06", timeout=60, verbose=False)
    assert row["status"] == "coming"
