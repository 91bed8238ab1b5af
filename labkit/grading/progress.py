"""Where a learner stands on a row, in the grader's words: the row's TODOs in handout order, started or not, the
tests that cannot pass yet (run not at all), one line per TODO (passes, fails with the first failure, or waits on
another TODO's NotImplementedError), and the table `make grade` prints."""

from pathlib import Path

from .. import STAGES, row_of
from . import todo


def row_todos(course: Path, source: Path, number: str) -> list[dict]:
    """The row's TODOs in handout order (section, then file order), each started or not in `course`."""
    folder = STAGES[number][0]
    found = []
    for module, todos in todo.stage_todos(source, folder).items():
        for name, section in todos:
            if row_of(number[:2], section[0]) == number:  # row 02 is lab.ipynb, 02b lab2/lab3.ipynb
                found.append({"name": name, "module": module, "section": list(section)})
    for t in found:
        t["started"] = not todo.untouched(course, folder, t["module"], t["name"])
    return sorted(found, key=lambda t: t["section"])


def not_started(tests: list[dict], todos: list[dict], any_started: bool) -> set[str]:
    """The tests that cannot pass yet: those of a section whose TODOs are all untouched, every test of a part 2
    notebook none of whose TODOs is started (untouched_notebooks), and while no TODO of the stage is started,
    those of no section. They are reported without running."""
    started = {tuple(t["section"]) for t in todos if t["started"]}
    sections = {tuple(t["section"]) for t in todos}
    idle = untouched_notebooks(todos)
    return {
        t["id"]
        for t in tests
        if (t["section"] is None and not any_started)
        or (t["section"] is not None and (tuple(t["section"]) in sections - started or t["section"][0] in idle))
    }


def untouched_notebooks(todos: list[dict]) -> set[int]:
    """The part 2 notebooks (2 for lab2.ipynb) none of whose TODOs is started. Their sections without a TODO of
    their own wait on the notebook's TODOs too (stage 07's disaggregated fleet, lab5 §2, runs lab5 §1's KV
    connector), so none of their tests runs: a fleet started only to fail costs a half-done row seconds."""
    begun = {t["section"][0] for t in todos if t["started"]}
    return {t["section"][0] for t in todos if t["section"][0] > 1} - begun


def section_name(section) -> str:
    """§3 for lab.ipynb §3, lab2 §1 for a second part."""
    return f"§{section[1]}" if section[0] == 1 else f"lab{section[0]} §{section[1]}"


def todo_report(todos: list[dict], tests: list[dict], cases: dict[str, dict], folder: str, course: Path) -> list[dict]:
    """One line per TODO: not started, or the tests of its section that call it (all of its section's
    if none names it) and the first of them that fails. A failure raised by another TODO's
    NotImplementedError is that TODO's to fix, not this one's: it counts apart as "waiting"."""
    lines = []
    for t in todos:
        line = {"section": section_name(t["section"]), "name": t["name"], "state": "not started"}
        if not t["started"]:
            path = todo.module_path(course / folder, t["module"])
            where = [n for n, msg in todo.todos(_read(path)) if f": {t['name']} — " in msg]
            line["where"] = f"{path.relative_to(course)}:{where[0]}" if where else ""
            lines.append(line)
            continue
        same = [x for x in tests if x["section"] == t["section"]]
        mine = [x for x in same if t["name"] in x["todos"]] or same
        graded = [cases[x["id"]] for x in mine if cases[x["id"]]["outcome"] != "skipped"]
        failed = [c for c in graded if c["outcome"] == "failed"]
        waiting = [c for c in failed if (other := waiting_on(c)) and other != line["name"]]
        failed = [c for c in failed if c not in waiting]
        state = "fails" if failed else "waiting" if waiting else "passes"
        line |= {"state": state, "tests": len(graded), "failed": len(failed), "waiting": len(waiting)}
        if first := (failed or waiting)[:1]:  # the learner's own failure first; else where the wait shows
            line |= {"test": first[0]["test"].rsplit("::", 1)[-1], "message": first[0]["message"]}
        if waiting:
            blockers = sorted({waiting_label(c, t["section"][0]) for c in waiting})
            line["waiting_on"] = ", ".join(blockers)
        lines.append(line)
    return lines


def waiting_on(case: dict) -> str | None:
    """The TODO whose NotImplementedError failed this case ("Scheduler.schedule"), or None."""
    m = todo.NAME.search(case.get("todo") or "")
    return m.group(1) if m and case["outcome"] == "failed" else None


def waiting_label(case: dict, notebook: int | None = None) -> str:
    """§4 Scheduler.schedule, lab2 §1 Radix.insert: the TODO a failure waits on, as the report names it. Waited on
    from another notebook's TODO (`notebook`), it names its own file: lab4's line reads "lab.ipynb §5 warp", not
    "§5 warp", which would read as lab4's §5."""
    m = todo.NAME.search(case["todo"])
    nb, k = int(m.group(2)[3:] or 1), int(m.group(3))
    where = section_name((nb, k)) if notebook in (None, nb) else f"lab{'' if nb == 1 else nb}.ipynb §{k}"
    return f"{where} {m.group(1)}"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def skip_marks(todos: list[dict], any_started: bool) -> list[str]:
    """The section marks (tests/conftest.py's names: s3, lab2_s1) whose TODOs are all untouched, "lab5" for every
    section of an untouched part 2 notebook; "-" stands for the tests of no section while nothing of the stage is
    started (as in not_started)."""
    started_ = {tuple(t["section"]) for t in todos if t["started"]}
    sections = {tuple(t["section"]) for t in todos} - started_
    marks = [f"s{k}" if nb == 1 else f"lab{nb}_s{k}" for nb, k in sorted(sections)]
    return marks + [f"lab{nb}" for nb in sorted(untouched_notebooks(todos))] + ([] if any_started else ["-"])


def todo_message(number: str, line: dict) -> str:
    """The skeleton's TODO message: stage01: softmax — see lab.ipynb §1."""
    notebook = line["section"][3] if line["section"].startswith("lab") else ""
    return f"stage{number[:2]}: {line['name']} — see lab{notebook}.ipynb §{line['section'].split('§')[1]}"


def started(course: Path, source: Path, folder: str) -> bool:
    """Whether the learner has started any TODO of the stage folder (either part)."""
    return any(
        not todo.untouched(course, folder, module, name)
        for module, found in todo.stage_todos(source, folder).items()
        for name, _ in found
    )


def print_table(rows: list[dict], verbose: bool, learner: bool = True) -> None:
    print(f"{'stage':<28} {'passed':>9} {'score':>6}  status")
    print("-" * 78)
    for r in rows:
        frac = f"{r['passed']}/{r['total'] if r['total'] is not None else '–'}"
        print(f"{r['stage'] + ' ' + r['folder']:<28} {frac:>9} {r['score']:>5.0f}%  {r['status']}")
        for line in r["todos"] if verbose else []:
            print(f"{'':<4}{todo_line(line)}")
            for text in line.get("message", "").splitlines()[: 12 if line is first_failing(r) else 4]:
                print(f"{'':<14}{text[:150]}")
        for why in r.get("skipped_because", []) if verbose else []:
            print(f"{'':<4}skipped, not graded: {why[:150]}")
        if r["hint"] and r["status"] != "complete":
            first, *rest = r["hint"].splitlines()
            print(f"{'':<{4 if verbose else 30}}↳ next: {first[:150]}")
            for text in [] if verbose else rest[:8]:
                print(f"{'':<34}{text[:150]}")
    done = sum(r["status"] == "complete" for r in rows)
    print("-" * 78)
    more = " Work a stage in its lab.ipynb, then `make grade STAGE=NN`." if learner else ""
    print(f"{done}/{len(rows)} rows complete.{more}")


def first_failing(row: dict):
    return next((x for x in row["todos"] if x["state"] == "fails"), None)


def todo_line(line: dict) -> str:
    head = f"{line['section']:<9} {line['name']:<26}"
    if line["state"] == "not started":
        return f"{head} · not started" + (f"  [{line['where']}]" if line.get("where") else "")
    if line["state"] == "passes":
        return f"{head} ✓ {line['tests']} test{'s' * (line['tests'] != 1)} pass"
    waiting = f"{line['waiting']} waiting on {line['waiting_on']}" if line.get("waiting") else ""
    if line["state"] == "waiting":
        return f"{head} … {waiting} (of {line['tests']}; none fails on its own)"
    more = f"; {waiting}" if waiting else ""
    return f"{head} ✗ {line['failed']} of {line['tests']} fail; first: {line['test']}{more}"
