"""§2 Latency metrics and goodput against a fake server whose latencies are known exactly; §3 the knee and cost."""

import math

import numpy as np
import pytest

MODULE = "stage07_tensor_parallel.fleet.slo"


class FakeServer:
    """One FIFO engine with a scripted clock: a request waits for the one before it to finish, its prefill
    takes prefill_s per prompt token, and its k-th later token comes decode_s[k] after the previous one."""

    def __init__(self, prefill_s: float):
        self.prefill_s, self.free_at = prefill_s, 0.0

    def serve(self, sent: float, prompt_tokens: int, decode_s: list[float]) -> list[float]:
        start = max(sent, self.free_at)
        times = [start + self.prefill_s * prompt_tokens]
        for gap in decode_s:
            times.append(times[-1] + gap)
        self.free_at = times[-1]
        return times


def _workload(seed: int, n: int = 30):
    """(sent, prompt, decode gaps, token times, hand-computed metrics) for n requests through a FakeServer."""
    rng = np.random.default_rng(seed)
    server, out, sent = FakeServer(float(rng.uniform(1e-4, 1e-3))), [], 0.0
    for _ in range(n):
        sent += float(rng.exponential(0.3))
        prompt = int(rng.integers(1, 200))
        gaps = rng.uniform(0.005, 0.05, size=int(rng.integers(0, 12))).tolist()
        start = max(sent, server.free_at)
        times = server.serve(sent, prompt, gaps)
        ttft = start - sent + server.prefill_s * prompt  # queueing + prefill
        e2e = ttft + sum(gaps)
        tpot = sum(gaps) / len(gaps) if gaps else math.nan
        out.append((sent, times, dict(ttft=ttft, tpot=tpot, itl=gaps, e2e=e2e, output_tokens=len(gaps) + 1)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_request_metrics_match_the_fake_servers_clock(impl, seed):
    slo = impl(MODULE)
    for i, (sent, times, want) in enumerate(_workload(seed)):
        m = slo.request_metrics(sent, times)
        where = f"seed={seed}, request {i} ({want['output_tokens']} tokens)"
        for name in ("ttft", "e2e"):
            assert math.isclose(getattr(m, name), want[name], rel_tol=1e-9, abs_tol=1e-12), f"{where}: {name}"
        if math.isnan(want["tpot"]):
            assert math.isnan(m.tpot), f"{where}: a one-token answer has no TPOT (nan), got {m.tpot}"
        else:
            assert math.isclose(m.tpot, want["tpot"], rel_tol=1e-9), f"{where}: TPOT {m.tpot}, expected {want['tpot']}"
        assert len(m.itl) == len(want["itl"]) and np.allclose(m.itl, want["itl"], rtol=1e-9, atol=1e-12), (
            f"{where}: ITL must list the {len(want['itl'])} gaps after the first token, got {len(m.itl)}"
        )
        assert m.output_tokens == want["output_tokens"], where
    with pytest.raises(ValueError, match="output tokens"):
        slo.request_metrics(0.0, [])


@pytest.mark.parametrize("seed", [0, 1])
def test_percentile_is_numpys_linear_percentile(impl, seed):
    slo = impl(MODULE)
    rng = np.random.default_rng(seed)
    for n in (1, 2, 3, 10, 101, 1000):
        values = rng.lognormal(size=n).tolist()
        for q in (0, 1, 25, 50, 90, 95, 99, 99.9, 100, float(rng.uniform(0, 100))):
            got, want = slo.percentile(values, q), float(np.percentile(values, q))
            assert math.isclose(got, want, rel_tol=1e-12), f"seed={seed}, n={n}, q={q}: {got}, numpy says {want}"
    assert slo.percentile([3.0, 1.0, 2.0], 50) == 2.0, "percentile sorts its values"
    with pytest.raises(ValueError):
        slo.percentile([], 50)


def test_summarize_pools_every_requests_gaps(impl):
    slo = impl(MODULE)
    work = _workload(4)
    s = slo.summarize([slo.request_metrics(sent, times) for sent, times, _ in work] + [None])
    gaps = [g for _, _, w in work for g in w["itl"]]
    assert math.isclose(s["itl_p99"], float(np.percentile(gaps, 99)), rel_tol=1e-9), "seed=4: ITL pools all gaps"
    assert math.isclose(s["ttft_p50"], float(np.percentile([w["ttft"] for *_, w in work], 50)), rel_tol=1e-9)
    assert (s["completed"], s["failed"]) == (len(work), 1)


def _m(slo, ttft, tpot, e2e):
    return slo.RequestMetrics(ttft=ttft, tpot=tpot, itl=[], e2e=e2e, output_tokens=1 if math.isnan(tpot) else 5)


def test_a_request_meets_the_slo_only_within_every_bound(impl):
    slo = impl(MODULE)
    bounds = slo.SLO(ttft=0.5, tpot=0.05, e2e=2.0)
    cases = [  # (ttft, tpot, e2e, meets?)
        (0.4, 0.04, 1.0, True),
        (0.5, 0.05, 2.0, True),  # on the bound
        (0.6, 0.04, 1.0, False),  # TTFT only
        (0.4, 0.06, 1.0, False),  # TPOT only
        (0.4, 0.04, 2.5, False),  # end to end only
        (0.9, 0.09, 3.0, False),
        (0.4, math.nan, 0.4, True),  # one token: no TPOT to bound
        (0.6, math.nan, 0.6, False),
    ]
    for ttft, tpot, e2e, want in cases:
        got = slo.meets_slo(_m(slo, ttft, tpot, e2e), bounds)
        assert got is want or got == want, f"TTFT {ttft}, TPOT {tpot}, E2E {e2e} vs {bounds}: {got}, expected {want}"
    assert slo.meets_slo(None, bounds) is False, "a failed request (None) never meets the SLO"
    assert slo.meets_slo(_m(slo, 9.0, 0.04, 9.0), slo.SLO(tpot=0.05)), "an unset bound (None) bounds nothing"
    assert not slo.meets_slo(_m(slo, 0.1, 0.06, 0.2), slo.SLO(tpot=0.05)), "TPOT alone can fail a request"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_goodput_counts_requests_meeting_both_bounds_per_second(impl, seed):
    slo = impl(MODULE)
    work = _workload(seed, n=60)
    metrics = [slo.request_metrics(sent, times) for sent, times, _ in work] + [None, None]
    ttfts = sorted(w["ttft"] for *_, w in work)
    tpots = sorted(w["tpot"] for *_, w in work if not math.isnan(w["tpot"]))
    bounds = slo.SLO(ttft=ttfts[len(ttfts) // 2], tpot=tpots[len(tpots) // 2])  # medians: many fail one of them
    good = sum(w["ttft"] <= bounds.ttft and (math.isnan(w["tpot"]) or w["tpot"] <= bounds.tpot) for *_, w in work)
    duration = max(t for _, times, _ in work for t in times) - work[0][0]
    got = slo.goodput(metrics, bounds, duration)
    assert math.isclose(got, good / duration, rel_tol=1e-12), (
        f"seed={seed}: goodput {got:.4f} req/s, expected {good} good requests / {duration:.2f} s = {good / duration:.4f}"
    )
    assert math.isclose(slo.attainment(metrics, bounds), good / len(metrics)), f"seed={seed}: attainment"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_max_rate_meeting_finds_the_knee_of_a_monotone_curve(impl, seed):
    slo = impl(MODULE)
    rng = np.random.default_rng(seed)
    center, width, target = rng.uniform(15, 60), rng.uniform(0.2, 2), rng.uniform(0.5, 0.99)
    calls = []

    def attainment_at(rate):  # falls from ~1 to ~0 around `center`
        calls.append(rate)
        return 1 / (1 + math.exp((rate - center) / width))

    knee = center + width * math.log(1 / target - 1)  # where the curve crosses the target (exact)
    lo, hi, tol = 0.1, 100.0, 0.01
    got = slo.max_rate_meeting(attainment_at, target, lo, hi, tol)
    where = f"seed={seed}: knee {knee:.4f} (target {target:.3f})"
    assert attainment_at(got) >= target, f"{where}: returned {got:.4f}, where the SLO is missed (the failing side)"
    assert knee - tol <= got <= knee, f"{where}: returned {got:.4f}, more than tol={tol} below the knee"
    assert len(calls) <= math.ceil(math.log2((hi - lo) / tol)) + 4, f"{where}: {len(calls)} calls; bisect"
    assert slo.max_rate_meeting(lambda r: 1.0, 0.9, lo, hi, tol) == hi, "never missing the SLO: the knee is hi"
    with pytest.raises(ValueError, match="lo"):
        slo.max_rate_meeting(lambda r: 0.0, 0.9, lo, hi, tol)


@pytest.mark.parametrize("seed", [0, 1])
def test_cost_per_million_tokens(impl, seed):
    slo = impl(MODULE)
    rng = np.random.default_rng(seed)
    price, rate = float(rng.uniform(0.05, 10)), float(rng.uniform(1, 5000))
    want = price / (rate * 3600) * 1_000_000  # dollars per hour / tokens per hour, per million
    got = slo.cost_per_million_tokens(price, rate)
    assert math.isclose(got, want, rel_tol=1e-12), (
        f"seed={seed}: ${price:.3f}/h at {rate:.1f} tok/s: {got}, want {want}"
    )
    with pytest.raises(ValueError):
        slo.cost_per_million_tokens(price, 0.0)
