"""Timing and memory done the same way everywhere: warm-up, repeats, median, one run.

    python -m labkit.bench 02        # run stage 02's benchmark (labkit/benchmarks/stage02.py)

A speed claim in this course is a ratio of two variants measured in the same process, one after
the other, as medians of repeats; never a single timing, never a timed unit test.
"""

import argparse
import contextlib
import gc
import importlib
import platform
import statistics
import sys
import time
from dataclasses import dataclass


@dataclass
class Timing:
    median: float
    min: float
    max: float
    repeats: int

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


def _timing(times: list[float]) -> Timing:
    return Timing(statistics.median(times), min(times), max(times), len(times))


def measure(fn, repeats: int = 5, warmup: int = 1) -> Timing:
    """Call fn() `warmup` times untimed, then `repeats` times; seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    with gc_paused():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return _timing(times)


def compare(baseline, candidate, repeats: int = 5, warmup: int = 1) -> tuple[Timing, Timing, float]:
    """Time two variants in one run, interleaved so drift hits both; returns (base, cand, speedup)."""
    for _ in range(warmup):
        baseline()
        candidate()
    tb, tc = [], []
    with gc_paused():
        for _ in range(repeats):
            for fn, out in ((baseline, tb), (candidate, tc)):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    b, c = _timing(tb), _timing(tc)
    return b, c, b.median / c.median


def machine() -> str:
    """One line naming the machine, for benchmark tables and the README."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {torch.get_num_threads()} torch threads, {gpu}, torch {torch.__version__}"


def table(rows: list[dict], title: str = "") -> str:
    """A plain-text table from a list of same-keyed dicts."""
    cols = list(rows[0])
    cells = [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    out = [title] if title else []
    out += [line(cols), line(["-" * w for w in widths]), *map(line, cells)]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run one stage's benchmark.")
    ap.add_argument("stage", help="stage number, e.g. 02")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and sizes (for CI smoke runs)")
    args = ap.parse_args(argv)
    name = f"labkit.benchmarks.stage{int(args.stage):02d}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        print(f"No benchmark for stage {args.stage}: {name} does not exist.", file=sys.stderr)
        return 2
    module.main(quick=args.quick)
    print(f"machine: {machine()}")  # after the run: benchmarks pick their own thread count
    return 0


if __name__ == "__main__":
    sys.exit(main())
