"""§4 of lab6.ipynb: the fill / steady / drain schedule of m micro-batches through p stages and its bubble.
References: the schedule written out by its rule (micro-batch j at stage s on tick j + s) and the exact
fraction (p - 1) / (m + p - 1)."""

from fractions import Fraction

import pytest

SCHEDULE = "stage07_tensor_parallel.pipeline.schedule"
CASES = [(1, 1), (1, 2), (2, 2), (3, 2), (1, 3), (2, 3), (4, 3), (8, 3), (5, 4), (8, 2)]


@pytest.mark.parametrize("m,p", CASES)
def test_fill_drain_schedule_moves_one_stage_a_tick(impl, m, p):
    table = impl(SCHEDULE).fill_drain_schedule(m, p)
    assert len(table) == m + p - 1, f"m={m}, p={p}: {len(table)} ticks, a fill/drain pass takes m + p - 1"
    for t, row in enumerate(table):
        want = [t - s if 0 <= t - s < m else None for s in range(p)]
        assert list(row) == want, f"m={m}, p={p}: tick {t} is {list(row)}, expected {want} (stage s runs j at j + s)"


@pytest.mark.parametrize("m,p", CASES)
def test_bubble_fraction_is_the_idle_share(impl, m, p):
    mod = impl(SCHEDULE)
    got = mod.bubble_fraction(mod.fill_drain_schedule(m, p))
    want = Fraction(p - 1, m + p - 1)
    assert got == pytest.approx(float(want), abs=1e-12), f"m={m}, p={p}: bubble {got}, (p-1)/(m+p-1) = {want}"


def test_bubble_fraction_counts_any_table(impl):
    table = [[0, None, None], [None, 0, 1], [2, None, 1], [None, None, None]]
    got = impl(SCHEDULE).bubble_fraction(table)
    assert got == pytest.approx(7 / 12), f"7 idle slots of 12: got {got}"


@pytest.mark.parametrize("m,p", [(0, 2), (2, 0)])
def test_fill_drain_schedule_refuses_an_empty_pipeline(impl, m, p):
    with pytest.raises(ValueError):
        impl(SCHEDULE).fill_drain_schedule(m, p)
