"""§1 of lab6.ipynb: a partition of the model's units into pipeline stages, balanced by cost, and refused when
wrong. Reference: every contiguous split of a short cost list, enumerated (the slow obvious version)."""

import itertools
import random

import pytest

from labkit.testing import labkit_from_hf, random_llama

PARTITION = "stage07_tensor_parallel.pipeline.partition"
STAGE = "stage07_tensor_parallel.pipeline.stage"


def all_splits(n: int, p: int):
    """Every split of n units into p contiguous non-empty ranges."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = (0, *cuts, n)
        yield [(edges[i], edges[i + 1]) for i in range(p)]


@pytest.mark.parametrize("seed", range(6))
def test_balanced_partition_minimises_the_slowest_stage(impl, seed):
    rng = random.Random(seed)
    n, p = rng.randint(4, 11), rng.randint(2, 4)
    # a cheap embedding, layers of uneven cost, an expensive LM head: SmolLM2's shape of costs
    costs = [rng.uniform(0.01, 0.1)] + [rng.uniform(0.5, 2.0) for _ in range(n - 2)] + [rng.uniform(2.0, 6.0)]
    best = min(max(sum(costs[a:b]) for a, b in split) for split in all_splits(n, p))
    got = impl(PARTITION).balanced_partition(costs, p)
    impl(PARTITION).check_partition(got, n, p)  # a valid split first
    worst = max(sum(costs[a:b]) for a, b in got)
    assert worst == pytest.approx(best, rel=1e-12), (
        f"seed={seed}: the slowest stage of {got} costs {worst:.4f}, the best split's {best:.4f} "
        f"(costs {[round(c, 3) for c in costs]}, p={p}); does the split search every cut?"
    )


def test_balanced_partition_gives_the_head_its_own_stage_when_it_dominates(impl):
    got = impl(PARTITION).balanced_partition([0.1, 1, 1, 1, 1, 10.0], 2)
    assert got == [(0, 5), (5, 6)], f"an LM head ten times a layer should sit alone on the last stage: {got}"


@pytest.mark.parametrize("p", [0, 7])
def test_balanced_partition_refuses_more_stages_than_units(impl, p):
    with pytest.raises(ValueError, match=str(p)):
        impl(PARTITION).balanced_partition([1.0] * 6, p)


WRONG = {
    "gap": ([(0, 2), (3, 6)], "stage 1"),
    "overlap": ([(0, 3), (2, 6)], "stage 1"),
    "empty stage": ([(0, 3), (3, 3), (3, 6)], "stage 1"),
    "short of the head": ([(0, 2), (2, 5)], "6"),
    "not from unit 0": ([(1, 3), (3, 6)], "stage 0"),
    "wrong count": ([(0, 6)], "2"),
}


@pytest.mark.parametrize("case", WRONG)
def test_a_wrong_partition_is_refused_with_its_fault(impl, case):
    bounds, named = WRONG[case]
    p = 3 if case == "empty stage" else 2
    with pytest.raises(ValueError) as refused:
        impl(PARTITION).check_partition(bounds, 6, p)
    assert named in str(refused.value), f"{case}: the error should name {named!r}: {refused.value}"


def test_check_partition_accepts_every_valid_split(impl):
    for p in (1, 2, 3):
        for split in all_splits(6, p):
            impl(PARTITION).check_partition(split, 6, p)  # raises on a false alarm


def test_a_stage_is_refused_a_partition_that_misses_the_lm_head(impl):
    model = labkit_from_hf(random_llama(0, num_hidden_layers=3))  # 5 units
    with pytest.raises(ValueError, match="5"):
        impl(STAGE).PipelineStage(model, [(0, 2), (2, 4)], 0)
