"""The benchmark harness: models, timing, results, done the same way for every stage.

    make bench STAGE=02                          # python -m labkit.bench 02 (labkit/bench/stage02.py)
    make bench STAGE=06 MODEL=path DRAFT=path    # your own HF-format Llama folders instead of the tiny pair
    make bench STAGE=02 QUICK=1                  # fewer sizes and repeats (--quick); saved as stage02_quick.*
    make bench STAGE=decode                      # one decode step: course eager/compiled, HF, llama.cpp (labkit/bench/decode.py)

A benchmark is `labkit/bench/stageNN.py` (or `stageNNb.py` for a stage's part 2) with
`main(quick: bool) -> bench.Result`: it loads its models with `model()` and its stage's modules with `stages()`,
times with `measure`, `compare` or `interleaved`, prints its tables with `show` and returns what it measured
(its main at most 60 lines: each part it measures a function of its own); this module saves the
Result as bench_results/stageNN.json (+ .png), with this machine's measured bandwidth and GEMM rate
(labkit.bench.floors); rows that quote a time add their own floor with floors.row.

A speed claim in this course is a ratio of two variants measured in the same process, one after
the other, as medians of repeats; never a single timing, never a timed unit test.
"""

import argparse
import importlib
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import ROOT, plot
from ..plot import RESULTS
from ..timing import compare, decode_step, interleaved, measure, table  # noqa: F401  (benchmarks call bench.measure, ...)


def model(role: str = "MODEL"):
    """(labkit Llama in float32 and eval mode, a label for tables) for $MODEL or $DRAFT (default: the tiny pair)."""
    from ..checkpoint import model_folder
    from ..model import from_pretrained

    folder = model_folder(role)
    llama = from_pretrained(folder)
    return llama, f"{folder.name} ({llama.num_params() / 1e6:.1f}M params)"


def tokenizer(role: str = "MODEL"):
    """The tokenizer of $MODEL's (or $DRAFT's) folder."""
    from ..checkpoint import load_tokenizer, model_folder

    return load_tokenizer(model_folder(role))


def stages(package: str, *names: str) -> list:
    """Stage modules of one package, from the implementation in force (labkit.impl.load), in order:
    `sim, slo = bench.stages("stage07_tensor_parallel.fleet", "simulator", "slo")`."""
    from ..impl import load

    return [load(f"{package}.{name}") for name in names]


def show(rows: list[dict], title: str = "") -> None:
    """Print rows as one table (labkit.timing.table) under `title`."""
    print(table(rows, title))


def show_figures(figures: dict, keys) -> None:
    """Print the figures named by `keys` (ratios, mostly) one a line, to two decimals."""
    for key in keys:
        print(f"{key}: {figures[key]:.2f}")


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
    from ..impl import current

    RESULTS.mkdir(exist_ok=True)
    data = {"machine": machine(), "impl": current(), **(run or {}), **result.figures, "rows": result.rows}
    paths = [RESULTS / f"{name}.json"]
    paths[0].write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return paths + ([plot.save(result.plot, name)] if result.plot is not None else [])


def machine() -> str:
    """One line naming the machine, for benchmark tables and the README."""
    import torch

    from ..device import has_gpu

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


def benchmark_name(stage: str) -> str:
    """'2', '02' -> 'stage02'; '2b' -> 'stage02b' (a stage's part 2); '04_latency' -> 'stage04_latency';
    a name that is not a stage number (e.g. 'decode') is a benchmark of its own."""
    stage = stage.strip().lower()
    number = re.fullmatch(r"(\d{1,2})([a-z]?)(_\w+)?", stage)
    if not number:
        if (Path(__file__).parent / f"{stage}.py").is_file():
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
        module = importlib.import_module(f"labkit.bench.{name}")
    except ModuleNotFoundError:
        print(f"No benchmark for stage {args.stage}: labkit/bench/{name}.py does not exist.", file=sys.stderr)
        return 2
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    result = module.main(quick=args.quick)
    from .floors import figures as floor_figures

    result.figures = {**floor_figures(), **result.figures}  # every JSON carries the machine's floor rates
    run = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "seconds": round(time.perf_counter() - t0),
        "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }
    if os.environ.get("MODEL") == "real" and not name.endswith("_real"):
        name += "_real"  # MODEL=real must not overwrite the tiny model's figures that handouts quote
    for path in save(result, name + ("_quick" if args.quick else ""), run):
        print(f"saved {path.relative_to(ROOT)}")
    print(f"machine: {machine()}; benchmark took {run['seconds']} s")  # after: it sets threads
    return 0
