"""The speedup math against the closed forms of Leviathan et al. (2023), §3."""

import numpy as np
import pytest


def series(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: the expected emitted tokens, summed term by term."""
    return sum(alpha**i for i in range(k + 1))


def test_expected_tokens_per_step_paper_example(impl):
    m = impl("stage06_speculative.speedup")
    got = m.expected_tokens_per_step(0.8, 4)
    assert got == pytest.approx(3.3616, abs=1e-9), (
        f"alpha=0.8, k=4: expected 3.3616 tokens per target forward, got {got}"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_tokens_per_step_is_geometric_sum(impl, seed):
    m = impl("stage06_speculative.speedup")
    rng = np.random.default_rng(seed)
    for alpha, k in zip(rng.uniform(0.0, 0.99, 8), rng.integers(0, 12, 8), strict=True):
        got = m.expected_tokens_per_step(float(alpha), int(k))
        want = series(float(alpha), int(k))
        assert got == pytest.approx(want, rel=1e-9), f"seed={seed} alpha={alpha:.4f} k={k}: expected {want}, got {got}"
    for k in (0, 3, 7):
        got = m.expected_tokens_per_step(1.0, k)
        assert got == pytest.approx(k + 1), f"alpha=1 accepts everything: k={k} must give {k + 1} tokens, got {got}"


def test_expected_speedup_paper_example(impl):
    m = impl("stage06_speculative.speedup")
    got = m.expected_speedup(0.8, 4, 0.05)
    assert got == pytest.approx(3.3616 / 1.2, abs=1e-9), f"alpha=0.8, k=4, c=0.05: expected 2.80x, got {got}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_speedup_is_tokens_over_round_cost(impl, seed):
    m = impl("stage06_speculative.speedup")
    rng = np.random.default_rng(seed)
    for alpha, k, c in zip(rng.uniform(0, 0.99, 8), rng.integers(0, 12, 8), rng.uniform(0, 1, 8), strict=True):
        alpha, k, c = float(alpha), int(k), float(c)
        want = series(alpha, k) / (k * c + 1)  # k draft steps cost k·c target steps, plus one target forward
        got = m.expected_speedup(alpha, k, c)
        assert got == pytest.approx(want, rel=1e-9), f"seed={seed} alpha={alpha:.3f} k={k} c={c:.3f}: {want} != {got}"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_optimal_k_maximises_speedup(impl, seed):
    m = impl("stage06_speculative.speedup")
    rng = np.random.default_rng(seed)
    for alpha, c in zip(rng.uniform(0.05, 0.98, 10), rng.uniform(0.005, 0.6, 10), strict=True):
        alpha, c = float(alpha), float(c)
        speedups = [series(alpha, k) / (k * c + 1) for k in range(17)]
        got = m.optimal_k(alpha, c, k_max=16)
        assert speedups[got] == pytest.approx(max(speedups), rel=1e-12), (
            f"seed={seed} alpha={alpha:.3f} c={c:.3f}: k={got} gives {speedups[got]:.4f}, "
            f"best is k={int(np.argmax(speedups))} with {max(speedups):.4f}"
        )
        if alpha > c:  # Corollary 3.9: some k gains at least (1 + alpha) / (1 + c)
            assert speedups[got] >= (1 + alpha) / (1 + c) - 1e-12, f"seed={seed} alpha={alpha} c={c}"


def test_optimal_k_is_zero_when_drafting_does_not_pay(impl):
    m = impl("stage06_speculative.speedup")
    got = m.optimal_k(0.1, 0.5)
    assert got == 0, (
        f"alpha=0.1 with a draft half as expensive as the target: speculation loses, expected k=0, got {got}"
    )


def test_optimal_k_can_be_k_max(impl):
    got = impl("stage06_speculative.speedup").optimal_k(0.99, 0.001, k_max=4)
    assert got == 4, f"alpha=0.99 with a nearly free draft: every extra draft pays, expected k_max=4, got {got}"
