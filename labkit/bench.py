"""The benchmark harness: models, timing, results, done the same way for every stage.

    make bench STAGE=02                          # python -m labkit.bench 02 (labkit/benchmarks/stage02.py)
    make bench STAGE=06 MODEL=path DRAFT=path    # your own HF-format Llama folders instead of the tiny pair
    make bench STAGE=02 QUICK=1                  # fewer sizes and repeats (--quick); saved as stage02_quick.*
    make bench STAGE=decode                      # one decode step: course eager/compiled, HF, llama.cpp (benchmarks/decode.py)

A benchmark is `labkit/benchmarks/stageNN.py` (or `stageNNb.py` for a stage's part 2) with
`main(quick: bool) -> bench.Result`: it loads its models with `model()`, times with `measure`,
`compare` or `interleaved`, prints its tables and returns what it measured; this module saves the
Result as bench_results/stageNN.json (+ .png).

A speed claim in this course is a ratio of two variants measured in the same process, one after
the other, as medians of repeats; never a single timing, never a timed unit test.
"""

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import ROOT, plot
from .plot import RESULTS


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


def interleaved(fns: dict, repeats: int = 5, warmup: int = 1, before=None) -> dict[str, Timing]:
    """Time several variants in one run, each called in turn so load drift hits all alike: every
    fn `warmup` times untimed, then `repeats` rounds. before(), if given, runs untimed before every
    call (a barrier, say). Returns {name: Timing} in seconds per call."""
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


def model(role: str = "MODEL"):
    """(labkit Llama in float32 and eval mode, a label for tables) for $MODEL or $DRAFT (default: the tiny pair)."""
    from .checkpoint import model_folder
    from .model import from_pretrained

    folder = model_folder(role)
    llama = from_pretrained(folder)
    return llama, f"{folder.name} ({llama.num_params() / 1e6:.1f}M params)"


def tokenizer(role: str = "MODEL"):
    """The tokenizer of $MODEL's (or $DRAFT's) folder."""
    from .checkpoint import load_tokenizer, model_folder

    return load_tokenizer(model_folder(role))


@dataclass
class Result:
    """What a benchmark's main returns: its table rows, any other figures worth keeping (JSON
    values), and its plot. The harness adds the machine, the implementation and quick."""

    rows: list[dict]
    figures: dict = field(default_factory=dict)
    plot: object = None  # a matplotlib Figure (labkit.plot.setup() style)


def save(result: Result, name: str, run: dict | None = None) -> list[Path]:
    """Write bench_results/<name>.json (and .png); quick runs pass name + '_quick'. `run`: how the
    run went (date, seconds, the load average around it), so a reader knows if the machine was busy."""
    from .impl import current

    RESULTS.mkdir(exist_ok=True)
    data = {"machine": machine(), "impl": current(), **(run or {}), **result.figures, "rows": result.rows}
    paths = [RESULTS / f"{name}.json"]
    paths[0].write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return paths + ([plot.save(result.plot, name)] if result.plot is not None else [])


def machine() -> str:
    """One line naming the machine, for benchmark tables and the README."""
    import torch

    from .device import has_gpu

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if has_gpu() else "no GPU"
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


def benchmark_name(stage: str) -> str:
    """'2', '02' -> 'stage02'; '2b' -> 'stage02b' (a stage's part 2); '04_latency' -> 'stage04_latency';
    a name that is not a stage number (e.g. 'decode') is a benchmark of its own."""
    stage = stage.strip().lower()
    number = re.fullmatch(r"(\d{1,2})([a-z]?)(_\w+)?", stage)
    if not number:
        if (Path(__file__).parent / "benchmarks" / f"{stage}.py").is_file():
            return stage
        raise SystemExit(
            f"stage {stage!r}: pass a stage number such as 02, 2 or 02b, or a benchmark name such as decode."
        )
    return f"stage{int(number[1]):02d}{number[2]}{number[3] or ''}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run one stage's benchmark.")
    ap.add_argument("stage", help="stage number, e.g. 02, or 02b for a stage's part 2, or decode")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and sizes; saved with a _quick suffix")
    args = ap.parse_args(argv)
    name = benchmark_name(args.stage)
    try:
        module = importlib.import_module(f"labkit.benchmarks.{name}")
    except ModuleNotFoundError:
        print(f"No benchmark for stage {args.stage}: labkit/benchmarks/{name}.py does not exist.", file=sys.stderr)
        return 2
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    result = module.main(quick=args.quick)
    run = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "seconds": round(time.perf_counter() - t0),
        "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }
    for path in save(result, name + ("_quick" if args.quick else ""), run):
        print(f"saved {path.relative_to(ROOT)}")
    print(f"machine: {machine()}; benchmark took {run['seconds']} s")  # after: it sets threads
    return 0


if __name__ == "__main__":
    from labkit.bench import main  # not this __main__ copy, whose Result class the benchmarks don't return

    sys.exit(main())
