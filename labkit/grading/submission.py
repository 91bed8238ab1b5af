"""A learner's copy graded by an instructor (labkit.grading.grade --submission): a clean copy of the course without
the solutions, the learner-editable files copied into it (a module that imports the solutions is replaced by a
stub that says why), and the environment a sandboxed row runs in (INSTRUCTORS.md, "Threat model")."""

import ast
import os
import shutil
import sys
from pathlib import Path

from .. import STAGES, triton_interpret
from . import todo

# Environment a sandboxed row inherits: nothing of the instructor's beyond what the tests need.
PASS_ENV = ("PATH", "LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED")
IMPORTS_SOLUTIONS = (
    "this module imports from `solutions`, the reference implementation, which a graded copy does not "
    "contain: a module must be the learner's own code, so every test that uses it scores zero"
)
SOLUTIONS_STUB = f'''"""Not part of a graded copy."""

raise ImportError({IMPORTS_SOLUTIONS!r})
'''


def prepare_submission(submission: Path, workdir: Path, source: Path) -> Path:
    """A clean copy of the course, without the solutions, ready for the learner's files."""
    if not submission.is_dir():
        raise SystemExit(f"--submission {submission}: not a folder. Pass the learner's copy of the course.")
    course = workdir / "course"
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", "bench_results", ".grade", "solutions", "mutants")
    shutil.copytree(source, course, ignore=skip)
    (course / "solutions").mkdir()
    (course / "solutions" / "__init__.py").write_text(SOLUTIONS_STUB)  # a clear error for `import solutions`
    todo.write_manifest(course, dict.fromkeys(folder for folder, _ in STAGES.values()))  # the skeleton's TODOs
    return course


def copy_learner_files(submission: Path, course: Path, source: Path) -> int:
    """Copy the learner-editable modules from the submission; return how many were found."""
    copied = 0
    for folder in dict.fromkeys(folder for folder, _ in STAGES.values()):
        for path in todo.learner_files(source / folder):
            rel = path.relative_to(source / folder)  # fleet/router.py in stage 07
            src = submission / folder / rel
            if src.is_file():
                text = src.read_text(errors="replace")
                if imports_solutions(text):
                    print(f"{folder}/{rel}: {IMPORTS_SOLUTIONS}", file=sys.stderr)
                    text = SOLUTIONS_STUB
                (course / folder / rel).write_text(text)
                copied += 1
    if copied == 0:
        raise SystemExit(
            f"--submission {submission}: found none of the stage modules (e.g. stage01_forward_numpy/*.py)."
        )
    return copied


def imports_solutions(source: str) -> bool:
    """Whether a module names the reference package in an import or an import string."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False  # it fails every test on its own
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        if any(n == "solutions" or n.startswith("solutions.") for n in names):
            return True
    return False


def submission_env(course: Path) -> dict:
    from ..checkpoint import REAL_MODEL_ENV, real_model_folder

    scratch = course / ".grade"
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    return env | {
        REAL_MODEL_ENV: str(real_model_folder()),  # resolved here: HOME below is the scratch's, not the user's
        "LABS_IMPL": "student",
        "PYTHONPATH": str(course),
        "TRITON_INTERPRET": triton_interpret(),
        "HOME": str(scratch / "home"),
        "TMPDIR": str(scratch / "tmp"),
        "MPLBACKEND": "Agg",
        "TOKENIZERS_PARALLELISM": "false",
    }
