"""Write the learner edition of the course: everything but the answers.

    make student-edition OUT=../course-learner             a folder
    python -m labkit.grading.release --branch learner               a commit on branch `learner`

The edition is made from the files git tracks in this checkout (run it on a clean `main`), so the
same commit always gives the same edition. It leaves out the reference solutions, the mutation
catalogue and its target, INSTRUCTORS.md and the README's pointer to it, CONTRIBUTING.md; it checks that no notebook,
benchmark or module it keeps imports the solutions. Regenerating on a branch adds a commit on top
of the previous edition, so learners who cloned it pull later fixes as a fast-forward.
"""

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import ROOT
from . import todo

LEFT_OUT = (
    "solutions/",
    "tests/meta/mutants/",
    "labkit/grading/mutants.py",
    "tests/meta/test_mutants.py",
    "INSTRUCTORS.md",
    "CONTRIBUTING.md",  # how to change the course: its guarantees, make test, make mutants, the solutions
)
INSTRUCTORS = re.compile(r"<!-- instructors-only -->.*?<!-- /instructors-only -->\n?", re.S)
POINTER = (
    "*This is the learner edition of the course. The reference solutions and the instructors' notes "
    "are not part of it; your instructor grades your copy with the same tests as `make grade`.*\n"
)
# Makefile lines the edition changes (the default implementation, serve's solution switch), and
# the instructors' targets it drops: each target is a paragraph; one that runs these goes.
MAKEFILE = [
    (re.compile(r"^IMPL \?= solution$", re.M), "IMPL ?= student"),
    (re.compile(r"\$\(if \$\(filter solution,\$\(IMPL\)\),solutions\.\)"), ""),
]
# make test runs every test against the solutions and the guarantees that the untouched skeleton fails them:
# in a learner's copy it would fail as soon as they wrote any code. The edition offers make grade instead.
INSTRUCTOR_TARGETS = ("labkit.grading.mutants", "labkit.grading.release", "labkit.grading.suite")
# Words for the instructors' checkout that the edition says for its own reader, where they occur
# (tests/meta/test_release.py greps the edition for what it lacks).
FOR_LEARNERS = {
    "Makefile": [
        (re.compile(r"\(reference solution unless\n## IMPL=student\) "), "(your code)\n## "),
        (re.compile(r"^## make serve \[IMPL=student\] ", re.M), "## make serve "),
    ],
    "README.md": [
        (re.compile(r"^make test +#.*\n", re.M), ""),
        (  # the edition's server runs the learner's stage 04, which starts as TODOs: the labs come first
            re.compile(r"^make setup && make serve +# (.*)\n +# served by .*\n", re.M),
            r"make setup && make lab     # \1\n                           # then Jupyter on the handouts; once your stage 04 passes, make serve chats with it\n",
        ),
        (re.compile(r"make grade, make test, the learner edition"), "make grade"),
    ],
    "stage04_batching/README.md": [
        (re.compile(r"-m solutions\.stage04_batching\.serve"), "-m stage04_batching.serve"),
        (re.compile(r" \(default: the reference one\)"), ""),  # the edition's make serve runs your code
    ],
}
SOLUTION_IMPORT = re.compile(r"^\s*(from|import)\s+solutions\b|import_module\(\s*['\"]solutions\b", re.M)


def tracked_files(root: Path, allow_dirty: bool) -> list[str]:
    """The files git tracks in `root`; refuses a checkout with uncommitted changes unless allowed."""
    git = ["git", "-C", str(root)]
    if (
        not allow_dirty
        and subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout
    ):
        raise SystemExit(
            "the checkout has uncommitted changes: commit them (the edition is made from main) or pass --allow-dirty"
        )
    out = subprocess.run([*git, "ls-files", "-z"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{root} is not a git checkout: the edition is made from the course's repository.")
    return sorted(f for f in out.stdout.split("\0") if f and (root / f).is_file())


def write_edition(out: Path, root: Path = ROOT, allow_dirty: bool = False) -> list[str]:
    """Write the learner edition of `root` into the empty folder `out`; return the files written."""
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass a new folder.")
    kept = [f for f in tracked_files(root, allow_dirty) if not f.startswith(LEFT_OUT)]
    for rel in kept:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, out / rel)
    readme = out / "README.md"
    text, n = INSTRUCTORS.subn(POINTER, readme.read_text())
    if n == 0:
        raise SystemExit("README.md: no <!-- instructors-only --> section found; update labkit/grading/release.py")
    readme.write_text(re.sub(r"^solutions/ .*\n", "", text, flags=re.M))  # and its line in the layout
    makefile = out / "Makefile"
    text = makefile.read_text()
    for pattern, new in MAKEFILE:
        text, n = pattern.subn(new, text)
        if n == 0:
            raise SystemExit(f"Makefile: expected to find {pattern.pattern!r}; update labkit/grading/release.py")
    for pattern, new in FOR_LEARNERS["Makefile"]:
        text = pattern.sub(new, text)
    paragraphs = [p for p in text.split("\n\n") if not any(t in p for t in INSTRUCTOR_TARGETS)]
    dropped = {m for p in text.split("\n\n") for m in re.findall(r"^([\w-]+):", p, re.M)} - {
        m for p in paragraphs for m in re.findall(r"^([\w-]+):", p, re.M)
    }
    text = "\n\n".join(paragraphs)
    for target in dropped:  # and out of .PHONY
        text = re.sub(rf"^(\.PHONY:.*?) {re.escape(target)}\b", r"\1", text, flags=re.M)
    makefile.write_text(text)
    for name, subs in FOR_LEARNERS.items():
        if name != "Makefile" and (out / name).is_file():
            text = (out / name).read_text()
            for pattern, new in subs:
                text = pattern.sub(new, text)
            (out / name).write_text(text)
    # The skeleton's TODO list as shipped: the grader and the section marks still need a TODO's name and §
    # after the learner has replaced its statement with their code.
    todo.write_manifest(out, [f for f in sorted({p.split("/")[0] for p in kept}) if f.startswith("stage")])
    leaks = [rel for rel in kept if _imports_solutions(out / rel)]
    if leaks:
        raise SystemExit(f"these files import the solutions, which the edition leaves out: {leaks}")
    return kept


def _imports_solutions(path: Path) -> bool:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return any(SOLUTION_IMPORT.search("".join(c["source"])) for c in cells if c["cell_type"] == "code")
    if path.suffix == ".py":
        return bool(SOLUTION_IMPORT.search(path.read_text())) or _imports_solutions_ast(path)
    return path.name == "Makefile" and "solutions." in path.read_text()


def _imports_solutions_ast(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "solutions":
            return True
    return False


def commit_to_branch(branch: str, root: Path = ROOT, allow_dirty: bool = False) -> str:
    """Commit the edition onto `branch` (created, or advanced with the previous edition as parent)."""
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    parent = subprocess.run(
        [*git, "rev-parse", "-q", "--verify", f"refs/heads/{branch}"], capture_output=True, text=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        tree_dir = Path(tmp) / "edition"
        tree_dir.mkdir()
        write_edition(tree_dir, root, allow_dirty)
        env = os.environ | {"GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_WORK_TREE": str(tree_dir)}
        subprocess.run([*git, "add", "-A", "."], env=env, check=True, cwd=tree_dir)
        tree = subprocess.run([*git, "write-tree"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    parents = ["-p", parent.stdout.strip()] if parent.returncode == 0 else []
    if parents:
        previous = subprocess.run([*git, "rev-parse", f"{parents[1]}^{{tree}}"], capture_output=True, text=True)
        if previous.stdout.strip() == tree:  # nothing changed since the last edition: no empty commit
            return parents[1]
    message = f"learner edition of {head}"
    commit = subprocess.run(
        [*git, "commit-tree", tree, *parents, "-m", message], capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run([*git, "update-ref", f"refs/heads/{branch}", commit], check=True)
    return commit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="write the edition into this new folder")
    where.add_argument("--branch", help="commit the edition onto this git branch")
    ap.add_argument("--allow-dirty", action="store_true", help="use the working tree's tracked files as they are")
    args = ap.parse_args(argv)
    if not (ROOT / "solutions").is_dir():
        print(
            "this is already a learner edition (no solutions/): make it from the instructors' repository",
            file=sys.stderr,
        )
        return 2
    if args.out:
        kept = write_edition(args.out.resolve(), allow_dirty=args.allow_dirty)
        print(f"learner edition: {len(kept)} files written to {args.out}")
    else:
        commit = commit_to_branch(args.branch, allow_dirty=args.allow_dirty)
        print(f"learner edition committed on branch {args.branch}: {commit[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
