"""A stage's second part, end to end on a toy course: lab2.ipynb, test_02b_* tests, grader row 02b.

The toy course carries a copy of labkit whose STAGES has rows 02 and 02b, and the course's own
guarantee tests, which must accept TODOs that point to lab2.ipynb and check every notebook.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from labkit import ROOT
from labkit.grading import todo

NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {},
            "outputs": [],
            "source": ["from labkit.impl import load\n", "print(load('stage02_kv_cache.{module}').{name}(2))"],
        }
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}
MODULES = {  # module -> (function, TODO message, solution body)
    "toy": ("double", "stage02: double — see lab.ipynb §1", "return 2 * x"),
    "toy2": ("square", "stage02: square — see lab2.ipynb §1", "return x * x"),
}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts") / "course"
    shutil.copytree(ROOT / "labkit", root / "labkit", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    init = root / "labkit" / "__init__.py"
    rows = (
        'STAGES = {\n    "02": ("stage02_kv_cache", "toy part 1"),\n    "02b": ("stage02_kv_cache", "toy part 2"),\n}'
    )
    init.write_text(re.sub(r"STAGES = \{.*?\n\}", rows, init.read_text(), flags=re.S))
    for name in ("conftest.py", "pyproject.toml", "tests/meta/test_guarantees.py"):
        write(root / name, (ROOT / name).read_text())
    write(root / "stage02_kv_cache" / "__init__.py", '"""Toy stage."""\n')
    share = "\n\nfrom labkit.impl import share_given_modules\n\nshare_given_modules(__path__, __name__)\n"
    write(root / "solutions" / "__init__.py", "")
    write(root / "solutions" / "stage02_kv_cache" / "__init__.py", '"""Toy stage."""\n' + share)
    for module, (name, message, body) in MODULES.items():
        head = f'def {name}(x: int) -> int:\n    """{name} of x."""\n'
        write(root / "stage02_kv_cache" / f"{module}.py", f'{head}    raise NotImplementedError("{message}")\n')
        write(root / "solutions" / "stage02_kv_cache" / f"{module}.py", f"{head}    {body}\n")
        notebook = json.dumps(NOTEBOOK).replace("{module}", module).replace("{name}", name)
        write(root / "stage02_kv_cache" / ("lab.ipynb" if module == "toy" else "lab2.ipynb"), notebook)
    write(
        root / "tests" / "stage02_kv_cache" / "test_02_toy.py",
        "def test_double(impl):\n    assert impl('stage02_kv_cache.toy').double(3) == 6\n",
    )
    write(
        root / "tests" / "stage02_kv_cache" / "test_02b_toy.py",
        "def test_square(impl):\n    assert impl('stage02_kv_cache.toy2').square(3) == 9\n",
    )
    todo.write_manifest(root, ["stage02_kv_cache"])  # the TODO list the course ships (tests/todos.json)
    return root


def run(course, *args):
    env = os.environ | {"PYTHONPATH": str(course), "OMP_NUM_THREADS": "1"}
    env.pop("LABS_IMPL", None)
    return subprocess.run([sys.executable, *args], cwd=course, env=env, capture_output=True, text=True, timeout=900)


def test_guarantees_accept_lab2_todos_and_run_every_notebook(course):
    out = run(course, "-m", "pytest", "tests/meta/test_guarantees.py", "-v", "-p", "no:cacheprovider")
    assert out.returncode == 0, out.stdout[-4000:]
    for notebook in ("lab.ipynb", "lab2.ipynb"):
        assert re.search(rf"test_notebook_runs_top_to_bottom_against_the_solution\[\S*{notebook}\] PASSED", out.stdout)
        assert re.search(rf"test_notebook_is_committed_without_outputs\[\S*{notebook}\] PASSED", out.stdout)


def test_a_todo_pointing_to_a_missing_notebook_is_caught(course, tmp_path):
    skeleton = course / "stage02_kv_cache" / "toy2.py"
    text = skeleton.read_text()
    try:
        skeleton.write_text(text.replace("lab2.ipynb", "lab3.ipynb"))
        out = run(course, "-m", "pytest", "tests/meta/test_guarantees.py", "-q", "-k", "todo_messages")
    finally:
        skeleton.write_text(text)
    assert out.returncode == 1 and "lab3.ipynb" in out.stdout, out.stdout[-2000:]


def test_part_two_is_its_own_grader_row(course, tmp_path):
    out = run(course, "-m", "labkit.grading.grade", "--stage", "2b", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (row,) = json.loads((tmp_path / "r.json").read_text())["stages"]
    assert (row["stage"], row["status"], row["total"]) == ("02b", "not started", None), row  # nothing started
    assert "stage02: square — see lab2.ipynb §1" in row["hint"], row["hint"]
