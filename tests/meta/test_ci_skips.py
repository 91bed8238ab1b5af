"""No graded test skips in CI but for a GPU: "fails on the skeleton" is vacuous for a test that always skips.

A graded test may skip only by a marker set at collection: `gpu` (no CUDA here) or a `skipif` on an optional
package that is not installed (`find_spec`, with the `make` target that installs it in the reason). `make test`
installs those packages (make guided, make llamacpp), so in CI (CI=true, as GitHub Actions and most CI services
set it) every such skipif must be false. A skip raised while a test runs is the grader's business
(labkit.grading.outcomes): the graded tests raise none.
"""

import ast
import json
import os
import subprocess
import sys

import pytest

from labkit import ROOT

GRADED = sorted(ROOT.glob("tests/stage*/**/*.py"))
RUNTIME_SKIPS = {"skip", "importorskip", "xfail"}  # pytest.skip(...) and its kin, called while a test runs
# Evaluates each collected test's skip marks as pytest's setup would (its own function), and writes the skips.
PROBE = """
import json, os

from _pytest.skipping import evaluate_skip_marks


def pytest_collection_finish(session):
    skips = []
    for item in session.items:
        if (skip := evaluate_skip_marks(item)) is not None:
            skips.append({"id": item.nodeid, "reason": skip.reason, "gpu": "gpu" in item.keywords})
    with open(os.environ["LABKIT_SKIP_PROBE"], "w") as f:
        json.dump(skips, f)
"""


def runtime_skips(path) -> list[str]:
    """'file:line pytest.skip(...)' for each call of pytest.skip, importorskip or xfail in a graded test file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RUNTIME_SKIPS:
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest":
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{node.lineno} pytest.{node.func.attr}(...)")
    return found


def test_graded_tests_skip_only_by_a_marker_set_at_collection():
    found = [hit for path in GRADED for hit in runtime_skips(path)]
    assert not found, (
        "a graded test skips while it runs; skip at collection instead (pytest.mark.skipif(find_spec(name) is "
        f"None, reason='needs name (make target)')), so that the grader and CI see it: {found}"
    )


def test_the_scan_sees_a_skip_raised_in_a_test(tmp_path):
    """runtime_skips is not blind: it finds importorskip in a test's body, and no marker."""
    path = tmp_path / "test_x.py"
    path.write_text(
        "import pytest\n\n\n@pytest.mark.skipif(True, reason='r')\ndef test_x():\n    pytest.importorskip('m')\n"
    )
    assert runtime_skips(path) == ["test_x.py:6 pytest.importorskip(...)"]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("CI") != "true", reason="CI only (CI=true): locally an optional package may be absent"
)
def test_in_ci_no_graded_test_skips_but_for_a_gpu(tmp_path):
    (tmp_path / "labkit_skip_probe.py").write_text(PROBE)
    out = tmp_path / "skips.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "LABKIT_SKIP_PROBE": str(out)}
    folders = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/stage*") if p.is_dir())
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "labkit_skip_probe"]
    run = subprocess.run([*cmd, "--impl", "solution", *folders], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0 and out.is_file(), f"collecting the graded tests failed:\n{run.stdout[-3000:]}"
    skips = json.loads(out.read_text())
    others = [f"{s['id']}: {s['reason']}" for s in skips if not s["gpu"]]
    assert not others, (
        f"{len(others)} graded tests skip in CI for a reason other than a GPU; `make test` must install what they "
        f"need (Makefile: test: setup guided llamacpp): {others[:10]}"
    )
