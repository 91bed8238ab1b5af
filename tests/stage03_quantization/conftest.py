"""Shared fixtures for the stage-03 tests: one torch thread."""

import pytest

from labkit.device import pin_threads


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are small: a second intra-op thread only adds OpenMP synchronisation, which
    stalls badly when the CPU is shared. Restored after each test."""
    with pin_threads(1):
        yield
