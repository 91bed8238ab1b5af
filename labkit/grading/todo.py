"""What a TODO looks like in a skeleton, and which files hold one (what the learner edits).

Two forms, both with the stage, the name and the handout section:
    raise NotImplementedError("stage02: LayerCache.append — see lab.ipynb §3")
    tl.static_assert(False, "stage05: softmax_kernel — see lab.ipynb §4")     (inside a Triton kernel)
"""

import ast
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


def learner_files(stage_folder: Path) -> list[Path]:
    """The modules of a stage folder that hold at least one TODO: the only files a learner edits."""
    return sorted(p for p in stage_folder.glob("*.py") if todos(p.read_text()))


def section(text: str) -> tuple[int, int] | None:
    """(notebook, §) of the first TODO message in `text`: lab.ipynb is 1, lab2.ipynb is 2."""
    m = MESSAGE.search(text)
    return (int(m.group(2)[3:] or 1), int(m.group(3))) if m else None
