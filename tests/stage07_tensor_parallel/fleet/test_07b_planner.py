"""§4 of lab5.ipynb: the planner's arithmetic (DistServe). A fleet of p prefill and d decode instances serves
the smaller of p x g_p and d x g_d; the best split of a GPU budget, checked by hand and against every split
enumerated here; the fewest instances for a target rate, by hand and against a count upward."""

import math
import random

import pytest

MODULE = "stage07_tensor_parallel.fleet.planner"


def test_split_goodput_is_the_slower_pools_capacity(impl):
    planner = impl(MODULE)
    # 2 prefill instances at 5 req/s carry 10 req/s, 3 decode ones at 2 req/s only 6: decode sets the pace.
    assert planner.split_goodput(2, 3, 5.0, 2.0) == pytest.approx(6.0)
    assert planner.split_goodput(4, 1, 1.5, 9.0) == pytest.approx(6.0)  # here prefill does
    rng = random.Random(0)
    for _ in range(100):
        p, d, gp, gd = rng.randint(0, 9), rng.randint(0, 9), rng.uniform(0.1, 10), rng.uniform(0.1, 10)
        want = min(p * gp, d * gd)
        assert planner.split_goodput(p, d, gp, gd) == pytest.approx(want), f"seed=0, p={p}, d={d}, g={gp}, {gd}"
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="goodput"):
            planner.split_goodput(1, 1, bad, 1.0)


def test_best_split_by_hand(impl):
    planner = impl(MODULE)
    # Prefill 3x as fast as decode: 8 GPUs as 2 + 6 carry min(6, 6) = 6 req/s (1 + 7: 3; 3 + 5: 5).
    s = planner.best_split(8, 3.0, 1.0)
    assert (s.prefill, s.decode) == (2, 6) and s.goodput == pytest.approx(6.0), s
    assert s.gpus == 8 and s.per_gpu == pytest.approx(0.75), s
    # Decode 10x as fast: all but one GPU prefill (3 + 1 carries min(3, 10) = 3; 2 + 2 only 2).
    s = planner.best_split(4, 1.0, 10.0)
    assert (s.prefill, s.decode) == (3, 1) and s.goodput == pytest.approx(3.0), s
    # Equal rates on 5 GPUs: 2 + 3 and 3 + 2 both carry 2 req/s; the tie goes to fewer prefill instances.
    s = planner.best_split(5, 1.0, 1.0)
    assert (s.prefill, s.decode) == (2, 3) and s.goodput == pytest.approx(2.0), s
    s = planner.best_split(2, 0.5, 4.0)
    assert (s.prefill, s.decode) == (1, 1) and s.goodput == pytest.approx(0.5), s
    with pytest.raises(ValueError, match="at least 2"):
        planner.best_split(1, 1.0, 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_split_beats_every_split_of_the_budget(impl, seed):
    planner = impl(MODULE)
    rng = random.Random(seed)
    for _ in range(40):
        gpus, gp, gd = rng.randint(2, 24), rng.choice([0.5, 1, 2, 3, 4]), rng.choice([0.5, 1, 2, 3, 4])
        every = [(min(p * gp, (gpus - p) * gd), p) for p in range(1, gpus)]  # exact in binary: halves and ints
        top = max(g for g, _ in every)
        fewest = min(p for g, p in every if g == top)
        s = planner.best_split(gpus, gp, gd)
        where = f"seed={seed}, gpus={gpus}, g_p={gp}, g_d={gd}"
        assert (s.prefill, s.decode) == (fewest, gpus - fewest), f"{where}: got {s}, best is {fewest} prefill"
        assert s.goodput == pytest.approx(top), where


def test_min_instances_by_hand(impl):
    planner = impl(MODULE)
    # 10 req/s with 3 req/s prefill and 1.5 req/s decode instances: ceil(3.33) = 4 and ceil(6.67) = 7.
    s = planner.min_instances(10.0, 3.0, 1.5)
    assert (s.prefill, s.decode) == (4, 7) and s.goodput == pytest.approx(10.5), s
    s = planner.min_instances(6.0, 3.0, 1.5)  # exact multiples need no spare instance
    assert (s.prefill, s.decode) == (2, 4) and s.goodput == pytest.approx(6.0), s
    s = planner.min_instances(2.1, 0.7, 2.1)  # 2.1 / 0.7 is 3.0000000000000004 in floating point
    assert (s.prefill, s.decode) == (3, 1), s
    s = planner.min_instances(0.2, 5.0, 5.0)  # any rate needs one of each
    assert (s.prefill, s.decode) == (1, 1) and s.goodput == pytest.approx(5.0), s
    for bad in (0.0, -2.0, math.inf):
        with pytest.raises(ValueError, match="rate"):
            planner.min_instances(bad, 1.0, 1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_min_instances_is_the_first_count_that_reaches_the_rate(impl, seed):
    planner = impl(MODULE)
    rng = random.Random(seed)
    for _ in range(50):
        rate, gp, gd = rng.uniform(0.1, 50), rng.uniform(0.2, 8), rng.uniform(0.2, 8)
        p = next(n for n in range(1, 1000) if n * gp >= rate)  # count upward
        d = next(n for n in range(1, 1000) if n * gd >= rate)
        s = planner.min_instances(rate, gp, gd)
        assert (s.prefill, s.decode) == (p, d), f"seed={seed}, rate={rate}, g_p={gp}, g_d={gd}: got {s}"
        assert s.goodput >= rate * (1 - 1e-9), f"seed={seed}: {s} does not reach {rate}"
