"""Test power: the mutant catalogue (tests/meta/mutants) is valid, and a fixed sample of its learner
bugs is caught by the graded tests. The full measurement is `make mutants` (about ten minutes with 2 jobs)."""

import subprocess
import sys

from labkit import ROOT


def test_the_mutant_catalogue_is_valid():
    from labkit.grading.mutants import ROWS, load, validate

    problems = [p for stage in ROWS for p in validate(stage, load(stage))]
    assert not problems, "fix the catalogue:\n" + "\n".join(problems)


def test_a_fixed_sample_of_learner_bugs_is_caught():
    run = subprocess.run(
        [sys.executable, "-m", "labkit.grading.mutants", "--sample", "1", "--jobs", "1", "--timeout", "300"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, (
        f"a sampled learner bug survived the graded tests:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
    )
