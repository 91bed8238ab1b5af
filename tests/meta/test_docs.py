"""The documents a reader meets: a short front door, a README in every stage that names the learner's
files, links and quoted results that exist, and nothing that points outside the repository.

The learner edition is checked too: once labkit.grading.release has left out its files and cut the
README's instructors-only block, no link that remains may lead to a file it left out.
"""

import re
import subprocess
from pathlib import Path

import pytest

from labkit import ROOT, STAGES
from labkit.grading import release, todo

FRONT_DOOR_BYTES = 8 * 1024
OUTSIDE = "/".join(("..", "shared"))  # spelled apart so this file does not name it itself
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT = re.compile(r"bench_results/(?!stageNN)[\w.-]+\.(?:json|png)")  # stageNN.json: a pattern, not a file
FOLDERS = sorted(dict.fromkeys(folder for folder, _ in STAGES.values()))
# A stage folder and each package inside it (stage 07's fleet/): each has a README naming its own files.
PACKAGES = [
    str(init.parent.relative_to(ROOT)) for folder in FOLDERS for init in todo.stage_files(ROOT / folder, "__init__.py")
]


def tracked(root: Path) -> list[str]:
    """The files git tracks in root, plus the new ones it does not ignore (a change not yet committed)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:  # a learner edition written to a folder has no .git: every file counts
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".venv" not in p.parts]
    return sorted({f for f in out.stdout.split("\0") if f and (root / f).is_file()})


def broken_links(md: Path, text: str, exists) -> list[str]:
    """Relative links in `text` (the Markdown file `md`) whose target `exists` rejects."""
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:|#", target):  # a URL or an anchor on the same page
            continue
        path = (md.parent / target.split("#", 1)[0]).resolve()
        if not exists(path):
            bad.append(target)
    return bad


def names_file(readme: str, name: str) -> bool:
    return re.search(rf"(?<![\w/]){re.escape(name)}\b", readme) is not None


def test_the_front_door_is_at_most_8_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= FRONT_DOOR_BYTES, (
        f"README.md is {size} bytes, over {FRONT_DOOR_BYTES}: move detail to the stage READMEs, "
        "MODELS.md or INSTRUCTORS.md"
    )


def test_the_front_door_links_every_stage_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [f for f in FOLDERS if f"({f}/README.md)" not in readme]
    assert not missing, f"README.md's course map does not link these stage READMEs: {missing}"


@pytest.mark.parametrize("folder", PACKAGES)
def test_stage_readme_names_every_todo_file_and_given_module(folder):
    path = ROOT / folder / "README.md"
    assert path.is_file(), f"{folder}/README.md is missing: say what the stage builds and which files are the learner's"
    readme = path.read_text()
    learner = {p.name for p in todo.learner_files(ROOT / folder) if p.parent == ROOT / folder}
    given = {p.name for p in (ROOT / folder).glob("*.py")} - learner - {"__init__.py", "__main__.py"}
    assert learner, f"found no TODO in {folder}"
    missing = sorted(name for name in learner | given if not names_file(readme, name))
    assert not missing, (
        f"{folder}/README.md does not name {missing}: list every file with a TODO and say in one line "
        "what each given module is"
    )
    rows = {name for name in learner | given if re.search(rf"^\|\s*`{re.escape(name)}`", readme, re.M)}
    assert rows == learner, (
        f"{folder}/README.md's table of the learner's files should hold exactly the files with a TODO: "
        f"{sorted(learner - rows)} missing, {sorted(rows - learner)} given (they belong in the list of given modules)"
    )


def test_nothing_points_outside_the_repository():
    hits = []
    for rel in tracked(ROOT):
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if OUTSIDE in text:
            hits.append(rel)
    assert not hits, f"these files point at {OUTSIDE}, which no user of the course has: {hits}"


def markdown_files(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith(".md") and not f.startswith(".")]


def test_markdown_links_resolve():
    files = tracked(ROOT)
    bad = {}
    for rel in markdown_files(files):
        broken = broken_links(ROOT / rel, (ROOT / rel).read_text(), Path.exists)
        if broken:
            bad[rel] = broken
    assert not bad, f"links to files that do not exist: {bad}"


def test_quoted_bench_results_exist():
    files = set(tracked(ROOT))
    missing = {}
    for rel in markdown_files(sorted(files)):
        gone = sorted({r for r in RESULT.findall((ROOT / rel).read_text()) if r not in files})
        if gone:
            missing[rel] = gone
    assert not missing, f"figures quoted from results that are not in bench_results/: {missing}"


@pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="a learner edition has nothing left out to check")
def test_the_learner_edition_has_no_link_to_what_it_leaves_out():
    kept = {f for f in tracked(ROOT) if not f.startswith(release.LEFT_OUT)}
    assert "INSTRUCTORS.md" not in kept, "the learner edition must leave out INSTRUCTORS.md (release.LEFT_OUT)"
    root = ROOT.resolve()

    def shipped(path: Path) -> bool:  # a kept file, or a folder holding one
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else None
        return rel is not None and (rel in kept or any(k.startswith(rel + "/") for k in kept))

    bad = {}
    for rel in markdown_files(sorted(kept)):
        text = (ROOT / rel).read_text()
        if rel == "README.md":
            text = release.INSTRUCTORS.sub(release.POINTER, text)
        broken = broken_links(ROOT / rel, text, shipped)
        if broken:
            bad[rel] = broken
    assert not bad, (
        f"in the learner edition these links lead to files it leaves out: {bad}; "
        "put them inside README.md's instructors-only block or drop them"
    )


def test_the_checks_catch_planted_faults(tmp_path):
    (tmp_path / "a.md").write_text("[ok](b.md) [gone](c.md) [web](https://x.org) [here](#top)")
    (tmp_path / "b.md").write_text("")
    assert broken_links(tmp_path / "a.md", (tmp_path / "a.md").read_text(), Path.exists) == ["c.md"]
    assert names_file("| `engine.py` | the engine |", "engine.py")
    assert not names_file("see `async_engine.py`", "engine.py")
    assert not names_file("labkit/bench/sampling.py", "sampling.py")
