"""Run pytest in a subprocess and read its JUnit XML: how `make test` and the guarantees run pytest.

(The grader does not use it: a learner's code could rewrite the XML. See labkit.grading.outcomes.)"""

import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Case:
    name: str
    outcome: str  # passed | failed | skipped
    message: str = ""
    details: str = ""  # the traceback, for failures


@dataclass
class Run:
    returncode: int
    seconds: float
    cases: list[Case] = field(default_factory=list)
    timed_out: bool = False
    output: str = ""

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)


def run_pytest(args: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None) -> Run:
    """pytest <args> in a fresh interpreter; a run past `timeout` seconds is killed and marked."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *args, f"--junitxml={xml}", "-p", "no:cacheprovider"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, so a timeout kills workers and servers too
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return Run(-1, time.perf_counter() - t0, _cases(xml), timed_out=True, output=out or "")
        return Run(proc.returncode, time.perf_counter() - t0, _cases(xml), output=out or "")


def _cases(xml: Path) -> list[Case]:
    if not xml.exists():
        return []
    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}".lstrip(":")
        outcome, message, details = "passed", "", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                details = child.text or ""
                outcome, message = "failed", child.get("message") or (details.strip().splitlines() or [""])[-1]
                break
            if child.tag == "skipped":
                outcome, message = "skipped", child.get("message", "")
        cases.append(Case(name, outcome, message, details))
    return cases
