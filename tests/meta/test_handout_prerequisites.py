"""Every handout says at its top which TODOs of other notebooks it needs ("**Before you start:** ..."), so a
learner who opens lab4 first learns what to finish before its cells can run. The line must name each notebook
whose TODOs the handout's cells call (through the names `load("stageNN_x.module")` binds) or whose TODOs a
learner module it loads imports by name (`from .sampling import warp`); what a given module calls inside (the
engine) it names by hand."""

import ast
import json
import re
from pathlib import Path

import pytest

from labkit import ROOT, STAGES
from labkit.grading import todo

NOTEBOOKS = [
    (folder, str(nb.relative_to(ROOT / folder)))
    for folder in dict.fromkeys(folder for folder, _ in STAGES.values())
    for nb in todo.stage_files(ROOT / folder, "*.ipynb")
]
LINE = re.compile(r"^\*\*Before you start:\*\*(.+?)(?:\n\n|\Z)", re.M | re.S)


def notebook_name(notebook: int) -> str:
    return "lab.ipynb" if notebook == 1 else f"lab{notebook}.ipynb"


def needed(folder: str, notebook: str) -> dict[str, str]:
    """{other notebook's file name: a TODO of it that this handout needs}."""
    part = int(Path(notebook).stem[3:] or 1)
    todos = todo.stage_todos(ROOT, folder)
    where = {(module, name.split(".")[-1]): nb for module, found in todos.items() for name, (nb, _) in found}
    cells = json.loads((ROOT / folder / notebook).read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    aliases = dict(re.findall(rf"(\w+)\s*=\s*load\(\s*[\"']{folder}\.([\w.]+)[\"']", code))
    calls = {(aliases[a], attr) for a, attr in re.findall(r"\b(\w+)\.(\w+)\b", code) if a in aliases}
    for module in set(aliases.values()) & set(todos):  # a learner module's imports of other TODOs, by name
        path = ROOT.joinpath(folder, *module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                calls |= {(node.module, alias.name) for alias in node.names}
    return {
        notebook_name(nb): f"{module}.{name}"
        for (module, name) in calls
        if (nb := where.get((module, name))) is not None and nb != part
    }


@pytest.mark.parametrize(("folder", "notebook"), NOTEBOOKS)
def test_each_handout_states_the_todos_it_needs_from_other_notebooks(folder, notebook):
    cells = json.loads((ROOT / folder / notebook).read_text())["cells"]
    first = "".join(cells[0]["source"])
    line = LINE.search(first)
    assert line, f"{folder}/{notebook}: the first cell has no '**Before you start:**' paragraph after its title"
    missing = {nb: name for nb, name in needed(folder, notebook).items() if f"`{nb}`" not in line[1]}
    assert not missing, (
        f"{folder}/{notebook}: its cells need TODOs of {missing}, but its 'Before you start' line does not name "
        f"{', '.join(f'`{nb}`' for nb in missing)}"
    )


def test_the_needs_are_found():
    """needed() sees stage 06 lab4's `from .sampling import sample, warp` (lab.ipynb §5's warp)."""
    assert needed("stage06_speculative", "lab4.ipynb") == {"lab.ipynb": "sampling.warp"}
    assert "lab.ipynb" in needed("stage06_speculative", "lab3.ipynb")
