"""Place each graded test in its handout section: an `sK` mark to select it, and `pytest -x` order.

A test's section is the latest handout section among the TODOs it calls: the names its function, and the
helpers and fixtures of its file that it uses, mention (`mod.softmax(...)` -> softmax's §1; a method TODO
`LayerCache.append` counts where the file also names `LayerCache`). Only the TODOs of the stage modules the
file names (or that a given module it names imports) count, and part 2 files (test_NNb_*) count only lab2/lab3 TODOs. A test that mentions none takes
the first §k of its file's docstring (never later than the docstring's §k, where there is one), else the latest
section among the TODOs the file may call. A given module the test names ("stage04_batching.engine") counts as the
TODOs of the learner modules it imports, a given function of a learner module as the TODOs it calls. The marks:

    s3          lab.ipynb §3:   .venv/bin/pytest tests/stage01_forward_numpy -m s3
    lab2_s1     lab2.ipynb §1 (a stage's part 2; lab3_s2 for lab3.ipynb §2)
    todos(...)  the TODO names the test calls, which the grader reads to tell which TODO a failure belongs to
    in_process  the test needs the learner's objects themselves (the grader's --submission, INSTRUCTORS.md)

Order: part 2 follows part 1; within a part, files run by their file's section, test_NN_families.py last
among equals, the others by name. Tests inside a file keep pytest's order, so module- and parameter-scoped
fixtures stay grouped; folders keep theirs.
"""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from labkit.grading import todo

ROOT = Path(__file__).resolve().parent.parent
MODULE_NAME = re.compile(r"[\"'](stage\d\d_\w+)\.([\w.]+)[\"']")  # "stage07_tensor_parallel.fleet.router" too
UNPLACED = (True, 10**6)  # files that grade no particular section run after the others
# Whole folders whose tests drive the learner's objects themselves (the grader's --submission).
IN_PROCESS_FOLDERS = {
    "stage04_batching": "the engine runs behind an asyncio server and the tests drive it with stub "
    "schedulers, fault injection and threads",
    "stage07_tensor_parallel": "torch.distributed runs the learner's code in processes of its own",
}


def stage_folder(path: Path) -> str | None:
    """The stage folder a test file grades: tests/stage07_tensor_parallel/fleet/test_07b_x.py -> stage07_tensor_parallel."""
    parts = path.relative_to(ROOT / "tests").parts if path.is_relative_to(ROOT / "tests") else ()
    return parts[0] if len(parts) > 1 and parts[0].startswith("stage") else None


def module_file(folder: str, module: str) -> Path:
    """The file of a stage module: "kv_cache" -> stage02_kv_cache/kv_cache.py, "fleet.router" -> .../fleet/router.py."""
    return ROOT.joinpath(folder, *module.split(".")).with_suffix(".py")


def mark_name(notebook: int, k: int) -> str:
    """s3 for lab.ipynb §3, lab2_s1 for lab2.ipynb §1."""
    return f"s{k}" if notebook == 1 else f"lab{notebook}_s{k}"


@cache
def stage_todos(folder: str) -> dict[str, list[tuple[str, tuple[int, int]]]]:
    """module -> [(TODO name, (notebook, §))] of the skeleton (labkit.grading.todo: kept as shipped)."""
    return todo.stage_todos(ROOT, folder)


@cache
def learner_modules(folder: str, name: str) -> set[str]:
    """The learner modules a stage module is or imports (`from .paged_attention import ...`), one level deep."""
    if name in stage_todos(folder):
        return {name}
    path = module_file(folder, name)
    tree = ast.parse(path.read_text()) if path.is_file() else ast.Module([], [])
    package = name.split(".")[:-1]  # "fleet" for fleet.launch: its relative imports are fleet.x
    imported = {
        ".".join([*package[: len(package) - n.level + 1], n.module])
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.level and n.module
    }
    return imported & set(stage_todos(folder))


@cache
def module_section(folder: str, name: str) -> tuple[bool, int] | None:
    """(part 2?, k) of the first section a stage module's TODOs point to."""
    sections = [(nb != 1, k) for _, (nb, k) in stage_todos(folder).get(name, [])]
    return min(sections, default=None)


@cache
def file_info(path: Path):
    """(the file's sort key, its AST's top-level definitions, the TODOs it may call, every name it mentions)."""
    text = path.read_text()
    tree = ast.parse(text)
    part2 = re.match(r"test_\d\db_", path.name) is not None
    families = path.stem.endswith("_families")  # needs the whole section: after its focused tests
    folder = stage_folder(path)
    named = {ref for ref in MODULE_NAME.findall(text) if ref[0] == folder}
    docstring = re.match(r"§(\d+)", ast.get_docstring(tree) or "")  # "§3–§4 positions, …"
    if docstring:
        key = (part2, int(docstring.group(1)), families)
    else:
        sections = [s for s in (module_section(*ref) for ref in named) if s]
        key = (*max(sections, default=UNPLACED), families)
    modules = {m for _, name in named for m in learner_modules(folder, name)}

    def todos_of(modules):
        return [(n, sec) for m in modules for n, sec in stage_todos(folder)[m] if (sec[0] != 1) == part2]

    candidates = todos_of(modules) or todos_of(stage_todos(folder))  # none named: any of the stage's
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in tree.body:  # MODULE = "stage04_batching.engine": a name a test may use
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            defs.setdefault(node.targets[0].id, node)
    return key, defs, candidates, _names(tree)


@cache
def docstring_section(path: Path) -> bool:
    return re.match(r"§\d", ast.get_docstring(ast.parse(path.read_text())) or "") is not None


@cache
def file_section(path: Path) -> tuple[int, int] | None:
    """Where a test that calls no TODO by name belongs: the docstring's §k, else the file's latest TODO."""
    key, _, candidates, _ = file_info(path)
    latest = max((sec for _, sec in candidates), default=None)
    if docstring_section(path) and latest:
        return (latest[0] if key[0] else 1, key[1])  # part 2's §k is in its file's notebook
    return latest


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def called_todos(item) -> list[tuple[str, tuple[int, int]]]:
    """The TODOs a test mentions, through the helpers and fixtures of its own file."""
    _, defs, candidates, file_names = file_info(item.path)
    start = defs.get(item.cls.__name__) if item.cls else None
    start = start or defs.get(getattr(item, "originalname", item.name))
    if start is None:
        return []
    seen, todo_names, queue, given = set(), set(), [start], set()
    if isinstance(start, (ast.FunctionDef, ast.AsyncFunctionDef)):
        queue += [defs[a.arg] for a in start.args.args if a.arg in defs]  # the file's fixtures it asks for
    while queue:
        node = queue.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        names = _names(node)
        todo_names |= names
        given |= {
            m for c in ast.walk(node) if isinstance(c, ast.Constant) for m in _given(stage_folder(item.path), c.value)
        }
        queue += [defs[n] for n in names if n in defs and id(defs[n]) not in seen]
    folder = stage_folder(item.path)
    for module in stage_todos(folder):  # a given function of a learner module calls that module's TODOs
        todo_names |= {t for fn, calls in given_calls(folder, module).items() if fn in todo_names for t in calls}
    called = [
        (name, sec)
        for name, sec in candidates
        if name.split(".")[-1] in todo_names and (("." not in name) or name.split(".")[0] in file_names)
    ]
    # A given module the test runs (the engine) calls the TODOs of the learner modules it imports.
    return called + [(name, sec) for name, sec in candidates if name in given]


@cache
def given_calls(folder: str, module: str) -> dict[str, set[str]]:
    """Given functions of a learner module -> the names of the module's TODOs each one mentions."""
    tree = ast.parse(module_file(folder, module).read_text())
    todos = {name.split(".")[-1] for name, _ in stage_todos(folder)[module]}
    return {
        n.name: _names(n) & todos
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name not in todos and _names(n) & todos
    }


def _given(folder: str, value) -> set[str]:
    """The TODO names a given module named by the string "stageNN_x.module" reaches through its imports."""
    if not isinstance(value, str) or not value.startswith(folder + "."):
        return set()
    module = value.split(".", 1)[1]
    if module in stage_todos(folder):
        return set()  # a learner module: only the TODOs the test calls by name count
    return {name for m in learner_modules(folder, module) for name, _ in stage_todos(folder)[m]}


def pytest_configure(config):
    for notebook in (1, 2, 3, 4, 5):
        for k in range(1, 21):
            config.addinivalue_line("markers", f"{mark_name(notebook, k)}: a test of lab{notebook} §{k}")


def pytest_collection_modifyitems(config, items):
    folders = {}
    for item in items:  # a stage's sub-folder (stage 07's fleet/) sorts with its stage: part 2 after part 1
        folders.setdefault(stage_folder(item.path) or item.path.parent, len(folders))
        if not (stage_folder(item.path) and item.path.name.startswith("test_")):
            continue
        called = called_todos(item)
        section = max((sec for _, sec in called), default=None)
        floor = file_section(item.path) if docstring_section(item.path) else None
        section = max(filter(None, (section, floor)), default=None) or file_section(item.path)
        if section:
            item.add_marker(getattr(pytest.mark, mark_name(*section)))
        item.add_marker(pytest.mark.todos(*sorted({name for name, _ in called})))
        if reason := IN_PROCESS_FOLDERS.get(stage_folder(item.path)):
            item.add_marker(pytest.mark.in_process(reason))

    def key(indexed):
        i, item = indexed
        stage_test = bool(stage_folder(item.path)) and item.path.name.startswith("test_")
        return (
            folders[stage_folder(item.path) or item.path.parent],
            file_info(item.path)[0] if stage_test else (False, 0, False),
            i,
        )

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
