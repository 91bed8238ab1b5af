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

Order (`pytest -x` stops at the first failure in handout order): by notebook, then section, whatever the
file; within a section, the tests that call only its own TODOs before those that also need another section's,
test_NN_families.py last among equals, then by file name, and pytest's order inside a file. Folders keep theirs.
"""

import ast
import itertools
import re
from functools import cache
from pathlib import Path

import pytest

from labkit import row_of
from labkit.grading import todo

ROOT = Path(__file__).resolve().parent.parent
SECTION_MARK = re.compile(r"\b(?:lab\d_)?s\d+\b")
MODULE_NAME = re.compile(r"[\"'](stage\d\d_\w+)\.([\w.]+)[\"']")  # "stage07_tensor_parallel.fleet.router" too
LAST = (10**6, 0)  # tests of no section run after the others
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
def file_info(path: Path):
    """((part 2?, its docstring's §k or None), its AST's top-level definitions, the TODOs it may call, every name it mentions)."""
    text = path.read_text()
    tree = ast.parse(text)
    row = re.match(r"test_(\d\d[a-z]?)_", path.name)
    row = row.group(1) if row else ""
    part2 = len(row) == 3  # a later part's §k is in its own notebook, not lab.ipynb
    folder = stage_folder(path)
    named = {ref for ref in MODULE_NAME.findall(text) if ref[0] == folder}
    docstring = re.match(r"§(\d+)", ast.get_docstring(tree) or "")  # "§3–§4 positions, …"
    key = (part2, int(docstring.group(1)) if docstring else None)
    modules = {m for _, name in named for m in learner_modules(folder, name)}

    # A part 2 file whose docstring names its handout ("§2 of lab3.ipynb") never grades a later handout's TODOs,
    # though a given module it runs (the engine) imports the learner modules of later handouts too.
    notebook = re.search(r"\blab(\d)\.ipynb", ast.get_docstring(tree) or "") if part2 else None

    def todos_of(modules):
        return [
            (n, sec)
            for m in modules
            for n, sec in stage_todos(folder)[m]
            if row_of(row[:2], sec[0]) == row and (notebook is None or sec[0] <= int(notebook[1]))
        ]

    candidates = todos_of(modules) or todos_of(stage_todos(folder))  # none named: any of the stage's
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in tree.body:  # MODULE = "stage04_batching.engine": a name a test may use
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            defs.setdefault(node.targets[0].id, node)
    return key, defs, candidates, _names(tree)


def docstring_section(path: Path) -> bool:
    return file_info(path)[0][1] is not None


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
    return todos_called(item.path, item.cls.__name__ if item.cls else None, getattr(item, "originalname", item.name))


@cache
def todos_called(path: Path, cls: str | None, function: str) -> list[tuple[str, tuple[int, int]]]:
    """called_todos of the test `function` (of the class `cls`, if any) in the file at `path`."""
    _, defs, candidates, file_names = file_info(path)
    start = (defs.get(cls) if cls else None) or defs.get(function)
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
        given |= {m for c in ast.walk(node) if isinstance(c, ast.Constant) for m in _given(stage_folder(path), c.value)}
        queue += [defs[n] for n in names if n in defs and id(defs[n]) not in seen]
    folder = stage_folder(path)
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
    for notebook in range(1, 10):
        for k in range(1, 21):
            config.addinivalue_line("markers", f"{mark_name(notebook, k)}: a test of lab{notebook} §{k}")


def test_section(path: Path, called: list[tuple[str, tuple[int, int]]]) -> tuple[int, int] | None:
    """(notebook, k) of a test: the latest section among the TODOs it calls, never before its file's docstring §k."""
    section = max((sec for _, sec in called), default=None)
    floor = file_section(path) if docstring_section(path) else None
    return max(filter(None, (section, floor)), default=None) or file_section(path)


def is_stage_test(path: Path) -> bool:
    return stage_folder(path) is not None and path.name.startswith("test_") and path.suffix == ".py"


def pytest_collection_modifyitems(config, items):
    # --file-order: the files named keep the command line's order (the mutant runner names the files that load the
    # mutated module first, so that -x stops early); otherwise handout order.
    named = [Path(a.split("::")[0]).resolve() for a in config.args] if config.getoption("file_order", False) else []
    named = {p: k for k, p in enumerate(named) if p.suffix == ".py"}
    folders, order = {}, {}
    for i, item in enumerate(items):  # a stage's sub-folder (stage 07's fleet/) sorts with its stage
        folder = named.get(item.path, -1), folders.setdefault(stage_folder(item.path) or item.path.parent, len(folders))
        order[id(item)] = (folder, LAST, True, False, item.path.name, i)
        if not is_stage_test(item.path):
            continue
        called = called_todos(item)
        section = test_section(item.path, called)
        if section:
            item.add_marker(getattr(pytest.mark, mark_name(*section)))
        item.add_marker(pytest.mark.todos(*sorted({name for name, _ in called})))
        if reason := IN_PROCESS_FOLDERS.get(stage_folder(item.path)):
            item.add_marker(pytest.mark.in_process(reason))
        # Handout order: notebook, then section; a section's own unit tests before its tests that also need
        # another section's TODOs (stage 04's engine tests of §5 need §4's scheduler too).
        mixed = any(sec != section for _, sec in called)
        families = item.path.stem.endswith("_families")  # needs the whole section: after its focused tests
        order[id(item)] = (folder, section or LAST, mixed, families, item.path.name, i)
    items.sort(key=lambda item: order[id(item)])


def pytest_ignore_collect(collection_path: Path, config):
    """`-m s3` (a section's check): a test file none of whose tests is of that section is not imported at all.
    Importing a file is most of a small check's time (transformers, models built for parametrize); which
    section each test is of is read from the file's text above, without importing it."""
    expr = config.getoption("markexpr")
    if not expr or not is_stage_test(collection_path) or not SECTION_MARK.search(expr):
        return None
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser: the same expression semantics

        match = Expression.compile(expr).evaluate
    except Exception:  # noqa: BLE001 - another pytest: collect everything, as without this hook
        return None
    others = sorted(set(re.findall(r"[\w:+\-.\[\]\\/]+", expr)) - {"and", "or", "not"})
    others = [n for n in others if not SECTION_MARK.fullmatch(n)]  # marks this file cannot settle: any value
    if len(others) > 6:
        return None
    sections = file_sections(collection_path)
    if sections is None:
        return None
    for section, values in itertools.product(sections, itertools.product((False, True), repeat=len(others))):
        if match(_has(dict(zip(others, values, strict=True)) | {section: True})):
            return None
    return True


def _has(marks: dict) -> callable:
    return lambda name, **_: marks.get(name, False)


@cache
def file_sections(path: Path) -> list[str | None] | None:
    """The section marks (s3, lab2_s1; None for none) the tests of a file can have, or None if its tests
    cannot all be read from its text (a test that is not a top-level def or Test class)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        targets = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []
        targets += getattr(node, "targets", []) + [a.asname or a.name for a in getattr(node, "names", [])]
        for target in targets:
            name = target if isinstance(target, str) else getattr(target, "name", getattr(target, "id", ""))
            if not name.lower().startswith("test"):
                continue
            if isinstance(target, ast.FunctionDef | ast.AsyncFunctionDef):
                called = todos_called(path, None, name)
            elif isinstance(target, ast.ClassDef):
                called = todos_called(path, name, name)
            else:
                return None  # a test bound by assignment or import: what it calls is not read here
            section = test_section(path, called)
            found.append(mark_name(*section) if section else None)
    return found
