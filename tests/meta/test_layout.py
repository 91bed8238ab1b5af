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
