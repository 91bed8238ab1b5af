"""One switch picks whose code runs: the learner's skeleton or the reference solution.

    LABS_IMPL=student   (default) stage modules come from ./stageNN_topic/
    LABS_IMPL=solution  stage modules come from ./solutions/stageNN_topic/

A graded run loads stage modules in a worker process instead: the grader installs its loader with
`install_loader` (labkit.grading.outcomes), and `load` hands it the checked module name.

Tests and notebooks never import a stage module directly; they call `load("stage02_kv_cache.kv_cache")`.
Modules inside a stage import each other relatively (`from .paged import ...`), so a stage's
modules always come from the same side. A given module (one without a TODO) exists once, in the
stage folder: each solution package calls `share_given_modules`, so `solutions.stage07_x.run`
is the stage folder's run.py, importing the solution's modules relatively.
"""

import importlib
import os
import re
from types import ModuleType

from . import ROOT

IMPLS = ("student", "solution")
_STAGE_RE = re.compile(r"^stage\d\d_[a-z0-9_]+$")
_loader = None  # set by the grader: name -> module (a proxy of the module imported in its worker)


def install_loader(loader) -> None:
    """Route every later `load` through loader(name); the library never imports the grader itself."""
    global _loader
    _loader = loader


def share_given_modules(path: list[str], package: str) -> None:
    """In solutions/stageNN_x/__init__.py (or a sub-package's, solutions/stageNN_x/fleet/): look for modules in
    the same folder of the stage after the solution's."""
    path.append(str(ROOT.joinpath(*package.split(".")[1:])))


def current() -> str:
    """The implementation in force: $LABS_IMPL, default 'student'."""
    name = os.environ.get("LABS_IMPL", "student").strip().lower()
    if name not in IMPLS:
        raise ValueError(f"LABS_IMPL={name!r} is not one of {IMPLS}; unset it or pick one of those.")
    return name


def load(module: str, impl: str | None = None) -> ModuleType:
    """Import 'stageNN_topic.module' from the learner's folder or the solutions folder."""
    stage = module.split(".", 1)[0]
    if not _STAGE_RE.match(stage):
        raise ValueError(
            f"{module!r} does not start with a stage folder such as 'stage02_kv_cache'; pass 'stageNN_topic.module'."
        )
    impl = impl or current()
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}.")
    if impl == "solution" and not (ROOT / "solutions").is_dir():
        raise ModuleNotFoundError(
            "LABS_IMPL=solution: the reference solutions are not part of this learner edition of the course. "
            "Unset LABS_IMPL (or set it to student) to run your own code."
        )
    if _loader is not None:
        return _loader(module)
    full = module if impl == "student" else f"solutions.{module}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name and full.startswith(e.name):
            raise ModuleNotFoundError(
                f"No module {full!r}: is the stage name right? Stage folders are listed in README.md."
            ) from e
        raise
