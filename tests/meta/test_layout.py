"""The house by audience: which room may import which, and no import cycle anywhere.

    stage folders, solutions/  ->  labkit (the library) only
    labkit (the library)       ->  neither labkit.grading nor labkit.bench
    labkit.grading, labkit.bench  never import each other

Imports inside functions count: a lazy import is still a dependency, and the one cycle this
project had (the implementation switch and the grader's worker) was a lazy one.
"""

import ast
from pathlib import Path

import pytest

from labkit import ROOT

TOOLS = ("labkit.grading", "labkit.bench")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path) -> dict[str, Path]:
    """Every Python module of the course by dotted name (tests, which are not imported, left out)."""
    files = [p for p in root.rglob("*.py") if not {".venv", "tests", ".git"} & set(p.relative_to(root).parts)]
    return {module_name(p, root): p for p in files}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` (module `name`) imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from labkit import bench` imports the module labkit.bench, not just the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import labkit.grading.grade` -> that module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def room(module: str) -> str:
    if module.startswith(("stage", "solutions")):
        return "stage"
    for tool in TOOLS:
        if module == tool or module.startswith(tool + "."):
            return tool
    return "library" if module.startswith("labkit") else "other"


def violations(root: Path) -> list[str]:
    """Each import that breaks the rule of its room, then each import cycle, in words."""
    modules = project_modules(root)
    graph = {name: imports(path, name, set(modules)) for name, path in modules.items()}
    found = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = room(name), room(target)
            if a in ("stage", "library") and b in TOOLS:
                found.append(f"{name} ({a}) imports {target}: the {a} may import only the library")
            elif a in TOOLS and b in TOOLS and a != b:
                found.append(f"{name} imports {target}: {a} and {b} never import each other")
    # a cycle: a strongly connected component of more than one module (Tarjan's algorithm)
    index, low, stack, on_stack, counter = {}, {}, [], set(), [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(f"import cycle: {' <-> '.join(sorted(component))}")

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_room_imports_only_what_its_rule_allows():
    assert violations(ROOT) == []


def plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"labkit/model.py": "from labkit.bench import measure\n"}, "labkit.model (library) imports labkit.bench"),
        ({"labkit/model.py": "def f():\n    from .grading import grade\n"}, "imports labkit.grading.grade"),
        ({"stage02_kv_cache/cache.py": "from labkit import bench\n"}, "stage02_kv_cache.cache (stage) imports"),
        ({"labkit/grading/grade.py": "from ..bench import loadtest\n"}, "never import each other"),
        ({"labkit/impl.py": "from . import model\n", "labkit/model.py": "def f():\n    import labkit.impl\n"}, "cycle"),
    ],
    ids=["library-up", "lazy-library-up", "stage-up", "tool-to-tool", "cycle"],
)
def test_the_rule_catches_a_planted_violation(tmp_path, files, expected):
    base = {
        "labkit/__init__.py": "",
        "labkit/impl.py": "",
        "labkit/model.py": "",
        "labkit/grading/__init__.py": "",
        "labkit/grading/grade.py": "",
        "labkit/bench/__init__.py": "",
        "labkit/bench/loadtest.py": "",
        "stage02_kv_cache/__init__.py": "",
        "stage02_kv_cache/cache.py": "",
    }
    clean = plant(tmp_path / "clean", base)
    assert violations(clean) == []
    found = violations(plant(tmp_path / "planted", {**base, **files}))
    assert any(expected in v for v in found), found


# Sizes: a reader takes in a function at one glance and a module in one sitting. Tests are left out (a
# parametrized table is long and flat). A file may stay larger only with a one-line reason here.
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450
MAX_BENCH_MAIN_LINES = 60  # a benchmark's main says what it measures; the harness (labkit.bench) does the rest
NOT_YET = "not yet split (issue 61)"
LARGE_MODULES: dict[str, str] = {}
LONG_FUNCTIONS = {}


def oversized(root: Path) -> list[str]:
    """Each module over MAX_MODULE_LINES, function over MAX_FUNCTION_LINES and benchmark main over
    MAX_BENCH_MAIN_LINES that the allow-lists above do not name, in words."""
    found = []
    for path in sorted(project_modules(root).values()):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and rel not in LARGE_MODULES:
            found.append(f"{rel} has {lines} lines, over {MAX_MODULE_LINES}: split it by what its parts are for")
        bench_module = rel.startswith("labkit/bench/") and path.name != "__init__.py"
        for node in ast.walk(ast.parse(text, rel)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            size = node.end_lineno - node.lineno + 1
            bench_main = bench_module and node.name == "main" and node.col_offset == 0
            limit = MAX_BENCH_MAIN_LINES if bench_main else MAX_FUNCTION_LINES
            if size > limit and f"{rel}::{node.name}" not in LONG_FUNCTIONS:
                what = "the benchmark's main" if bench_main else f"{node.name}()"
                found.append(f"{rel}: {what} has {size} lines, over {limit}: give its parts names of their own")
    return found


def test_no_module_or_function_outgrows_a_sitting():
    assert oversized(ROOT) == []


def test_every_allowed_large_file_still_exists():
    """An allow-list entry whose file or function is gone (renamed, split) is dropped, not left to cover the next one."""
    modules = {p.relative_to(ROOT).as_posix(): p for p in project_modules(ROOT).values()}
    stale = [rel for rel in LARGE_MODULES if rel not in modules]
    for entry in LONG_FUNCTIONS:
        rel, name = entry.split("::")
        tree = ast.parse(modules[rel].read_text()) if rel in modules else ast.Module(body=[], type_ignores=[])
        if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(tree)):
            stale.append(entry)
    assert stale == [], f"allow-list entries that name nothing any more: {stale}"


def test_the_size_rule_catches_a_planted_giant(tmp_path):
    def body(lines: int) -> str:
        return "".join(f"    x{i} = {i}\n" for i in range(lines))

    root = plant(
        tmp_path,
        {
            "labkit/__init__.py": "",
            "labkit/big.py": "def f():\n" + body(MAX_FUNCTION_LINES),
            "labkit/long.py": "x = 0\n" * (MAX_MODULE_LINES + 1),
            "labkit/bench/stage99.py": "def main(quick):\n" + body(MAX_BENCH_MAIN_LINES),
        },
    )
    found = oversized(root)
    assert any("labkit/big.py: f() has 81 lines" in f for f in found), found
    assert any("labkit/long.py has 451 lines" in f for f in found), found
    assert any("stage99.py: the benchmark's main has 61 lines" in f for f in found), found
