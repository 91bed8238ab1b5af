"""pytest plumbing shared by every stage: the --impl switch and the `impl` fixture, markers."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=["student", "solution"],
        default=None,
        help="whose stage code the graded tests run: the learner's skeleton (default) or the reference solution",
    )
    parser.addoption(
        "--file-order",
        action="store_true",
        help="run the test files named in the order given, not in handout order (the mutant runner's -x)",
    )


def pytest_configure(config):
    impl = config.getoption("--impl")
    if impl:
        os.environ["LABS_IMPL"] = impl  # subprocesses (dist tests, servers) inherit the choice


def pytest_collection_modifyitems(config, items):
    from labkit.device import has_gpu

    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")  # session: module-scoped fixtures (a live server) use it too
def impl():
    """impl("stage02_kv_cache.kv_cache") -> the module from the implementation in force."""
    from labkit.impl import load

    return load
