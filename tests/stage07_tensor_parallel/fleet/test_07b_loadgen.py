"""§1 Open-loop arrivals (Poisson, gamma) against their distributions' moments, and traces with prefix structure."""

import math

import numpy as np
import pytest

MODULE = "stage07_tensor_parallel.fleet.loadgen"
N = 40_000  # gaps per sample: the mean's relative standard error is CV / sqrt(N), 0.5 % for Poisson


def _gaps(times) -> np.ndarray:
    times = np.asarray(times, dtype=np.float64)
    return np.diff(np.concatenate([[0.0], times]))


def _check_moments(times, rate, cv2, where):
    assert len(times) == N and np.all(_gaps(times) >= 0), f"{where}: {N} non-decreasing times from 0 expected"
    gaps = _gaps(times)
    # 6 standard errors: the mean's is CV / sqrt(N); the variance's relative one sqrt((kurtosis + 2) / N),
    # at most sqrt(26 / N) for the shapes used here (a gamma of shape k has excess kurtosis 6 / k).
    mean_tol = 6 * math.sqrt(cv2 / N)
    assert abs(gaps.mean() * rate - 1) < mean_tol, (
        f"{where}: mean gap {gaps.mean():.5g} s, expected 1 / rate = {1 / rate:.5g} s (±{mean_tol:.1%})"
    )
    got_cv2 = gaps.var() / gaps.mean() ** 2
    assert abs(got_cv2 / cv2 - 1) < 6 * math.sqrt(26 / N) + mean_tol, (
        f"{where}: squared coefficient of variation of the gaps {got_cv2:.3f}, expected {cv2:.3f}"
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_poisson_arrivals_have_exponential_gaps_of_mean_one_over_rate(impl, seed):
    loadgen = impl(MODULE)
    rate = float(np.random.default_rng(seed).uniform(0.2, 30))
    times = loadgen.poisson_arrivals(rate, N, seed)
    _check_moments(times, rate, 1.0, f"poisson_arrivals(rate={rate:.3f}, seed={seed})")
    gaps = _gaps(times)
    # Memoryless: P(gap > t) = exp(-rate t) at the median and the 90th percentile.
    for q in (0.5, 0.9):
        t = -math.log(1 - q) / rate
        assert abs((gaps <= t).mean() - q) < 0.015, f"seed={seed}: the gaps are not exponential at quantile {q}"


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_variability(impl, burstiness):
    loadgen = impl(MODULE)
    seed = int(burstiness * 100)
    rate = float(np.random.default_rng(seed).uniform(0.2, 30))
    times = loadgen.gamma_arrivals(rate, burstiness, N, seed)
    _check_moments(
        times, rate, 1 / burstiness, f"gamma_arrivals(rate={rate:.3f}, burstiness={burstiness}, seed={seed})"
    )


def test_arrivals_are_reproducible_per_seed_and_refuse_bad_rates(impl):
    loadgen = impl(MODULE)
    for name, make in (
        ("poisson_arrivals", lambda rate, seed: loadgen.poisson_arrivals(rate, 50, seed)),
        ("gamma_arrivals", lambda rate, seed: loadgen.gamma_arrivals(rate, 0.5, 50, seed)),
    ):
        assert np.array_equal(make(3.0, 7), make(3.0, 7)), f"{name}: the same seed (7) must give the same times"
        assert not np.array_equal(make(3.0, 7), make(3.0, 8)), f"{name}: seeds 7 and 8 gave the same times"
        for bad in (0.0, -1.0):
            with pytest.raises(ValueError, match="rate"):
                make(bad, 7)
    with pytest.raises(ValueError, match="burstiness"):
        loadgen.gamma_arrivals(2.0, 0.0, 10, 0)


def _reference_ids(prompts: list[list[int]], block_size: int) -> list[list[int]]:
    """Slow and obvious: a block's id is the index of first appearance of (every token up to the block's end)."""
    seen, out = {}, []
    for tokens in prompts:
        ids = []
        for end in range(block_size, len(tokens) + block_size, block_size):
            prefix = tuple(tokens[: min(end, len(tokens))])
            ids.append(seen.setdefault(prefix, len(seen)))
        out.append(ids)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_hash_ids_name_equal_prefixes_with_equal_ids(impl, seed):
    loadgen = impl(MODULE)
    rng = np.random.default_rng(seed)
    block_size = int(rng.integers(2, 7))
    stems = [rng.integers(5, size=int(rng.integers(0, 20))).tolist() for _ in range(4)]
    prompts = []
    for _ in range(40):  # shared stems, small vocabularies: equal blocks behind different prefixes occur
        tail = rng.integers(5, size=int(rng.integers(0, 15))).tolist()
        prompts.append(stems[rng.integers(4)] + tail)
    prompts.append([1, 2] * block_size)  # the same block twice in one prompt: two ids
    table = {}
    got = [loadgen.block_hash_ids(p, block_size, table) for p in prompts]
    want = _reference_ids(prompts, block_size)
    assert got == want, f"seed={seed}, block_size={block_size}: ids {got[:6]}..., expected {want[:6]}..."


def test_conversation_trace_sessions_extend_and_system_prompts_recur(impl):
    loadgen = impl(MODULE)
    seed, B = 3, 16
    trace = loadgen.conversation_trace(300, 5.0, system_prompts=3, system_length=80, max_turns=4,
                                       block_size=B, seed=seed)  # fmt: skip
    assert len(trace) == 300 and all(a.timestamp <= b.timestamp for a, b in zip(trace, trace[1:], strict=False))
    sessions = {}
    for r in trace:
        assert len(r.hash_ids) == math.ceil(r.input_length / B), f"seed={seed}: one id per block of {B} tokens"
        sessions.setdefault(r.session_id, []).append(r)
    multi = [turns for turns in sessions.values() if len(turns) > 1]
    assert multi, f"seed={seed}: no session has a second turn"
    for turns in multi:
        assert [r.turn for r in turns] == list(range(len(turns))), f"seed={seed}: turns out of order"
        for prev, nxt in zip(turns, turns[1:], strict=False):
            full = prev.input_length // B  # the previous prompt's full blocks reappear in the next prompt
            assert nxt.input_length > prev.input_length + prev.output_length, f"seed={seed}: a turn must extend"
            assert nxt.hash_ids[:full] == prev.hash_ids[:full], f"seed={seed}: turn {nxt.turn} drops its history"
    firsts = {}
    for turns in sessions.values():
        firsts.setdefault(turns[0].hash_ids[0], []).append(turns[0].session_id)
    assert len(firsts) <= 3 and max(len(s) for s in firsts.values()) >= 5, (
        f"seed={seed}: sessions should open with one of 3 shared system prompts, got {len(firsts)} distinct first blocks"
    )


def test_a_trace_without_reuse_shares_no_block(impl):
    loadgen = impl(MODULE)
    trace = loadgen.conversation_trace(200, 5.0, system_prompts=0, max_turns=1, seed=4)
    ids = [h for r in trace for h in r.hash_ids]
    assert len(ids) == len(set(ids)), "seed=4: system_prompts=0, max_turns=1 must share no block between requests"


def test_trace_round_trips_through_json_lines_and_rebuilds_its_prefixes(impl, tmp_path):
    loadgen = impl(MODULE)
    trace = loadgen.conversation_trace(60, 2.0, block_size=8, seed=5)
    path = tmp_path / "trace.jsonl"
    loadgen.write_trace(path, trace)
    back = loadgen.read_trace(path)
    assert [(r.input_length, r.output_length, r.hash_ids, r.session_id, r.turn) for r in back] == [
        (r.input_length, r.output_length, r.hash_ids, r.session_id, r.turn) for r in trace
    ], "seed=5: read_trace(write_trace(trace)) differs"
    assert all(math.isclose(a.timestamp, b.timestamp, rel_tol=1e-12) for a, b in zip(back, trace, strict=True))
    first = path.read_text().splitlines()[0]
    assert '"timestamp"' in first and '"hash_ids"' in first, "the file keeps Mooncake's field names"
    tokens = [loadgen.prompt_tokens(r, 8, 2048) for r in back]
    for (a, ta), (b, tb) in [((a, ta), (b, tb)) for a, ta in zip(back, tokens, strict=True)
                             for b, tb in zip(back[:10], tokens[:10], strict=True)]:  # fmt: skip
        shared = next((i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids, strict=False)) if x != y),
                      min(len(a.hash_ids), len(b.hash_ids)))  # fmt: skip
        assert len(ta) == a.input_length
        assert ta[: shared * 8] == tb[: shared * 8], "seed=5: equal leading hash ids must give equal tokens"
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": 3}\n')
    with pytest.raises(ValueError, match="hash_ids"):
        loadgen.read_trace(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("rate", [0.5, 8.0])
def test_the_first_arrival_comes_after_an_exponential_gap_not_at_time_zero(impl, rate):
    """A process that starts at 0 has its first request one gap later: over 4,000 seeds the first arrival is
    never at 0 and has the gap's mean and spread (exponential for Poisson, gamma for gamma_arrivals); asking
    for no request gives no time. A trace that fires its first request at t = 0 overstates the rate at start."""
    loadgen = impl(MODULE)
    seeds = range(4000)
    for name, make, cv2 in (
        ("poisson_arrivals", lambda seed: loadgen.poisson_arrivals(rate, 3, seed), 1.0),
        ("gamma_arrivals", lambda seed: loadgen.gamma_arrivals(rate, 4.0, 3, seed), 0.25),
    ):
        first = np.array([make(seed)[0] for seed in seeds])
        where = f"{name}(rate={rate}), seeds 0..3999"
        assert (first > 0).all(), f"{where}: a first arrival at t = 0 (seed={int(np.argmin(first))})"
        tol = 6 * math.sqrt(cv2 / len(first))
        assert abs(first.mean() * rate - 1) < tol, (
            f"{where}: mean first arrival {first.mean():.4g}, 1 / rate {1 / rate:.4g}"
        )
        got_cv2 = first.var() / first.mean() ** 2
        assert abs(got_cv2 / cv2 - 1) < 6 * math.sqrt(26 / len(first)) + tol, (
            f"{where}: CV² {got_cv2:.3f}, expected {cv2}"
        )
    assert len(loadgen.poisson_arrivals(rate, 0, 1)) == 0 and len(loadgen.gamma_arrivals(rate, 2.0, 0, 1)) == 0, (
        f"rate={rate}: n = 0 requests have no arrival times"
    )
