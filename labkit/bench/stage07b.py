"""Stage 07 part 2: goodput of a 4-replica fleet against the request rate, per routing policy, from engine
step costs measured on this machine; the knee per policy and its cost per million tokens.

    make bench STAGE=07b

Measured here: the cost of one ReplicaEngine step on the tiny target (one thread), as a function of the
batch's packed shape (step_costs.measure_step_costs, StepCost.fit). Simulated: everything else. Two cores
cannot run four replicas under load, so simulator.simulate replays two traces through four simulated
replicas that schedule as ReplicaEngine does, each routing policy of policies.py placing the arrivals:
a shared-prefix trace (conversations behind shared system prompts) and one without reuse, where
cache-aware routing has nothing to gain. The knee is the highest rate at which 90 % of requests meet
the SLO (DistServe's goodput), found by slo.max_rate_meeting; the cost takes the stated vCPU price of
labkit.specs for each replica. bench_results/stage07b_fleet.json (lab 3) holds the measured fleet.

Before the fleet, a check of the simulator: one real ReplicaEngine serves a trace open loop on the wall
clock, and one simulated replica serves the same trace; their latency percentiles side by side.
"""

import dataclasses
import statistics
import time

import numpy as np
import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.impl import load
from labkit.specs import VCPU_DOLLARS_PER_HOUR

REPLICAS = 4
TARGET = 0.9  # the fraction of requests that must meet the SLO
FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)  # of the highest knee: the curves


def policies(pol) -> dict:
    """Fresh policy objects by name (a policy keeps state, so each run gets its own)."""
    return {
        "round_robin": pol.RoundRobin,
        "least_outstanding": pol.LeastOutstanding,
        "power_of_two": lambda: pol.PowerOfTwo(seed=0),
        "session_affinity": pol.SessionAffinity,
        "cache_aware": pol.CacheAware,
        # the course's tree bound (65,536 tokens a worker) fills after a few hundred prompts; sgl-router's is 2^26
        "cache_aware (tree bound 2^26)": lambda: pol.CacheAware(max_tree_size=1 << 26),
    }


def fit_costs(sim, model, which: str, quick: bool):
    """The fitted step cost of this run's timed engine steps, the samples, the fit's predicted/measured ratios,
    and the fitted decode step at context 256 for a few batch sizes."""
    samples = []
    for r in range(1 if quick else 3):
        samples += sim.measure_step_costs(model, seed=r)
    cost = sim.StepCost.fit(samples)
    ratio = [cost.ragged(b) / s for b, s in samples]
    decode = {B: cost(B, 1, 256) for B in (1, 4, 16)}
    print(f"model: {which}; {len(samples)} engine steps timed; fitted {cost}")
    print(f"fit on its own samples: predicted/measured median {statistics.median(ratio):.2f}, "
          f"p10 {np.percentile(ratio, 10):.2f}, p90 {np.percentile(ratio, 90):.2f}; a decode step at context 256 "
          + ", ".join(f"B={b}: {t * 1e3:.1f} ms" for b, t in decode.items()))  # fmt: skip
    return cost, samples, ratio, decode


def check_simulator(sim, pol, loadgen, slo, model, cost, quick: bool) -> dict:
    """The simulator against the real thing: one replica, the same requests, measured on the wall clock."""
    check = loadgen.conversation_trace(30 if quick else 60, 1.0, system_prompts=8, system_length=512,
                                       max_turns=4, output_length=(8, 32), seed=1)  # fmt: skip
    real = replay(load("stage07_tensor_parallel.fleet.replica_engine"), model, check)
    simulated = sim.simulate(check, pol.RoundRobin(), cost, replicas=1, cache_tokens=2048).token_times
    versus = {}
    for label, token_times in (("measured", real), ("simulated", simulated)):
        s = slo.summarize([slo.request_metrics(r.timestamp, t) for r, t in zip(check, token_times, strict=True)])
        versus[label] = {k: s[k] for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "e2e_p50", "e2e_p90")}
    print(bench.table([{"one replica, 1 req/s": k, **{m: f"{v * 1e3:.0f} ms" for m, v in d.items()}}
                       for k, d in versus.items()], title="the simulator against a real ReplicaEngine"))  # fmt: skip
    return versus


def fleet_traces(loadgen, n: int) -> dict:
    """Long shared prefixes and short answers, the shape of Mooncake's trace (thousands of prompt tokens, a few
    hundred out) scaled to the tiny target's 1,024 positions; the no-reuse trace has the same lengths."""
    shape = dict(max_turns=4, output_length=(8, 32))
    return {
        "shared prefix": loadgen.conversation_trace(n, 1.0, system_prompts=8, system_length=512, **shape, seed=0),
        "no reuse": loadgen.conversation_trace(
            n, 1.0, system_prompts=0, **shape | dict(max_turns=1), user_length=(520, 656), seed=0
        ),  # fmt: skip
    }


def sweep_policies(sim, pol, slo, cost, traces, bound, quick: bool) -> tuple[list[dict], dict, dict]:
    """Per trace and policy: the knee (bisected), the curve on a grid scaled to this run's knees, and a row at
    half round-robin's knee with the knee's cost."""
    mean_out = {k: statistics.mean(r.output_length for r in t) for k, t in traces.items()}

    def run(trace_name: str, policy_name: str, rate: float):
        trace = [dataclasses.replace(r, timestamp=r.timestamp / rate) for r in traces[trace_name]]  # same requests
        res = sim.simulate(trace, policies(pol)[policy_name](), cost, replicas=REPLICAS, cache_tokens=2048)
        metrics = [slo.request_metrics(s, t) for s, t in zip(res.sent, res.token_times, strict=True)]
        return res, metrics

    rows, knees, curves = [], {}, {}
    price = REPLICAS * VCPU_DOLLARS_PER_HOUR
    for trace_name in traces:
        for name in policies(pol):

            def attained(rate, trace_name=trace_name, name=name):
                return slo.attainment(run(trace_name, name, rate)[1], bound)

            knees[(trace_name, name)] = slo.max_rate_meeting(attained, TARGET, 0.25, 64.0, 0.05 if quick else 0.02)
        # Curves on a grid scaled to this run's knees (the step costs, so the knees, move with the machine's load).
        top, ref = max(knees[(trace_name, p)] for p in policies(pol)), knees[(trace_name, "round_robin")] / 2
        grid = sorted({round(top * f, 2) for f in FRACTIONS[:: 2 if quick else 1]} | {round(ref, 2)})
        for name in policies(pol):
            curve = []
            for rate in grid:
                res, metrics = run(trace_name, name, rate)
                s = slo.summarize(metrics)
                curve.append(dict(rate=rate, goodput=slo.goodput(metrics, bound, res.duration),
                                  attainment=slo.attainment(metrics, bound), ttft_p99=s["ttft_p99"],
                                  tpot_p99=s["tpot_p99"], prefill_tokens=sum(r["prefill_tokens"] for r in res.replicas),
                                  requests_per_replica=[r["requests"] for r in res.replicas]))  # fmt: skip
            curves[(trace_name, name)] = curve
            knee = knees[(trace_name, name)]
            at = next(c for c in curve if c["rate"] == round(ref, 2))
            rows.append({"trace": trace_name, "policy": name, "knee (req/s)": knee,
                         "$/M output tokens": slo.cost_per_million_tokens(price, knee * mean_out[trace_name]),
                         "at req/s (half RR's knee)": at["rate"], "prefill tokens": at["prefill_tokens"],
                         "requests per replica": str(at["requests_per_replica"])})  # fmt: skip
    return rows, knees, curves


def main(quick: bool = False) -> bench.Result:
    sim, pol, loadgen, slo = bench.stages("stage07_tensor_parallel.fleet", "simulator", "policies", "loadgen", "slo")
    torch.set_num_threads(1)  # one replica, one core
    model, which = bench.model()
    cost, samples, ratio, decode = fit_costs(sim, model, which, quick)
    versus = check_simulator(sim, pol, loadgen, slo, model, cost, quick)
    n, bound, price = 300 if quick else 800, slo.SLO(ttft=1.0, tpot=0.1), REPLICAS * VCPU_DOLLARS_PER_HOUR
    traces = fleet_traces(loadgen, n)
    rows, knees, curves = sweep_policies(sim, pol, slo, cost, traces, bound, quick)
    title = (f"simulated {REPLICAS}-replica fleet: knee = highest rate with {TARGET:.0%} of requests within TTFT <= "
             f"{bound.ttft} s and TPOT <= {bound.tpot * 1e3:.0f} ms; cost at ${price:.3f}/h ({REPLICAS} vCPUs)")  # fmt: skip
    bench.show(rows, title)
    for trace_name in traces:
        rr = knees[(trace_name, "round_robin")]
        print(f"{trace_name}: knee / round-robin's: "
              + ", ".join(f"{p} {knees[(trace_name, p)] / rr:.2f}x" for p in policies(pol) if p != "round_robin"))  # fmt: skip

    figures = {
        "model": which,
        "floor": "rows simulated: no hardware time (knees and costs come from the simulator's clock); the measured "
        "decode steps' floors are under measured",
        "simulator_check_one_replica_1_req_per_s": versus,  # measured on a real engine vs simulated
        "measured": {
            "step_cost": dataclasses.asdict(cost),
            "steps_timed": len(samples),
            "fit_ratio_p10_p50_p90": [float(np.percentile(ratio, q)) for q in (10, 50, 90)],
            # the fitted decode step at context 256 against its floor: the weights and B caches read once
            "decode_step_context_256": {
                f"B={B}": {"ms": t * 1e3, **floors.row(t, bytes=floors.decode_bytes(model, 256, B))}
                for B, t in decode.items()
            },
        },  # fmt: skip
        "simulated": {
            "replicas": REPLICAS,
            "slo": dataclasses.asdict(bound),
            "target": TARGET,
            "requests": n,
            "dollars_per_hour": price,
            "price_source": "labkit.specs.VCPU_DOLLARS_PER_HOUR x replicas",
            "mean_output_tokens": {k: statistics.mean(r.output_length for r in t) for k, t in traces.items()},
            "curves": {f"{t} / {p}": c for (t, p), c in curves.items()},
        },  # fmt: skip
    }
    return bench.Result(rows, figures, _plot(curves, knees, list(traces), list(policies(pol))))


def replay(engine_module, model, trace, page_size: int = 16) -> list[list[float]]:
    """Serve `trace` open loop on one real ReplicaEngine, on the wall clock: each request's token times."""
    loadgen = load("stage07_tensor_parallel.fleet.loadgen")
    engine = engine_module.ReplicaEngine(model, page_size=page_size)
    times, sent, t0 = [[] for _ in trace], 0, time.perf_counter()
    while sent < len(trace) or engine.has_work():
        now = time.perf_counter() - t0
        while sent < len(trace) and trace[sent].timestamp <= now:
            r = trace[sent]
            tokens = loadgen.prompt_tokens(r, page_size, model.config.vocab_size)
            engine.add_request(engine_module.EngineRequest(str(sent), tokens, r.output_length))
            sent += 1
        if not engine.has_work():
            time.sleep(max(0.0, trace[sent].timestamp - now))
            continue
        out = engine.step()
        end = time.perf_counter() - t0
        for o in out:
            if o.token_id is not None:
                times[int(o.request_id)].append(end)
    return times


def _plot(curves, knees, traces, names):
    plt = plot.setup()
    fig, axes = plt.subplots(1, len(traces), figsize=(12, 4.2), sharey=True)
    for ax, trace_name in zip(axes, traces, strict=True):
        for i, name in enumerate(names):
            c = curves[(trace_name, name)]
            ax.plot([p["rate"] for p in c], [p["goodput"] for p in c], marker="o", color=f"C{i}", label=name)
            ax.axvline(knees[(trace_name, name)], color=f"C{i}", linestyle=":", alpha=0.7)
        ax.plot(
            [0, max(p["rate"] for p in c)], [0, max(p["rate"] for p in c)], color="grey", lw=0.8, label="offered rate"
        )
        ax.set_title(f"{trace_name} trace (simulated; step costs measured here)")
        ax.set_xlabel("offered request rate (req/s)")
    axes[0].set_ylabel("goodput (req/s within the SLO)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
