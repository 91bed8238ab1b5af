"""What a TODO looks like in a skeleton, and which files hold one (what the learner edits).

Two forms, both with the stage, the name and the handout section:
    raise NotImplementedError("stage02: LayerCache.append — see lab.ipynb §3")
    tl.static_assert(False, "stage05: softmax_kernel — see lab.ipynb §4")     (inside a Triton kernel)
"""

import ast
import json
import re
from pathlib import Path

MESSAGE = re.compile(r"stage(\d\d): .+ — see (lab\d?)\.ipynb §(\d+)")


def message(stmt: ast.stmt) -> str | None:
    """The TODO message if `stmt` is one of the two TODO forms, else None."""
    call = None
    if isinstance(stmt, ast.Raise) and isinstance(stmt.exc, ast.Call):
        if getattr(stmt.exc.func, "id", "") == "NotImplementedError":
            call = stmt.exc
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        if getattr(func, "attr", "") == "static_assert" and stmt.value.args[:1]:
            first = stmt.value.args[0]
            if isinstance(first, ast.Constant) and first.value is False:
                call = ast.Call(func, stmt.value.args[1:], [])
    if call is None:
        return None
    arg = call.args[0] if call.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""


def todos(source: str) -> list[tuple[int, str]]:
    """(line, message) of every TODO statement in a module's source."""
    return [(node.lineno, msg) for node in ast.walk(ast.parse(source)) if (msg := message(node)) is not None]


def is_todo_body(body: list[ast.stmt]) -> bool:
    """A function body the learner writes: a docstring (optional) then a TODO statement."""
    rest = body[1:] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
    return any(message(stmt) is not None for stmt in rest)


def stage_files(stage_folder: Path, pattern: str = "*.py") -> list[Path]:
    """The files of a stage folder and of its sub-packages (stage 07's fleet/), caches and checkpoints left out."""
    skip = {"__pycache__", ".ipynb_checkpoints"}
    return sorted(p for p in stage_folder.rglob(pattern) if not skip & set(p.relative_to(stage_folder).parts))


def module_name(stage_folder: Path, path: Path) -> str:
    """A stage module's name inside its stage: "kv_cache", or "fleet.router" for a sub-package's."""
    return ".".join(path.relative_to(stage_folder).with_suffix("").parts)


def module_path(stage_folder: Path, module: str) -> Path:
    """The file of a stage module named as module_name names it."""
    return stage_folder.joinpath(*module.split(".")).with_suffix(".py")


def learner_files(stage_folder: Path) -> list[Path]:
    """The modules of a stage folder that hold at least one TODO: the only files a learner edits."""
    return [p for p in stage_files(stage_folder) if todos(p.read_text())]


def section(text: str) -> tuple[int, int] | None:
    """(notebook, §) of the first TODO message in `text`: lab.ipynb is 1, lab2.ipynb is 2."""
    m = MESSAGE.search(text)
    return (int(m.group(2)[3:] or 1), int(m.group(3))) if m else None


# The course carries the skeleton's TODO list as it shipped (tests/meta checks it against the skeleton): once a
# learner writes a body, its TODO message is gone from the file, but the grader and the tests' section marks
# still need its name and §.
MANIFEST = Path("tests") / "todos.json"
NAME = re.compile(r"stage\d\d: (\S+) — see (lab\d?)\.ipynb §(\d+)")


def scan(root: Path, folder: str) -> dict[str, list[tuple[str, tuple[int, int]]]]:
    """module -> [(TODO name, (notebook, §))], in file order, of the TODOs the folder's files hold now."""
    found = {}
    for path in learner_files(root / folder):
        found[module_name(root / folder, path)] = [
            (m.group(1), (int(m.group(2)[3:] or 1), int(m.group(3))))
            for _, msg in sorted(todos(path.read_text()))
            if (m := NAME.search(msg))
        ]
    return found


def stage_todos(root: Path, folder: str) -> dict[str, list[tuple[str, tuple[int, int]]]]:
    """The skeleton's TODOs of a stage folder: from the shipped manifest if there is one, else the files."""
    path = root / MANIFEST
    if path.is_file():
        shipped = json.loads(path.read_text()).get(folder, {})
        return {module: [(name, (nb, k)) for name, nb, k in found] for module, found in shipped.items()}
    return scan(root, folder)


def write_manifest(root: Path, folders) -> None:
    """Record the TODOs of the untouched skeleton (make student-edition, a graded copy)."""
    shipped = {f: {m: [[n, *s] for n, s in found] for m, found in scan(root, f).items()} for f in folders}
    stages = [
        f"  {json.dumps(f)}: {{\n"
        + ",\n".join(f"    {json.dumps(m)}: {json.dumps(t)}" for m, t in mods.items())
        + "\n  }"
        for f, mods in shipped.items()
    ]  # one line a module, so a diff shows which TODOs changed
    (root / MANIFEST).write_text("{\n" + ",\n".join(stages) + "\n}\n")


def untouched(root: Path, folder: str, module: str, name: str) -> bool:
    """Whether the learner's file still holds this TODO statement."""
    path = module_path(root / folder, module)
    try:
        return any((m := NAME.search(msg)) and m.group(1) == name for _, msg in todos(path.read_text()))
    except (OSError, SyntaxError):
        return False  # a file that does not parse is started, and fails its tests


if __name__ == "__main__":  # python -m labkit.grading.todo: rewrite tests/todos.json after changing a skeleton's TODOs
    from .. import ROOT, STAGES

    write_manifest(ROOT, dict.fromkeys(folder for folder, _ in STAGES.values()))
    print(f"wrote {MANIFEST}")
