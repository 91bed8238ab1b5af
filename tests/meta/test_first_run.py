"""What a new user meets first: `make setup` says what it is doing, `make lab` starts as root (the user of most
containers and cloud machines), and a handout's output carries no warning about a widget library it does not use."""

import os
import subprocess
import sys

from labkit import ROOT


def dry_run(*args) -> str:
    # Under `make test` the parent make's MAKEFLAGS/MAKELEVEL would make this one print "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_lab_passes_allow_root_only_to_root():
    assert "--allow-root" in dry_run("lab", "USER_ID=0").splitlines()[-1]
    assert "--allow-root" not in dry_run("lab", "USER_ID=1000").splitlines()[-1]


def test_make_setup_says_what_it_installs_and_how_long_before_pip_starts():
    recipe = dry_run("-B", ".venv/.installed")
    before, pip = recipe.split("pip install", 1)
    assert "minutes" in before, f"make setup must give an estimate before the long install:\n{recipe}"
    assert " -q " not in pip.split("\n", 1)[0], "pip's package lines are the progress a user sees"


FAKE_KERNEL = """
import sys, types, warnings
import IPython
class Shell:
    config = {"IPKernelApp": {}}  # what tqdm looks for to tell a Jupyter kernel (older tqdm)
IPython.get_ipython = Shell
sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")  # (newer tqdm)
sys.modules["ipywidgets"] = None  # as in a venv without it
import labkit
with warnings.catch_warnings(record=True) as caught:  # (tqdm catches its own warning raised as an error)
    import tqdm.auto
assert not caught, [str(w.message) for w in caught]
"""


def test_a_handout_kernel_without_ipywidgets_shows_no_tqdm_warning():
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", FAKE_KERNEL], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1500:]
