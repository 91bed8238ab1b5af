"""Latency metrics of a serving benchmark, goodput under an SLO, the knee, and cost (vLLM's `bench serve`
definitions; DistServe's goodput).

    request_metrics          one request's TTFT, TPOT, ITL and end-to-end latency from its token times
    percentile               numpy's default percentile (linear interpolation between order statistics)
    summarize                mean and percentiles of each metric over the requests of a run
    meets_slo, goodput       does a request meet every bound; requests per second that do
    max_rate_meeting         the highest request rate whose SLO attainment reaches a target (bisection)
    cost_per_million_tokens  dollars per million output tokens at a rate, for a price per hour

lab4.ipynb §2 defines the metrics, §3 the knee and its cost.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """One request's latencies, in seconds."""

    ttft: float  # time to first token: from sending the request to its first token
    tpot: float  # time per output token after the first; nan for a one-token answer
    itl: list[float]  # inter-token latencies: the gaps between consecutive tokens (n - 1 of them)
    e2e: float  # end to end: from sending the request to its last token
    output_tokens: int


@dataclass
class SLO:
    """Bounds in seconds; None leaves a metric unbounded."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None


def request_metrics(sent: float, token_times: list[float]) -> RequestMetrics:
    """The metrics of a request sent at `sent` whose output tokens arrived at token_times (seconds on the
    same clock, non-decreasing, one per token, streamed). TPOT is the mean time per token after the
    first, over the n - 1 later tokens; ITL lists the same n - 1 gaps one by one."""
    if len(token_times) == 0:
        raise ValueError("a request without output tokens has no latency metrics: count it as failed")
    raise NotImplementedError("stage07: request_metrics — see lab4.ipynb §2")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of values, numpy's default definition (linear, Hyndman and Fan's
    type 7): sort the n values; the percentile sits at the fractional rank q / 100 * (n - 1), between the
    two order statistics around it, linearly interpolated. q = 0 is the minimum, q = 100 the maximum."""
    if len(values) == 0:
        raise ValueError("the percentile of no values is undefined")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be between 0 and 100, got {q!r}")
    raise NotImplementedError("stage07: percentile — see lab4.ipynb §2")


def summarize(metrics: list[RequestMetrics | None], percentiles=(50, 90, 99)) -> dict[str, float]:
    """{"ttft_mean": s, "ttft_p50": s, ..., "itl_p99": s, "e2e_...": s, "completed": n, "failed": n}. TPOT
    leaves out one-token answers; ITL pools the gaps of every request (as vLLM does); None is a failed
    request."""
    done = [m for m in metrics if m is not None]
    series = {
        "ttft": [m.ttft for m in done],
        "tpot": [m.tpot for m in done if not math.isnan(m.tpot)],
        "itl": [gap for m in done for gap in m.itl],
        "e2e": [m.e2e for m in done],
    }
    out = {"completed": len(done), "failed": len(metrics) - len(done)}
    for name, values in series.items():
        out[f"{name}_mean"] = sum(values) / len(values) if values else math.nan
        for q in percentiles:
            out[f"{name}_p{q:g}"] = percentile(values, q) if values else math.nan
    return out


def meets_slo(m: RequestMetrics | None, slo: SLO) -> bool:
    """True when the request completed (not None) and meets every bound slo sets (<= bound). A one-token
    answer has no TPOT, so it meets any TPOT bound."""
    raise NotImplementedError("stage07: meets_slo — see lab4.ipynb §2")


def attainment(metrics: list[RequestMetrics | None], slo: SLO) -> float:
    """The fraction of the requests (failed ones included) that meet the SLO."""
    if not metrics:
        raise ValueError("attainment of no requests is undefined")
    return sum(meets_slo(m, slo) for m in metrics) / len(metrics)


def goodput(metrics: list[RequestMetrics | None], slo: SLO, duration: float) -> float:
    """Requests per second that met the SLO over a run of `duration` seconds (vLLM's request goodput: the
    run lasts from its first request sent to its last token)."""
    if not duration > 0:
        raise ValueError(f"duration must be positive seconds, got {duration!r}")
    raise NotImplementedError("stage07: goodput — see lab4.ipynb §2")


def max_rate_meeting(attainment_at: Callable[[float], float], target: float, lo: float, hi: float, tol: float) -> float:
    """The highest rate in [lo, hi] at which attainment_at(rate) >= target, within tol, for an attainment
    that does not rise with the rate (DistServe's goodput: e.g. target 0.9 of requests within the SLO).

    Bisection: keep a rate that passes and one that fails, halve the gap until it is at most tol, return
    the passing one (so attainment_at(result) >= target always holds). hi passing returns hi (the knee lies
    beyond: raise hi); lo failing raises ValueError (lower lo). Calls attainment_at about
    log2((hi - lo) / tol) + 2 times.
    """
    if not 0 < lo < hi or not tol > 0:
        raise ValueError(f"need 0 < lo < hi and tol > 0, got lo={lo!r}, hi={hi!r}, tol={tol!r}")
    raise NotImplementedError("stage07: max_rate_meeting — see lab4.ipynb §3")


def cost_per_million_tokens(dollars_per_hour: float, tokens_per_second: float) -> float:
    """Dollars per million tokens for hardware rented at dollars_per_hour that produces tokens_per_second."""
    if not tokens_per_second > 0:
        raise ValueError(f"tokens_per_second must be positive, got {tokens_per_second!r}")
    raise NotImplementedError("stage07: cost_per_million_tokens — see lab4.ipynb §3")
