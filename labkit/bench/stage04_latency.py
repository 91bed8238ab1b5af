"""Stage 04's latency sweeps alone: TTFT, TPOT, chunked prefill's trade and goodput (a few minutes).

    make bench STAGE=04_latency    # LABS_IMPL=solution python -m labkit.bench 04_latency

The same `latency_sweeps` that `make bench STAGE=04` runs after its throughput tables, without them;
the handout's §6 reads bench_results/stage04_latency.json.
"""

from labkit import bench, plot
from labkit.bench.stage04 import latency_sweeps, plot_latency
from labkit.device import pin_threads
from labkit.impl import load


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # the tiny model's matrices are too small for threads to pay off
    model, which = bench.model()
    lat = latency_sweeps(load("stage04_batching.engine"), model, quick)
    fig, (ax_chunk, ax_good) = plot.setup().subplots(1, 2, figsize=(11, 4.2))
    plot_latency(lat, ax_chunk, ax_good)
    return bench.Result(lat["chunked_prefill"] + lat["goodput"], {"model": which, "latency": lat}, fig)


if __name__ == "__main__":
    main()
