"""The fleet the lab3 tests share: starting one takes seconds (each replica is a process that imports torch
and loads the model), so the files that need a healthy two-replica fleet of the default kind use one."""

import pytest

import labkit


@pytest.fixture(scope="session")
def cache_aware_fleet(impl):
    """Two replicas behind a cache-aware router, pages of 4 tokens, started once per run: test_07b_clients and
    test_07b_fleet (lab3 §3) and the admission flood of test_07b_faults (§5). A test that changes the router
    (its policy, admission, dropped events) puts it back, and none kills a replica (§4's tests have a fleet of
    their own for that)."""
    launch = impl("stage07_tensor_parallel.fleet.launch")
    with launch.Fleet(labkit.TARGET, replicas=2, policy="cache_aware", num_slots=384, page_size=4) as fleet:
        yield fleet
