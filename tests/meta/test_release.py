"""The learner edition (labkit.grading.release): built into a temporary folder, it holds no answer and grades.

Skipped inside a learner edition, which has no solutions to leave out.
"""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from labkit import ROOT, STAGES
from labkit.grading import release, todo

pytestmark = pytest.mark.skipif(
    not (ROOT / "solutions").is_dir() or not (ROOT / ".git").exists(),
    reason="the edition is built from the instructors' repository (solutions/ and git)",
)


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    out = tmp_path_factory.mktemp("edition") / "course"
    out.mkdir()
    release.write_edition(out, allow_dirty=True)
    return out


def run_in(edition, *args, **kw):
    env = os.environ | {"PYTHONPATH": str(edition), "OMP_NUM_THREADS": "1"}
    env.pop("LABS_IMPL", None)
    return subprocess.run([sys.executable, *args], cwd=edition, env=env, capture_output=True, text=True, **kw)


def test_edition_leaves_out_solutions_mutants_and_the_instructors_notes(edition):
    assert not (edition / "solutions").exists()
    assert not (edition / "labkit" / "mutants.py").exists() and not (edition / "tests" / "meta" / "mutants").exists()
    readme, makefile = (edition / "README.md").read_text(), (edition / "Makefile").read_text()
    assert "learner edition" in readme and "Threat model" not in readme and "instructors-only" not in readme
    assert "solutions." not in makefile and "labkit.grading.release" not in makefile and "IMPL ?= student" in makefile
    assert (edition / "tests" / "stage01_forward_numpy").is_dir() and (edition / "labkit" / "assets").is_dir()


def targets(makefile) -> set[str]:
    return set(re.findall(r"^([\w-]+):", makefile.read_text(), re.M))


def lacks(edition) -> re.Pattern:
    """A mention of what the instructors' checkout has and the edition does not, derived from the two: a make
    target it dropped, a file or folder it left out (as a path, or as a module: solutions.stage01_x), the switch
    value that picks the solutions, and a claim that a command runs the reference code."""
    forms = [rf"make {t}\b" for t in sorted(targets(ROOT / "Makefile") - targets(edition / "Makefile"))]
    for left in release.LEFT_OUT:
        assert not (edition / left).exists(), f"{left} is in the edition"
        base = left.rstrip("/")
        tail = r"(?:/|\.\w)" if left.endswith("/") else r"\b"  # a folder: `solutions/x`, `solutions.stage01`
        forms += [rf"(?<![\w/.]){re.escape(name)}{tail}" for name in {base, base.removesuffix(".py").replace("/", ".")}]
    forms += [r"IMPL=solution\b", r"--impl solution\b", r"impl=.solution"]
    reference = r"(?:reference (?:solution|one|implementation)|answer key)\b"
    forms += [
        rf"(?:make \w|python -m|pytest|default).*{reference}",
        rf"{reference}.*(?:make \w|python -m|pytest|default)",
    ]
    forms += [r"with the reference solution"]  # what a command does, said of the reference: it runs yours here
    return re.compile("|".join(forms))


def learner_texts(edition):
    """(where, text) of what a learner reads: every Markdown file, the Makefile, each handout's cells and each
    stage module. AGENTS.md speaks to a coding assistant: it names solutions/ only to forbid reading it."""
    paths = [p for p in sorted(edition.rglob("*.md")) if p.name != "AGENTS.md"]
    paths += [edition / "Makefile", *sorted(edition.glob("stage*/*.py"))]
    for path in paths:
        yield path.relative_to(edition), path.read_text()
    for path in sorted(edition.glob("stage*/*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            yield f"{path.relative_to(edition)} cell {i}", "".join(cell["source"])


def test_the_editions_readme_makefile_and_handouts_name_nothing_it_leaves_out(edition):
    pattern = lacks(edition)
    hits = [
        f"{where}: {line.strip()[:140]}"
        for where, text in learner_texts(edition)
        for line in text.splitlines()
        if pattern.search(line)
    ]
    assert not hits, "instructors' text in the learner edition:\n" + "\n".join(hits)
    assert "labkit.grading.suite" not in (edition / "Makefile").read_text(), "make test is not the learner's"


def test_the_edition_ships_the_skeletons_todo_list(edition):
    """The grader still knows a TODO's name and section after the learner has written its body."""
    shipped = json.loads((edition / "tests" / "todos.json").read_text())
    assert shipped["stage01_forward_numpy"]["gpt2_numpy"][0] == ["softmax", 1, 1], shipped["stage01_forward_numpy"]
    assert set(shipped) == {f for f, _ in STAGES.values()}


def _bodies(tree: ast.AST) -> set[str]:
    """ast.dump of every function body of two statements or more (a one-liner proves nothing)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if len(body) >= 2:
                found.add(ast.dump(ast.Module(body, [])))
    return found


def _code(path) -> list[str]:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return [path.read_text()] if path.suffix == ".py" else []


def test_no_function_body_of_the_solutions_appears_in_the_edition(edition):
    given = set()
    for folder in dict.fromkeys(f for f, _ in STAGES.values()):
        given |= {b for p in todo.stage_files(ROOT / folder) for b in _bodies(ast.parse(p.read_text()))}
    answers = {b for p in (ROOT / "solutions").rglob("*.py") for b in _bodies(ast.parse(p.read_text()))} - given
    assert answers, "found no solution bodies to look for"
    leaks = []
    for path in sorted(edition.rglob("*")):
        for source in _code(path):
            try:
                tree = ast.parse(source)
            except SyntaxError:  # a notebook cell with a shell escape
                continue
            if _bodies(tree) & answers:
                leaks.append(str(path.relative_to(edition)))
    assert not leaks, f"solution code in the learner edition: {leaks}"


def test_the_solutions_switch_says_they_are_not_part_of_the_edition(edition):
    code = "from labkit import impl; impl.load('stage01_forward_numpy.gpt2_numpy', impl='solution')"
    out = run_in(edition, "-c", code)
    assert out.returncode != 0 and "not part of this learner edition" in out.stderr, out.stderr[-800:]


def test_the_learner_files_are_the_skeletons(edition):
    for folder in dict.fromkeys(f for f, _ in STAGES.values()):
        for path in todo.learner_files(ROOT / folder):
            rel = path.relative_to(ROOT)  # a sub-package's too: stage07_tensor_parallel/fleet/router.py
            assert (edition / rel).read_text() == path.read_text(), f"{rel} differs from the skeleton"


@pytest.mark.slow
@pytest.mark.parametrize("row", ["01", "02b"])
def test_make_grade_in_the_edition_finds_the_untouched_skeleton_not_started(edition, tmp_path, row):
    # One part-1 row and one part-2 row: grading every row takes ~15 min on 2 cores, and for the other
    # rows "not started" already follows from guarantee 2 (every graded test fails on the skeleton).
    report = tmp_path / "report.json"
    out = run_in(edition, "-m", "labkit.grading.grade", "--stage", row, "--json", str(report), timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads(report.read_text())["stages"]
    assert [(r["stage"], r["status"]) for r in rows] == [(row, "not started")], out.stdout[-3000:]
