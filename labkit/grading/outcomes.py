"""pytest plugin of the grader: each test's outcome, sent as it happens, down a pipe to the grader.

    pytest -p labkit.grading.outcomes ...    with LABKIT_OUTCOMES_FD=<write end of a pipe>

One JSON line per finished test: {"id": nodeid, "outcome": passed|failed|skipped, "message": ...}.
Nothing is written to a file or named on the command line, so a submission has no report to
rewrite; a test the pipe never hears about counts as failed (labkit.grading.grade).

A test may skip only by the course's markers, set at collection (`gpu` without a GPU, `skipif` on an optional
package that is not installed), or by pytest.importorskip, called from a test or fixture of the course, for an
optional package this machine cannot import: that skip is reported as "needs llguidance (make guided)", never
as the learner's failure. Any other skip raised while a test runs counts as the code under test's failure.

With LABKIT_WORKER set (labkit.grading.grade --submission, most rows), the learner's code runs in a
worker process (labkit.grading.worker) and this process is made non-dumpable, so neither the worker nor
any process a test starts can open this one's /proc/PID/fd or memory. Without it (self-assessment,
and the rows INSTRUCTORS.md's threat model names) the learner's code runs in this same process and could
still reach pytest's machinery. The plugin therefore checks, after every test, that what decides an outcome is what it was before
the first test: pytest's hook implementations and the assertion helpers tests call. If anything
changed, it reports "tampered" and the grader scores the whole row zero. This detects the known
routes (a hook planted via gc, a patched assert_allclose); it is not isolation (INSTRUCTORS.md, threat model).
"""

import ctypes
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

from .. import impl
from . import worker

_MESSAGE_CHARS = 1500  # a failure message: the exception's text, condensed (condense), cut to this length
_MESSAGE_LINES = 12
SECTION_MARK = re.compile(r"(?:lab(\d)_)?s(\d+)")  # tests/conftest.py's marks: s3 is lab.ipynb §3, lab2_s1
# A TODO's message, from either form: NotImplementedError("stage02: f — see lab.ipynb §3") or,
# in a Triton kernel, tl.static_assert(False, "stage05: kernel — see lab.ipynb §4").
TODO = re.compile(r"stage\d\d: [^\n]+? — see lab\d?\.ipynb §\d+")
_ASSERTIONS = {
    "numpy.testing": ("assert_allclose", "assert_array_equal", "assert_equal", "assert_array_almost_equal"),
    "torch.testing": ("assert_close",),
}
LEARNER_FILE = re.compile(r"(?:^|/)(stage\d\d_\w+/(?:\w+/)?\w+\.py)$")  # or a sub-package's: fleet/router.py
# The optional packages a graded test may need, and the command that installs each (the Makefile's targets).
OPTIONAL = {"llguidance": "make guided", "xgrammar": "make guided", "llama_cpp": "make llamacpp"}


def _guarded() -> dict[str, object]:
    """What decides an outcome, by identity: pytest's report path and the assertion helpers of the
    libraries already imported when collection ends (the course's conftest imports torch)."""
    from _pytest import reports, runner

    objects = {
        "runner.call_and_report": runner.call_and_report,
        "runner.CallInfo.from_call": runner.CallInfo.__dict__["from_call"],
        "reports.TestReport.from_item_and_call": reports.TestReport.__dict__["from_item_and_call"],
        "reports.TestReport.__init__": reports.TestReport.__init__,
        "builtins.AssertionError": AssertionError,
    }
    for module, names in _ASSERTIONS.items():
        if module in sys.modules:
            objects |= {f"{module}.{n}": getattr(sys.modules[module], n, None) for n in names}
    return objects


class Outcomes:
    def __init__(self, config, fd: int):
        self.config, self.out = config, os.fdopen(fd, "w", buffering=1)
        self.seen: dict[str, dict] = {}
        self.before, self.may_skip = None, set()

    def _fingerprint(self):
        hooks = {
            name: tuple(id(h.function) for h in getattr(self.config.hook, name).get_hookimpls())
            for name in dir(self.config.hook)
            if name.startswith("pytest_")
        }
        plugins = tuple(sorted(id(p) for p in self.config.pluginmanager.get_plugins()))
        return hooks, plugins, {k: id(v) for k, v in _guarded().items()}

    def _changed(self) -> list[str]:
        now = self._fingerprint()
        named = [k for k, v in now[2].items() if k in self.before[2] and v != self.before[2][k]]
        return named or (["pytest's hooks"] if now[:2] != self.before[:2] else [])

    def _send(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")

    def pytest_collection_finish(self, session):
        self.before = self._fingerprint()  # after collection, before any learner code ran
        # Only the course may skip a test (a `gpu` test without a GPU): by a marker set at collection, or by
        # importorskip of a missing optional package (missing_package).
        self.may_skip = {
            i.nodeid for i in session.items if i.get_closest_marker("skip") or i.get_closest_marker("skipif")
        }

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        if call.excinfo is not None and call.excinfo.errisinstance(pytest.skip.Exception):
            # the machine lacks an optional package: not graded, and not the learner's failure
            if needs := missing_package(call.excinfo, item.config.rootpath / "tests"):
                self.seen.setdefault(item.nodeid, {"outcome": "passed", "message": ""})["needs"] = needs
        elif call.excinfo is not None:
            case = self.seen.setdefault(item.nodeid, {"outcome": "passed", "message": ""})
            case.setdefault("type", call.excinfo.typename)
            if call.excinfo.type is worker.WorkerError:  # the worker died: a crash, in the course's words
                case.update(crashed=True, ours=str(call.excinfo.value)[:_MESSAGE_CHARS])
            where = getattr(call.excinfo.value, "labkit_where", "")  # raised in the worker
            if isinstance(where, str) and re.fullmatch(r"stage\d\d_\w+/(?:\w+/)?\w+\.py:\d+", where):
                case.setdefault("where", where[:_MESSAGE_CHARS])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report):
        case = self.seen.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if report.failed and case["outcome"] != "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash else str(report.longrepr)
            case.update(outcome="failed", message=condense(text))
            if todo := TODO.search(str(report.longrepr)):
                case["todo"] = todo.group(0)[:_MESSAGE_CHARS]
            if where := _deepest_learner_frame(report.longrepr):
                case.setdefault("where", where)
        elif report.skipped and case["outcome"] == "passed":
            if needs := case.pop("needs", None):
                case.update(outcome="skipped", message=needs)
                return
            if report.nodeid not in self.may_skip:
                ours = "the code under test skipped this test; only the course's markers may"
                case.update(outcome="failed", message=ours, ours=ours)
                return
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            case.update(outcome="skipped", message=str(reason)[:_MESSAGE_CHARS])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logfinish(self, nodeid):
        if self.before is not None and (changed := self._changed()):
            self._send({"tampered": f"the code under test replaced {', '.join(changed)} while it was graded"})
            self.before = None  # report it once; the grader zeroes the row
        self._send({"id": nodeid, **self.seen.pop(nodeid, {"outcome": "failed", "message": "no report"})})


def missing_package(excinfo, tests: Path) -> str | None:
    """ "needs llguidance (make guided)" for a skip that pytest.importorskip raised, called from the course's
    `tests` folder (a test or a fixture, never a stage module) for a package this machine cannot import; else None.

    Such a skip says nothing about the learner's code: it is reported as skipped, with the command that installs
    the package, not as a failure. Any other skip raised while a test runs stays the code under test's."""
    entries = list(excinfo.traceback)
    for caller, entry in zip(entries, entries[1:], strict=False):
        code = entry.frame.code.raw
        if code.co_name != "importorskip" or Path(code.co_filename).parent.name != "_pytest":
            continue
        if not Path(caller.path).is_relative_to(tests):
            return None  # importorskip from the code under test (a stage module): that is its own skip
        name = str(entry.frame.f_locals.get("modname", ""))
        top = name.split(".")[0]
        if not re.fullmatch(r"[A-Za-z_]\w*(?:\.\w+)*", name) or _importable(top):
            return None
        return f"needs {top} ({OPTIONAL.get(top, f'pip install {top}')}); not graded"
    return None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def condense(text: str) -> str:
    """An exception's text as a learner needs it: the message the test wrote and the first mismatches
    (NumPy's and torch.testing's closeness reports), without pytest's restatement of the assert, array
    dumps, or all but the last lines of a child process's traceback."""
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        if line.startswith((" ACTUAL: ", " DESIRED: ")):
            break  # array dumps: the mismatch lines above already say where and by how much
        if re.match(r"(assert |\s*\+\s+(where|and) )", line) and i > 0:
            break  # pytest's restatement of the failed assert
        if line.startswith("Traceback (most recent call last):"):
            frames = [x for x in lines[i + 1 :] if not x.startswith(" ")]
            kept += frames[-2:]  # the child's exception, which says what went wrong
            break
        kept.append(line[:200])
    if len(kept) > _MESSAGE_LINES:
        kept = kept[: _MESSAGE_LINES - 1] + [f"... ({len(kept) - _MESSAGE_LINES + 1} more lines)"]
    return "\n".join(kept)[:_MESSAGE_CHARS]


def _deepest_learner_frame(longrepr) -> str:
    """'stage02_kv_cache/kv_cache.py:41' for the last traceback frame in a stage module, or ''."""
    chain = getattr(longrepr, "chain", None) or []
    for tb, _, _ in reversed(chain):
        for entry in reversed(getattr(tb, "reprentries", [])):
            loc = getattr(entry, "reprfileloc", None)
            if loc and (m := LEARNER_FILE.search(loc.path)) and not ("solutions/" in loc.path or "tests/" in loc.path):
                return f"{m.group(1)}:{loc.lineno}"
    return ""


class Collect:
    """LABKIT_COLLECT=path: each test's ID and the marks the grader reads, written as JSON once the course's
    conftest has marked them; LABKIT_SKIP_SECTIONS="s2 lab2_s1 lab5 -": deselect those sections' tests ("lab5":
    every section of lab5.ipynb, "-": the tests of no section), which the grader reports as not started without
    running them."""

    def __init__(self, path: str, skip: set[str]):
        self.path, self.skip = path, skip

    @pytest.hookimpl(trylast=True)  # after tests/conftest.py has put its marks on
    def pytest_collection_modifyitems(self, config, items):
        tests, drop = [], []
        for item in items:
            names = [m.name for m in item.iter_markers()]
            mark = next((n for n in names if SECTION_MARK.fullmatch(n)), None)
            m = SECTION_MARK.fullmatch(mark or "")
            todos = item.get_closest_marker("todos")
            tests.append(
                {
                    "id": item.nodeid,
                    "section": [int(m[1] or 1), int(m[2])] if m else None,
                    "todos": list(todos.args) if todos else [],
                    "in_process": item.get_closest_marker("in_process") is not None,
                }
            )
            if (mark or "-") in self.skip or (m and m[1] and f"lab{m[1]}" in self.skip):
                drop.append(item)
        with open(self.path, "w") as f:
            json.dump(tests, f)
        if drop:
            config.hook.pytest_deselected(items=drop)
            dropped = {id(i) for i in drop}
            items[:] = [i for i in items if id(i) not in dropped]


def pytest_configure(config):
    if path := os.environ.pop("LABKIT_COLLECT", None):
        skip = set(os.environ.pop("LABKIT_SKIP_SECTIONS", "").split())
        config.pluginmanager.register(Collect(path, skip), "labkit-collect")
    fd = os.environ.pop("LABKIT_OUTCOMES_FD", None)
    if os.environ.pop("LABKIT_WORKER", None) and fd is not None:
        impl.install_loader(worker.load)
    if fd is not None:
        os.set_inheritable(int(fd), False)  # no process a test starts gets the pipe
        # PR_SET_DUMPABLE 0: other processes of this user (the worker, a server a test starts)
        # cannot open /proc/PID/fd/N, /proc/PID/mem or ptrace this one.
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
        config.pluginmanager.register(Outcomes(config, int(fd)), "labkit-outcomes")
