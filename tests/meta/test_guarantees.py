"""The course's own guarantees, per stage (DESIGN.md "Guarantees"). Not graded; CI runs them.

Selected per stage with `-k stage02_kv_cache`, which is how `make test` (labkit.check) runs them.
"""

import ast
import importlib
import inspect
import json
import os
import re
import time

import pytest

from labkit import ROOT, STAGES
from labkit.junit import run_pytest

BUILT = [folder for folder, _ in STAGES.values() if (ROOT / "tests" / folder).is_dir()]
NOTEBOOK_BUDGET_S = 120  # wall seconds a handout may take to run top to bottom in CI


def modules(folder: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "solutions" / folder).glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("folder", BUILT)
def test_every_graded_test_fails_on_the_untouched_skeleton(folder):
    run = run_pytest([f"tests/{folder}", "--impl", "student", "-q"], cwd=ROOT, timeout=900)
    assert not run.timed_out, f"the skeleton run of {folder} hung past 900 s"
    assert run.cases, f"pytest collected no tests for {folder}:\n{run.output[-2000:]}"
    passing = [c.name for c in run.cases if c.outcome == "passed"]
    assert not passing, f"{len(passing)} graded tests pass on the untouched skeleton, so they check nothing: {passing}"


@pytest.mark.parametrize("folder", BUILT)
def test_skeleton_and_solution_have_the_same_files(folder):
    skeleton = sorted(p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")
    assert skeleton == modules(folder), f"{folder}: skeleton modules {skeleton} != solution modules {modules(folder)}"


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
            f"{folder}/{mod}.py: missing in skeleton {missing}; only in skeleton {extra}; "
            f"signatures differ {[(k, s[k], r[k]) for k in differ]}"
        )


@pytest.mark.parametrize("folder", BUILT)
def test_todo_messages_name_the_stage_and_the_handout_section(folder):
    number = folder[5:7]
    pattern = re.compile(rf"stage{number}: .+ — see lab\.ipynb §\S+")
    for path in sorted((ROOT / folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                if getattr(node.exc.func, "id", "") == "NotImplementedError":
                    msg = ast.literal_eval(node.exc.args[0]) if node.exc.args else ""
                    assert pattern.search(msg), (
                        f"{path.name}:{node.lineno}: TODO message {msg!r} should read 'stage{number}: name — see lab.ipynb §k'"
                    )


@pytest.mark.parametrize("folder", BUILT)
def test_stage_imports_no_other_stage(folder):
    other = re.compile(r"^\s*(from|import)\s+(solutions|stage\d\d_\w+)", re.M)
    for base in (ROOT / folder, ROOT / "solutions" / folder):
        for path in base.glob("*.py"):
            hits = other.findall(path.read_text())
            assert not hits, (
                f"{path.relative_to(ROOT)} imports another stage or the solutions ({hits}); use labkit or a relative import"
            )


@pytest.mark.parametrize("folder", BUILT)
def test_stage_modules_do_not_shadow_installed_packages(folder):
    # A notebook's kernel starts in its stage folder, so a stage module named like a package the
    # kernel imports (comm.py, say) would replace that package and kill the kernel.
    import importlib.util

    for name in modules(folder):
        spec = importlib.util.find_spec(name)
        assert spec is None, f"{folder}/{name}.py shadows the installed module {name!r} ({spec.origin}); rename it"


@pytest.mark.parametrize("folder", BUILT)
def test_notebook_is_committed_without_outputs(folder):
    nb = json.loads((ROOT / folder / "lab.ipynb").read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c.get("outputs") or c.get("execution_count")]
    assert not dirty, f"{folder}/lab.ipynb: cells {dirty} carry outputs; strip them before committing"


@pytest.mark.parametrize("folder", BUILT)
def test_notebook_runs_top_to_bottom_against_the_solution(folder, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("LABS_IMPL", "solution")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(ROOT / folder / "lab.ipynb", as_version=4)
    t0 = time.perf_counter()
    NotebookClient(
        nb, timeout=NOTEBOOK_BUDGET_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT / folder)}}
    ).execute()
    took = time.perf_counter() - t0
    assert took < NOTEBOOK_BUDGET_S, f"{folder}/lab.ipynb took {took:.0f} s; the budget is {NOTEBOOK_BUDGET_S} s"
