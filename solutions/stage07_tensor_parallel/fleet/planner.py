"""DistServe's arithmetic for sizing a disaggregated fleet: how many prefill and how many decode instances.

Disaggregation lets each phase scale on its own. Measure (or simulate) one prefill instance alone: the
highest rate at which its requests meet the TTFT bound is its goodput g_p. Likewise one decode instance
against the TPOT bound: g_d. A fleet of p prefill and d decode instances then serves min(p * g_p, d * g_d)
requests per second within the SLO: every request passes through both pools, and the slower pool sets the
pace. Here one instance is one accelerator (DistServe also searches each phase's parallelism; a multi-GPU
instance only rescales g_p and g_d).

    split_goodput   the goodput of p prefill + d decode instances
    best_split      the split of a GPU budget with the highest goodput (so the highest per-GPU goodput)
    min_instances   the fewest instances of each kind that reach a target rate

lab5.ipynb §4 feeds it goodputs from the simulator and sets the result against a colocated fleet.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """p prefill and d decode instances and the goodput (requests per second within the SLO) they reach."""

    prefill: int
    decode: int
    goodput: float

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode

    @property
    def per_gpu(self) -> float:
        """DistServe's figure of merit: goodput divided by the GPUs that produce it."""
        return self.goodput / self.gpus


def _check_goodputs(prefill_goodput: float, decode_goodput: float) -> None:
    for name, g in (("prefill_goodput", prefill_goodput), ("decode_goodput", decode_goodput)):
        if not (g > 0 and math.isfinite(g)):
            raise ValueError(f"{name} must be a positive number of requests per second, got {g!r}")


def split_goodput(prefill: int, decode: int, prefill_goodput: float, decode_goodput: float) -> float:
    """Requests per second that `prefill` instances of goodput prefill_goodput feeding `decode` instances of
    goodput decode_goodput serve within the SLO: the smaller of the two pools' capacities."""
    _check_goodputs(prefill_goodput, decode_goodput)
    if prefill < 0 or decode < 0:
        raise ValueError(f"instance counts cannot be negative, got prefill={prefill}, decode={decode}")
    return min(prefill * prefill_goodput, decode * decode_goodput)


def best_split(gpus: int, prefill_goodput: float, decode_goodput: float) -> Split:
    """The split of `gpus` instances into p >= 1 prefill and d = gpus - p >= 1 decode with the highest
    split_goodput (with the GPU count fixed, also the highest per-GPU goodput). Ties go to the fewest
    prefill instances (decode instances hold the KV of every running request: spare ones are memory)."""
    _check_goodputs(prefill_goodput, decode_goodput)
    if gpus < 2:
        raise ValueError(f"a disaggregated fleet needs at least 2 GPUs (one per phase), got {gpus}")
    best = None
    for p in range(1, gpus):
        g = split_goodput(p, gpus - p, prefill_goodput, decode_goodput)
        if best is None or g > best.goodput:
            best = Split(p, gpus - p, g)
    return best


def min_instances(rate: float, prefill_goodput: float, decode_goodput: float) -> Split:
    """The fewest prefill and decode instances whose split_goodput reaches `rate` requests per second:
    each pool on its own must carry the whole rate, so p = ceil(rate / g_p) and d = ceil(rate / g_d).
    A quotient that lands a rounding error above a whole number (2.1 / 0.7 = 3.0000000000000004) counts
    as that number."""
    _check_goodputs(prefill_goodput, decode_goodput)
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    p, d = (math.ceil(rate / g * (1 - 1e-12)) for g in (prefill_goodput, decode_goodput))
    return Split(p, d, split_goodput(p, d, prefill_goodput, decode_goodput))
