"""Stage 07 part 2 benchmark (lab 5 §4): prefill/decode disaggregation against colocated serving with chunked
prefill (Sarathi-Serve's fair baseline), at equal replica count.

    make bench STAGE=07b_disagg            (LABS_IMPL=solution; IMPL=student runs your connector and planner)

Measured here (a small case): the same prompts, one at a time, through (a) one colocated ReplicaEngine and
(b) two gloo ranks on loopback, rank 0 prefilling and sending the KV (kv_connector.save_kv / send_kv) with
the first token, rank 1 loading it and decoding from the second token on. Per prompt length: TTFT, the
gap from the first to the second token (where the transfer shows), the transfer itself, the later tokens'
gaps. Both ranks start each request at a barrier, so their clocks agree to the barrier's skew. Greedy tokens
must match.

Simulated (every other figure; step costs and the transfer measured in this run): simulator.simulate
replays one trace of long prompts (520-656 tokens, no reuse) with 32-128-token answers on 4 replicas,
colocated (max_num_batched_tokens 256, and 64) and split P prefill : 4 - P decode, at rates swept up to past the
knee: goodput under two SLOs, TTFT, second-token gap and p99 inter-token latency. The planner
(planner.best_split) then picks a split from each phase's own goodput, as DistServe does.
"""

import dataclasses
import importlib
import statistics
import time

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.checkpoint import model_folder
from labkit.device import pin_threads
from labkit.distributed import launch
from labkit.quality import heldout

REPLICAS = 4
TARGET = 0.9  # the fraction of requests that must meet the SLO at the knee
PAGE = 16
FLEET = "stage07_tensor_parallel.fleet"


def timed_prefill_decode(folder, prompts, new_tokens, modules):
    """A launch worker for two ranks (kv_connector.prefill_decode with clocks): rank 0 prefills and sends the KV
    and the first token; rank 1 decodes the rest. Times are seconds since the request's barrier."""
    import torch.distributed as dist

    from labkit.model import from_pretrained

    kv, eng = (importlib.import_module(m) for m in modules)
    torch.set_num_threads(1)
    model = from_pretrained(folder).float().eval()
    engine = eng.ReplicaEngine(model, num_slots=4 * max(map(len, prompts)) + 4 * new_tokens + 64, page_size=PAGE)
    out = []
    for i, prompt in enumerate(prompts):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            engine.add_request(eng.EngineRequest(f"p{i}", prompt, 1))
            first = [o.token_id for o in run(engine)][0]
            ttft = time.perf_counter() - t0
            payload = kv.save_kv(engine, prompt)
            nbytes = kv.send_kv(payload, 1)
            dist.send(torch.tensor([first]), 1)
            out.append(dict(ttft=ttft, sent=time.perf_counter() - t0, bytes=nbytes, first=first))
            continue
        payload = kv.recv_kv(0, model.config, timeout_s=30.0)
        first = torch.zeros(1, dtype=torch.int64)
        dist.recv(first, 0)
        kv.load_kv(engine, payload)
        loaded = time.perf_counter() - t0
        engine.add_request(eng.EngineRequest(f"d{i}", prompt + [int(first)], new_tokens - 1))
        tokens, times = [], []
        for o in run(engine):
            tokens.append(o.token_id)
            times.append(time.perf_counter() - t0)
        out.append(dict(loaded=loaded, tokens=tokens, times=times))
    return out


def run(engine):
    """Step an engine until it is idle, yielding every token as it comes."""
    while engine.has_work():
        yield from (o for o in engine.step() if o.token_id is not None)


def measured(model, prompts, new_tokens, kv, eng) -> list[dict]:
    pin_threads(1)
    colocated = eng.ReplicaEngine(model, num_slots=4 * max(map(len, prompts)) + 4 * new_tokens + 64, page_size=PAGE)
    warm = list(range(3, 3 + 2 * PAGE))
    colocated.add_request(eng.EngineRequest("warm", warm, 2))
    list(run(colocated))
    colo = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        colocated.add_request(eng.EngineRequest(f"c{i}", prompt, new_tokens))
        tokens, times = [], []
        for o in run(colocated):
            tokens.append(o.token_id)
            times.append(time.perf_counter() - t0)
        colo.append((tokens, times))
    modules = (kv.__name__, eng.__name__)
    sent, received = launch(timed_prefill_decode, 2, model_folder(), [warm, *prompts], new_tokens, modules, timeout=300)
    rows = []
    for prompt, (tokens, times), s, r in zip(prompts, colo, sent[1:], received[1:], strict=True):
        pd_tokens = [s["first"], *r["tokens"]]
        if pd_tokens != tokens:
            raise AssertionError(f"{len(prompt)}-token prompt: disaggregated greedy tokens differ from colocated")
        for label, ttft, second, later in (
            ("colocated", times[0], times[1], times[1:]),
            ("disaggregated", s["ttft"], r["times"][0], r["times"]),
        ):
            gaps = [b - a for a, b in zip(later[:-1], later[1:], strict=True)]
            rows.append({
                "part": "measured", "mode": label, "prompt_tokens": len(prompt),
                "ttft_ms": ttft * 1e3, "second_token_gap_ms": (second - ttft) * 1e3,
                "transfer_ms": (r["loaded"] - s["ttft"]) * 1e3 if label == "disaggregated" else 0.0,
                "transfer_bytes": s["bytes"] if label == "disaggregated" else 0,
                "later_itl_median_ms": statistics.median(gaps) * 1e3,
            })  # fmt: skip
    return rows


def measured_rows(model, per_prompt: list[dict], lengths: list[int]) -> list[dict]:
    """Per prompt length and mode, the median of the per-prompt rows, with its floors: TTFT, the prompt's prefill
    FLOPs; the transfer, its KV bytes read and written once at the streaming rate (loopback moves them in memory);
    a later token, one step's read of the weights and K/V."""
    rows = []
    for n in lengths:
        for mode in ("colocated", "disaggregated"):
            rs = [r for r in per_prompt if r["prompt_tokens"] == n and r["mode"] == mode]
            row = {k: statistics.median(r[k] for r in rs) if isinstance(v, float) else v for k, v in rs[0].items()}
            row |= floors.row(row["ttft_ms"] / 1e3, flops=floors.forward_flops(model, n, logits=1), name="ttft")
            if row["transfer_bytes"]:
                row |= floors.row(row["transfer_ms"] / 1e3, bytes=2 * row["transfer_bytes"], name="transfer")
            rows.append(
                row
                | floors.row(row["later_itl_median_ms"] / 1e3, bytes=floors.decode_bytes(model, n), name="later_itl")
            )
    return rows


@dataclasses.dataclass
class Fleet:
    """One trace replayed by simulator.simulate at any rate, colocated or split, with this run's step costs
    and transfer."""

    sim: object
    pol: object
    slo: object
    trace: list
    cost: object
    transfer: object

    def simulate(self, rate, mode=(0, 256), replicas=REPLICAS):
        """mode: (prefill replicas, max_num_batched_tokens); (0, chunk) is colocated."""
        scaled = [dataclasses.replace(r, timestamp=r.timestamp / rate) for r in self.trace]
        prefill, chunk = mode
        res = self.sim.simulate(scaled, self.pol.LeastOutstanding(), self.cost, replicas=replicas, cache_tokens=2048,
                                max_num_batched_tokens=chunk, prefill_replicas=prefill,
                                transfer=self.transfer if prefill else None)  # fmt: skip
        return res, [self.slo.request_metrics(s, t) for s, t in zip(res.sent, res.token_times, strict=True)]

    def knee(self, bound, **kw):
        """The highest rate at which TARGET of the requests meet `bound`."""
        slo = self.slo
        return slo.max_rate_meeting(
            lambda r: slo.attainment(self.simulate(r, **kw)[1], bound), TARGET, 0.1, 200.0, 0.05
        )

    def curve(self, grid, mode, slos) -> list[dict]:
        """Latencies and goodput under each SLO at each rate of `grid`."""
        curve = []
        for rate in grid:
            res, metrics = self.simulate(rate, mode=mode)
            s = self.slo.summarize(metrics)
            gaps = [t[1] - t[0] for t in res.token_times if len(t) > 1]
            curve.append({
                "rate": rate, "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"], "itl_p99": s["itl_p99"],
                "second_token_gap_p50": statistics.median(gaps), "tpot_p50": s["tpot_p50"],
                **{f"goodput ({k})": self.slo.goodput(metrics, b, res.duration) for k, b in slos.items()},
            })  # fmt: skip
        return curve


def simulated_rows(modes, slos, knees, curves, grid) -> tuple[list[dict], float, float]:
    """Each mode's knees and its latencies at half colocated's loose knee and at that knee (the grid's nearest
    rates); and those two rates."""

    def nearest(rate):
        return grid[min(range(len(grid)), key=lambda i: abs(grid[i] - rate))]

    half, full = nearest(knees[("loose", "colocated")] / 2), nearest(knees[("loose", "colocated")])
    rows = []
    for mode in modes:
        at = next(c for c in curves[mode] if c["rate"] == half)
        at_knee = next(c for c in curves[mode] if c["rate"] == full)
        rows.append({
            "part": "simulated", "mode": mode, "floor": "simulated: no hardware time", **{f"knee ({k}) req/s": knees[(k, mode)] for k in slos},
            "at req/s": half, "ttft_p50_ms": at["ttft_p50"] * 1e3, "ttft_p99_ms": at["ttft_p99"] * 1e3,
            "second_token_gap_p50_ms": at["second_token_gap_p50"] * 1e3, "itl_p99_ms": at["itl_p99"] * 1e3,
            "at colocated's knee req/s": full, "ttft_p50_ms (knee)": at_knee["ttft_p50"] * 1e3,
            "itl_p99_ms (knee)": at_knee["itl_p99"] * 1e3,
        })  # fmt: skip
    return rows, half, full


def plan(fleet: Fleet, planner, slos, modes, knees) -> tuple[float, dict, dict]:
    """DistServe's planner: each phase's goodput alone (the other phase given ample replicas), then the split;
    printed beside the best split the simulation found."""
    slo, ample = fleet.slo, 8
    g_prefill = slo.max_rate_meeting(
        lambda r: slo.attainment(fleet.simulate(r, mode=(1, 256), replicas=1 + ample)[1], slo.SLO(ttft=1.0)),
        TARGET,
        0.1,
        200.0,
        0.05,
    )
    g_decode = {k: slo.max_rate_meeting(
        lambda r, b=b: slo.attainment(fleet.simulate(r, mode=(ample, 256), replicas=ample + 1)[1], slo.SLO(tpot=b.tpot)),
        TARGET, 0.1, 200.0, 0.05) for k, b in slos.items()}  # fmt: skip
    plans = {k: planner.best_split(REPLICAS, g_prefill, g) for k, g in g_decode.items()}
    for k, p in plans.items():
        best = max((m for m in modes if modes[m][0]), key=lambda m: knees[(k, m)])
        print(f"planner ({k}): g_p {g_prefill:.2f} req/s, g_d {g_decode[k]:.2f} req/s -> {p.prefill}P:{p.decode}D, "
              f"{p.goodput:.2f} req/s predicted; simulated best split {best} at {knees[(k, best)]:.2f} req/s, "
              f"colocated {knees[(k, 'colocated')]:.2f} req/s")  # fmt: skip
    return g_prefill, g_decode, plans


def fit_fleet(model, per_prompt, kv, quick) -> tuple[Fleet, list, int]:
    """The simulated fleet: step costs measured in this run, the transfer fitted to the measured rows, and a trace
    of long prompts (520-656 tokens, no reuse) with 32-128-token answers; also the step samples and the
    KV bytes a token."""
    sim, pol, loadgen, slo = bench.stages(FLEET, "simulator", "policies", "loadgen", "slo")
    samples = sim.measure_step_costs(model, seed=0)
    cost = sim.StepCost.fit(samples)
    per_token = kv.kv_bytes_per_token(model.config, torch.float32)
    transfer = sim.Transfer.fit(
        [(r["transfer_bytes"], r["transfer_ms"] / 1e3) for r in per_prompt if r["mode"] == "disaggregated"], per_token
    )
    print(f"fitted {cost}; transfer {transfer.latency * 1e3:.2f} ms + {transfer.bytes_per_second / 1e9:.2f} GB/s")
    trace = loadgen.conversation_trace(
        200 if quick else 500, 1.0, system_prompts=0, max_turns=1, user_length=(520, 656), output_length=(32, 128),
        seed=0,
    )  # fmt: skip
    return Fleet(sim, pol, slo, trace, cost, transfer), samples, per_token


def scenarios(fleet: Fleet) -> tuple[dict, dict]:
    """The two SLOs (a loose one, and one whose TPOT is twice a full decode batch's step at this trace's context)
    and the modes: name -> (prefill replicas, max_num_batched_tokens), colocated at two chunk sizes, then every
    split."""
    slo = fleet.slo
    decode_step = fleet.cost(16, 1, 700)
    slos = {"loose": slo.SLO(ttft=1.0, tpot=0.1), "tight TPOT": slo.SLO(ttft=1.0, tpot=round(2 * decode_step, 4))}
    modes = {"colocated": (0, 256), "colocated (chunk 64)": (0, 64)}
    modes |= {f"{p}P:{REPLICAS - p}D": (p, 256) for p in range(1, REPLICAS)}
    return slos, modes


def rate_grid(top: float, quick: bool) -> list[float]:
    """The rates the curves are drawn at, as fractions of the highest knee."""
    fractions = (0.2, 0.5, 0.8, 1.0, 1.2) if quick else (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)
    return sorted({round(top * f, 2) for f in fractions})


def main(quick: bool = False) -> bench.Result:
    kv, eng, planner = bench.stages(FLEET, "kv_connector", "replica_engine", "planner")
    torch.set_num_threads(1)
    model, which = bench.model()

    # Measured: a few prompts, one at a time, on one core per engine.
    tokens = heldout(bench.tokenizer(), n_tokens=8192, seq=1024).flatten().tolist()
    lengths, repeats, new_tokens = ([128, 512], 2, 8) if quick else ([64, 256, 512, 896], 3, 16)
    prompts = [tokens[r * 11 + n : r * 11 + 2 * n] for n in lengths for r in range(repeats)]
    per_prompt = measured(model, prompts, new_tokens, kv, eng)
    rows = measured_rows(model, per_prompt, lengths)
    bench.show(rows, f"measured on this machine, {which}: one request at a time, median of {repeats}")

    # Simulated at fleet scale, from step costs and transfers measured in this run.
    fleet, samples, per_token = fit_fleet(model, per_prompt, kv, quick)
    n = len(fleet.trace)
    slos, modes = scenarios(fleet)
    knees = {(s, m): fleet.knee(bound, mode=p) for s, bound in slos.items() for m, p in modes.items()}
    grid = rate_grid(max(knees.values()), quick)
    curves = {mode: fleet.curve(grid, p, slos) for mode, p in modes.items()}
    sim_rows, half, full = simulated_rows(modes, slos, knees, curves, grid)
    rows += sim_rows
    bench.show(
        sim_rows,
        f"simulated {REPLICAS} replicas, {n} requests (prompts 520-656, answers 32-128 tokens), least-outstanding; "
        f"knee = highest rate with {TARGET:.0%} within TTFT <= 1 s and TPOT <= 100 ms (loose) or "
        f"{slos['tight TPOT'].tpot * 1e3:.1f} ms (tight); latencies at {half} req/s (half colocated's loose knee) "
        f"and at {full} req/s (its knee)",
    )
    g_prefill, g_decode, plans = plan(fleet, planner, slos, modes, knees)

    figures = {
        "model": which,
        "measured": {
            "what": "one request at a time; colocated = one ReplicaEngine, disaggregated = two gloo ranks on loopback",
            "new_tokens": new_tokens,
            "repeats": repeats,
            "step_cost": dataclasses.asdict(fleet.cost),
            "steps_timed": len(samples),
            "transfer_latency_ms": fleet.transfer.latency * 1e3,
            "transfer_gb_per_s": fleet.transfer.bytes_per_second / 1e9,
            "kv_bytes_per_token": per_token,
        },  # fmt: skip
        "simulated": {
            "replicas": REPLICAS,
            "requests": n,
            "policy": "least_outstanding",
            "modes": {m: {"prefill_replicas": p, "max_num_batched_tokens": c} for m, (p, c) in modes.items()},
            "slos": {k: dataclasses.asdict(b) for k, b in slos.items()},
            "target": TARGET,
            "knees": {f"{k} / {m}": v for (k, m), v in knees.items()},
            "planner": {
                k: {"prefill_goodput": g_prefill, "decode_goodput": g_decode[k], **dataclasses.asdict(p)}
                for k, p in plans.items()
            },
            "curves": curves,
        },  # fmt: skip
    }
    return bench.Result(rows, figures, _plot(rows, curves, list(modes), list(slos)))


def _plot(rows, curves, modes, slo_names):
    plt = plot.setup()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.0))
    m = [r for r in rows if r["part"] == "measured"]
    for mode, marker in (("colocated", "o"), ("disaggregated", "s")):
        rs = [r for r in m if r["mode"] == mode]
        x = [r["prompt_tokens"] for r in rs]
        axes[0].plot(x, [r["ttft_ms"] for r in rs], marker + "-", label=f"{mode}: TTFT")
        axes[0].plot(x, [r["second_token_gap_ms"] for r in rs], marker + "--", label=f"{mode}: 1st->2nd token")
    axes[0].set(xlabel="prompt tokens", ylabel="ms", title="measured here, one request at a time")
    axes[0].legend(fontsize=7)
    for i, mode in enumerate(modes):
        c = curves[mode]
        rates = [p["rate"] for p in c]
        for ax, key in zip(axes[1:3], [f"goodput ({s})" for s in slo_names], strict=True):
            ax.plot(rates, [p[key] for p in c], "o-", color=f"C{i}", label=mode)
            ax.set(xlabel="offered req/s", ylabel="req/s within the SLO", title=f"simulated: {key}")
        axes[3].plot(rates, [p["itl_p99"] * 1e3 for p in c], "o-", color=f"C{i}", label=mode)
    axes[3].set(xlabel="offered req/s", ylabel="ms", yscale="log", title="simulated: p99 inter-token latency")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
