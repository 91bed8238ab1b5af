"""The course's own guarantees, per stage (CONTRIBUTING.md). Not graded; CI runs them.

Selected per stage with `-k stage02_kv_cache`, which is how `make test` (labkit.grading.suite) runs them.
In the learner edition (no solutions/) the checks that need a solution skip, and say so.
"""

import ast
import importlib
import inspect
import json
import os
import re
import time
from pathlib import Path

import pytest

from labkit import ROOT, STAGES
from labkit.grading import todo
from labkit.grading.junit import run_pytest

BUILT = list(dict.fromkeys(folder for folder, _ in STAGES.values()))  # a part-2 row shares its stage's folder
NOTEBOOKS = [  # (folder, "lab.ipynb"), and a sub-package's notebooks by their path: "fleet/lab2.ipynb"
    (folder, str(nb.relative_to(ROOT / folder)))
    for folder in BUILT
    for nb in todo.stage_files(ROOT / folder, "*.ipynb")
]
NOTEBOOK_BUDGET_S = 60  # wall seconds a handout may take top to bottom on a quiet 2-core machine (CONTRIBUTING)
needs_solutions = pytest.mark.skipif(
    not (ROOT / "solutions").is_dir(), reason="the learner edition has no solutions/ to compare against"
)


def modules(folder: str) -> list[str]:
    """The stage's modules with a TODO: the learner's files, each with a solution beside it."""
    return [todo.module_name(ROOT / folder, p) for p in todo.learner_files(ROOT / folder)]


@pytest.mark.parametrize("folder", BUILT)
def test_every_graded_test_fails_on_the_untouched_skeleton(folder):
    run = run_pytest([f"tests/{folder}", "--impl", "student", "-q"], cwd=ROOT, timeout=900)
    assert not run.timed_out, f"the skeleton run of {folder} hung past 900 s"
    assert run.cases, f"pytest collected no tests for {folder}:\n{run.output[-2000:]}"
    passing = [c.name for c in run.cases if c.outcome == "passed"]
    assert not passing, f"{len(passing)} graded tests pass on the untouched skeleton, so they check nothing: {passing}"


@needs_solutions
@pytest.mark.parametrize("folder", BUILT)
def test_each_module_with_a_todo_has_a_solution_and_given_modules_exist_once(folder):
    # A module without a TODO is given code: it lives only in the stage folder, and the solution
    # package finds it there (solutions/stageNN_x/__init__.py extends its __path__).
    base = ROOT / "solutions" / folder
    solved = sorted(todo.module_name(base, p) for p in todo.stage_files(base) if p.stem != "__init__")
    assert solved == modules(folder), (
        f"{folder}: modules with a TODO {modules(folder)}, solution modules {solved}; a module without a TODO "
        "belongs in the stage folder only"
    )


def _docstring(node) -> str | None:
    return ast.get_docstring(node, clean=False) if isinstance(node, ast.AST) else None


def _mirror(skel: ast.AST, sol: ast.AST, where: str) -> list[str]:
    """Where the solution drifts from the skeleton: given code and docstrings must be identical."""
    if isinstance(skel, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if not todo.is_todo_body(skel.body):
            return [] if ast.dump(skel) == ast.dump(sol) else [f"{where}: the given body differs"]
        head = [ast.dump(x) for x in (skel.args, *skel.decorator_list)] + [ast.dump(skel.returns or ast.Pass())]
        if head != [ast.dump(x) for x in (sol.args, *sol.decorator_list)] + [ast.dump(sol.returns or ast.Pass())]:
            return [f"{where}: the signature or decorators differ"]
        return [] if _docstring(skel) == _docstring(sol) else [f"{where}: the docstring differs"]
    problems = [] if _docstring(skel) == _docstring(sol) else [f"{where}: the docstring differs"]
    if isinstance(skel, ast.ClassDef) and [ast.dump(b) for b in (*skel.bases, *skel.decorator_list)] != [
        ast.dump(b) for b in (*sol.bases, *sol.decorator_list)
    ]:
        problems.append(f"{where}: the bases or decorators differ")
    named = {n.name: n for n in sol.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    other = {ast.dump(n) for n in sol.body}
    for node in skel.body[1:] if _docstring(skel) is not None else skel.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name not in named:
                problems.append(f"{where}{node.name}: missing in the solution")
            else:
                problems += _mirror(node, named[node.name], f"{where}{node.name}.")
        elif not isinstance(node, (ast.Import, ast.ImportFrom)) and ast.dump(node) not in other:
            problems.append(f"{where}line {node.lineno}: given statement not in the solution")
    return problems


@needs_solutions
@pytest.mark.parametrize("folder", BUILT)
def test_given_code_and_docstrings_are_identical_in_skeleton_and_solution(folder):
    problems = []
    for mod in modules(folder):
        skel, sol = (ast.parse(todo.module_path(base / folder, mod).read_text()) for base in (ROOT, ROOT / "solutions"))
        problems += _mirror(skel, sol, f"{folder}/{mod.replace('.', '/')}.py: ")
    for package in todo.stage_files(ROOT / "solutions" / folder, "__init__.py"):  # the stage's, and fleet/'s
        rel = package.relative_to(ROOT / "solutions")
        init = [ast.parse((base / rel).read_text()) for base in (ROOT, ROOT / "solutions")]
        shared = [s for s in init[1].body if "__path__" not in ast.dump(s) and "share_given_modules" not in ast.dump(s)]
        if [ast.dump(s) for s in init[0].body] != [ast.dump(s) for s in shared]:
            problems.append(f"{rel}: the solution's differs beyond the line that shares the given modules")
    assert not problems, "skeleton and solution drift apart:\n" + "\n".join(problems)


def public_api(module) -> dict[str, str]:
    """name -> signature of the functions, classes and methods the module itself defines."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            api[name] = str(inspect.signature(obj))
        elif inspect.isclass(obj):
            api[name] = "class"
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__", "__call__"):
                    continue
                fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if inspect.isfunction(fn):
                    api[f"{name}.{attr}"] = str(inspect.signature(fn))
                elif isinstance(member, property):
                    api[f"{name}.{attr}"] = "property"
            for field in getattr(obj, "__dataclass_fields__", {}):
                api[f"{name}.{field}"] = "field"
    return api


@needs_solutions
@pytest.mark.parametrize("folder", BUILT)
def test_skeleton_and_solution_expose_the_same_public_api(folder):
    for mod in modules(folder):
        student = importlib.import_module(f"{folder}.{mod}")
        solution = importlib.import_module(f"solutions.{folder}.{mod}")
        # Annotations name their own module's classes; compare them without the "solutions." prefix.
        s, r = public_api(student), {k: v.replace("solutions.", "") for k, v in public_api(solution).items()}
        missing = sorted(set(r) - set(s))
        extra = sorted(set(s) - set(r))
        differ = sorted(k for k in set(s) & set(r) if s[k] != r[k])
        assert not (missing or extra or differ), (
            f"{folder}/{mod.replace('.', '/')}.py: missing in skeleton {missing}; only in skeleton {extra}; "
            f"signatures differ {[(k, s[k], r[k]) for k in differ]}"
        )


@pytest.mark.parametrize("folder", BUILT)
def test_todo_messages_name_the_stage_and_the_handout_section(folder):
    # Both forms: raise NotImplementedError("…") and, in a Triton kernel, tl.static_assert(False, "…").
    number = folder[5:7]
    for path in todo.stage_files(ROOT / folder):  # a TODO points to a notebook beside its module
        for line, msg in todo.todos(path.read_text()):
            m = todo.MESSAGE.fullmatch(msg)
            assert m and m.group(1) == number, (
                f"{path.name}:{line}: TODO message {msg!r} should read 'stage{number}: name — see lab.ipynb §k' "
                "(or lab2.ipynb for a stage's second part)"
            )
            assert (path.parent / f"{m.group(2)}.ipynb").is_file(), (
                f"{path.name}:{line}: {msg!r} points to a notebook not in {path.parent.relative_to(ROOT)}"
            )


@needs_solutions
@pytest.mark.parametrize("folder", BUILT)
def test_the_shipped_todo_list_matches_the_skeleton(folder):
    """tests/todos.json keeps each TODO's name and section once the learner's body replaces its message;
    it must list exactly the skeleton's TODOs, or the grader and the section marks drift."""
    manifest = ROOT / todo.MANIFEST
    assert manifest.is_file(), f"{todo.MANIFEST} is missing: run .venv/bin/python -m labkit.grading.todo"
    shipped = json.loads(manifest.read_text()).get(folder, {})
    now = {m: [[n, *sec] for n, sec in found] for m, found in todo.scan(ROOT, folder).items()}
    assert shipped == now, f"{todo.MANIFEST} is stale for {folder}: run .venv/bin/python -m labkit.grading.todo"


@pytest.mark.parametrize("folder", BUILT)
def test_stage_imports_no_other_stage(folder):
    other = re.compile(r"^\s*(from|import)\s+(solutions|stage\d\d_\w+)", re.M)
    for base in (ROOT / folder, ROOT / "solutions" / folder):
        for path in todo.stage_files(base) if base.is_dir() else []:  # (no solutions/ in the learner edition)
            hits = other.findall(path.read_text())
            assert not hits, (
                f"{path.relative_to(ROOT)} imports another stage or the solutions ({hits}); use labkit or a relative import"
            )


@pytest.mark.parametrize("folder", BUILT)
def test_stage_modules_do_not_shadow_installed_packages(folder):
    # A notebook's kernel starts in its stage folder, so a stage module named like a package the
    # kernel imports (comm.py, say) would replace that package and kill the kernel.
    import importlib.util

    for name in (p.stem for p in todo.stage_files(ROOT / folder) if not p.stem.startswith("__")):
        spec = importlib.util.find_spec(name)
        assert spec is None, f"{folder}/{name}.py shadows the installed module {name!r} ({spec.origin}); rename it"


@pytest.mark.parametrize("folder", BUILT)
def test_test_files_are_named_test_NN_topic(folder):
    # One style, and names unique across stages: test folders are not packages.
    nn = folder[5:7]
    bad = [
        p.name
        for p in todo.stage_files(ROOT / "tests" / folder, "test_*.py")
        if not re.match(rf"test_{nn}[b-z]?_\w+\.py$", p.name)
    ]
    assert not bad, (
        f"tests/{folder}: rename {bad} to test_{nn}_<topic>.py (a later part's row: test_{nn}b_<topic>.py, 04c, ...)"
    )


@pytest.mark.parametrize("folder, notebook", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(folder, notebook):
    nb = json.loads((ROOT / folder / notebook).read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c.get("outputs") or c.get("execution_count")]
    assert not dirty, f"{folder}/{notebook}: cells {dirty} carry outputs; strip them before committing"


# Run in the handout's kernel before each "## §k": every TODO of a later section raises as the skeleton's does, so a
# cell that needs one, directly or through given code (stage 04's §3 demo once called engine.generate, which needs
# §4's scheduler), fails here as it would for a learner who has done only the sections so far. A call from another
# TODO's body is let through: how a learner writes that body is theirs (stage 04's §1 allocate may skip §3's cache).
GATE = """
import importlib, sys
from labkit import ROOT
from labkit.grading import todo

def _labkit_gate(folder, section, originals={}, raisers={}):
    loaded = lambda: [m for n, m in list(sys.modules.items()) if n.startswith(f"solutions.{folder}.")]
    todos = todo.stage_todos(ROOT, folder)
    names = {name for found in todos.values() for name, _ in found}
    for module, found in todos.items():
        owner = importlib.import_module(f"solutions.{folder}.{module}")
        for name, (notebook, k) in found:
            *path, attr = name.split(".")
            owner_ = getattr(owner, path[0]) if path else owner  # a method's class, or the module
            key = (module, name)
            original = originals.setdefault(key, vars(owner_)[attr])
            if key not in raisers:
                message = f"{folder[:7]}: {name} — see lab{'' if notebook == 1 else notebook}.ipynb §{k}"
                def raiser(*args, _message=message, _original=getattr(original, "__func__", original), **kwargs):
                    caller = sys._getframe(1).f_code
                    if "/solutions/" in caller.co_filename and caller.co_qualname in names:
                        return _original(*args, **kwargs)  # another TODO's body: the learner writes that one
                    raise NotImplementedError(_message)
                raisers[key] = type(original)(raiser) if isinstance(original, (staticmethod, classmethod)) else raiser
            now = original if (notebook, k) <= section else raisers[key]
            setattr(owner_, attr, now)
            if not path:  # and where another module imported it by name (`from .sampling import sample`)
                for mod in loaded():
                    if vars(mod).get(attr) in (original, raisers[key]):
                        setattr(mod, attr, now)
"""


def gated(nb, folder: str, notebook: str):
    """nb with the gate defined at its top and run before each section: later sections' TODOs raise (GATE)."""
    import nbformat

    part = int(Path(notebook).stem[3:] or 1)  # "fleet/lab2.ipynb" -> 2
    cells = [nbformat.v4.new_code_cell(GATE)]  # the setup cells before the first section run ungated
    for cell in nb.cells:
        if cell.cell_type == "markdown" and (m := re.search(r"^## §(\d+)", cell.source, re.M)):
            cells.append(nbformat.v4.new_code_cell(f"_labkit_gate({folder!r}, ({part}, {m.group(1)}))"))
        cells.append(cell)
    nb.cells = cells
    return nb


@needs_solutions
@pytest.mark.parametrize("folder, notebook", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_against_the_solution(folder, notebook, monkeypatch):
    """Top to bottom on the solution, each section with only the TODOs of the sections so far written."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("LABS_IMPL", "solution")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    path = ROOT / folder / notebook
    nb = gated(nbformat.read(path, as_version=4), folder, notebook)
    t0 = time.perf_counter()
    NotebookClient(
        nb, timeout=NOTEBOOK_BUDGET_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    took = time.perf_counter() - t0
    assert took < NOTEBOOK_BUDGET_S, f"{folder}/{notebook} took {took:.0f} s; the budget is {NOTEBOOK_BUDGET_S} s"


@pytest.mark.parametrize("folder, notebook", NOTEBOOKS)
def test_notebook_cells_call_no_later_sections_todo(folder, notebook):
    # A learner runs a handout as they go: a cell of §k may call the TODOs of §k and before, not a later
    # section's (stage 01's §4 once needed §5's loader). Calls through the names `load("stageNN_x.module")`
    # binds; a given function that calls a TODO is not followed.
    todos = {
        (module, name.split(".")[-1]): section
        for module, found in todo.stage_todos(ROOT, folder).items()
        for name, section in found
    }
    part = int(Path(notebook).stem[3:] or 1)
    section, aliases, ahead = (part, 0), {}, []
    for i, cell in enumerate(json.loads((ROOT / folder / notebook).read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            if m := re.search(r"^## §(\d+)", source, re.M):
                section = (part, int(m.group(1)))
            continue
        aliases |= dict(re.findall(rf"(\w+)\s*=\s*load\(\s*[\"']{folder}\.([\w.]+)[\"']", source))
        for alias, attr in re.findall(r"\b(\w+)\.(\w+)\b", source):
            if (later := todos.get((aliases.get(alias), attr))) and later > section:
                ahead.append(f"cell {i} (§{section[1]}) calls {aliases[alias]}.{attr} of §{later[1]}")
    assert not ahead, f"{folder}/{notebook}: " + "; ".join(ahead)
