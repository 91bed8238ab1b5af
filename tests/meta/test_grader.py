"""The grader on a toy course: untouched, finished, and stuck in an infinite loop."""

import shutil
import textwrap

import pytest

from labkit import ROOT, grade

SKELETON = '''
def add(a: int, b: int) -> int:
    """a + b"""
    raise NotImplementedError("stage01: add — see lab.ipynb §1")
'''
TEST = """
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


def write_learner(course, body: str):
    code = f"def add(a: int, b: int) -> int:\n{textwrap.indent(body, '    ')}\n"
    (course / "stage01_forward_numpy" / "toy.py").write_text(code)


def test_untouched_stage_is_not_started_with_the_handout_hint(course):
    row = grade.grade_stage(course, "01", timeout=120, verbose=False)
    assert (row["status"], row["passed"], row["total"]) == ("not started", 0, 1)
    assert "stage01: add — see lab.ipynb §1" in row["hint"]
    assert "stage01_forward_numpy/toy.py:" in row["hint"], "the hint should name the learner's file and line"


def test_finished_stage_is_complete(course):
    write_learner(course, "return a + b")
    row = grade.grade_stage(course, "01", timeout=120, verbose=False)
    assert (row["status"], row["score"]) == ("complete", 100.0)


def test_wrong_answer_is_in_progress_with_the_assertion(course):
    write_learner(course, "return a - b")
    row = grade.grade_stage(course, "01", timeout=120, verbose=True)
    assert row["status"] == "in progress" and row["failures"]


def test_infinite_loop_is_a_timeout_not_a_hang(course):
    write_learner(course, "while True:\n    pass")
    row = grade.grade_stage(course, "01", timeout=8, verbose=False)
    assert row["status"] == "timeout"


def test_unbuilt_stage_is_coming(course):
    row = grade.grade_stage(course, "06", timeout=60, verbose=False)
    assert row["status"] == "coming"
