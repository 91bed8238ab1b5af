"""Timing done one way for the whole course: warm-up, garbage collection paused, medians of repeats.

The library needs these too (stage 06's batch engine times its verify steps, labkit.quality times a
decode step); the benchmark harness in labkit.bench re-exports them for the benchmarks.
"""

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Timing:
    median: float
    min: float
    max: float
    repeats: int
    last: object = field(default=None, repr=False)  # what the last timed call returned

    def __str__(self) -> str:
        return f"{self.median * 1e3:.2f} ms (min {self.min * 1e3:.2f}, max {self.max * 1e3:.2f}, n={self.repeats})"


@contextlib.contextmanager
def gc_paused():
    """No garbage collection while timing, as timeit does. Collecting before every call instead
    evicts the CPU caches and adds ~1 ms to a 1 ms call (seen here on a decode step)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def interleaved(fns: dict, repeats: int = 5, warmup: int = 1, before=None, settle: int = 0) -> dict[str, Timing]:
    """Time several variants in one run, each called in turn so load drift hits all alike: every
    fn `warmup` times untimed, then `repeats` rounds. before(), if given, runs untimed before every
    call (a barrier, say); with settle, each timed call follows that many untimed calls of the same fn,
    so it is timed back to back with itself, as a decode loop runs (a thread pool the other variants
    left asleep, or caches they filled, would otherwise count against it). Returns {name: Timing} in
    seconds per call."""
    for _ in range(warmup):
        for fn in fns.values():
            if before:
                before()
            fn()
    times = {name: [] for name in fns}
    last = {}
    with gc_paused():
        for _ in range(repeats):
            for name, fn in fns.items():
                if before:
                    before()
                for _ in range(settle):
                    fn()
                t0 = time.perf_counter()
                last[name] = fn()
                times[name].append(time.perf_counter() - t0)
    return {n: Timing(statistics.median(t), min(t), max(t), len(t), last[n]) for n, t in times.items()}


def measure(fn, repeats: int = 5, warmup: int = 1, before=None) -> Timing:
    """Call fn() `warmup` times untimed, then `repeats` times; seconds per call."""
    return interleaved({"fn": fn}, repeats, warmup, before)["fn"]


def compare(baseline, candidate, repeats: int = 5, warmup: int = 1, before=None) -> tuple[Timing, Timing, float]:
    """Time two variants in one run, interleaved; returns (base, cand, speedup of cand over base)."""
    t = interleaved({"base": baseline, "cand": candidate}, repeats, warmup, before)
    return t["base"], t["cand"], t["base"].median / t["cand"].median


def decode_step(model, context: int = 64, tokens: int = 1):
    """A closure running one cached forward of `tokens` new tokens (batch 1) after `context`
    cached ones. The cache is rewound after each call, so every call does the same work; time it
    with measure() or compare()."""
    import torch

    cache = model.new_cache(1, context + tokens)
    ids = torch.ones(1, tokens, dtype=torch.long)
    with torch.no_grad():
        model(torch.ones(1, context, dtype=torch.long), cache)

    def step():
        with torch.no_grad():
            model(ids, cache)
        cache.truncate(context)

    return step


def table(rows: list[dict], title: str = "") -> str:
    """A plain-text table from a list of dicts: every key any row has, in order of appearance; a row without
    a key (a predicted row has no floor, say) leaves its cell empty."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    cells = [[f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    out = [title] if title else []
    out += [line(cols), line(["-" * w for w in widths]), *map(line, cells)]
    return "\n".join(out)
