"""Run each stage's graded tests in the order of its handout, so `pytest -x` stops at the first section to work on.

A test file's place is the handout section it grades: the first §k in its docstring, else the latest of the
first sections of the stage modules it names ("stage02_kv_cache.generate" -> the first §k among generate.py's
TODO messages). Part 2 (test_NNb_*.py, lab2.ipynb and any lab3.ipynb) follows part 1. Within a section,
test_NN_families.py (real checkpoints' architectures) runs last, the others by name. Tests inside a file keep
pytest's order, so module- and parameter-scoped fixtures stay grouped; folders keep theirs.
"""

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TODO_SECTION = re.compile(r"see (lab\d?)\.ipynb §(\d+)")
MODULE_NAME = re.compile(r"[\"'](stage\d\d_\w+)\.(\w+)[\"']")
UNPLACED = (True, 10**6)  # files that grade no particular section run after the others


@cache
def module_section(folder: str, name: str) -> tuple[bool, int] | None:
    """(part 2?, k) of the first section a stage module's TODOs point to."""
    path = ROOT / folder / f"{name}.py"
    found = (
        [(notebook != "lab", int(k)) for notebook, k in TODO_SECTION.findall(path.read_text())]
        if path.is_file()
        else []
    )
    return min(found, default=None)


@cache
def file_section(path: Path) -> tuple[bool, int, bool]:
    text = path.read_text()
    part2 = re.match(r"test_\d\db_", path.name) is not None
    docstring = re.match(r"§(\d+)", ast.get_docstring(ast.parse(text)) or "")  # "§3–§4 positions, …"
    families = path.stem.endswith("_families")  # needs the whole section: after its focused tests
    if docstring:
        return part2, int(docstring.group(1)), families
    sections = [s for s in (module_section(*ref) for ref in set(MODULE_NAME.findall(text))) if s]
    return (*max(sections, default=UNPLACED), families)


def pytest_collection_modifyitems(config, items):
    folders = {}
    for item in items:
        folders.setdefault(item.path.parent, len(folders))

    def key(indexed):
        i, item = indexed
        stage_test = item.path.parent.name.startswith("stage") and item.path.name.startswith("test_")
        return folders[item.path.parent], file_section(item.path) if stage_test else (False, 0, False), i

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
