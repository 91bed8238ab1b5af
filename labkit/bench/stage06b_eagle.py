"""Stage 06 part 2 benchmark, EAGLE on SmolLM2-135M-Instruct: the shipped feature-space draft head
(labkit/assets/smollm2-eagle, trained by `python -m labkit.train --only eagle`) against plain greedy decoding.

    make bench STAGE=06b_eagle        (needs make setup; LABS_IMPL=solution, IMPL=student times your code)

Batch 1, greedy, one thread, held-out chat prompts (labkit.eagle_data: subjects no training prompt
names). The baseline is plain greedy decoding with the compiled one-token step (labkit.fast_decode.
StaticDecoder, torch.compile, kernels="cpp": labkit.cpu_kernels' float32 loop where it builds), the
fastest plain decode the course has; the eager model's own generate is timed beside it. EAGLE's
verification runs the same weights and kernels compiled for k + 1 tokens (labkit.fast_verify.
StaticVerifier, on the same cache), so both sides use the compiler and the loop (which reads each weight
once for all k + 1 rows); the eager verification is a cost row. The draft's matrices (fc, the layer and the
reduced LM head) run labkit.cpu_kernels in Q8_0 (labkit.eagle.packed): a draft step is memory-bound, and the
draft's rounding can only cost acceptance, never change a verified token; the float32 draft is timed beside it.
All variants run interleaved in one process, medians of repeats; each row's floor is the plain decode's
bytes (every weight once per token) at the measured bandwidth.

- acceptance per draft position j: of the rounds whose drafts 1..j-1 were all accepted, how many
  accepted draft j too; accepted per verification is the mean run of accepted drafts (the tokens a
  verification emits are that + 1);
- the cost breakdown: a draft step (one position through fc, the layer and the reduced LM head; packed and
  eager) and a verification over k + 1 tokens for each k, in units of one plain target step, which is what
  decides whether the accepted tokens pay: speedup ~ (accepted + 1) / (verify + k * draft) in those units
  (figures["break_even"]: that prediction per k beside the measured speedup, and the acceptance 1.3x needs);
- the prefills alone (each prompt's eager forward, which every decoder runs first), timed beside them: a
  row's "speedup" is wall clock, prefill included; its "decode_speedup" takes the prefill out of both sides,
  which is what the prediction above describes;
- EAGLE at k = 1 .. K; up to K while the draft is confident (propose's threshold, EAGLE-2's confidence: each
  round drafts until the running product of the draft's probabilities falls below THRESHOLD); at k = K the
  float32 draft, the eager draft and the whole 49,152-token LM head, for what the Q8_0 draft, the packed loop and
  the reduced vocabulary buy;
- Medusa heads trained on the same answers (labkit/assets/smollm2-medusa, `python -m labkit.train --only
  smollm2-medusa`), as a chain of 4 and as stage 06's tree, through the stage's medusa_generate (eager
  verification);
- inside stage 06's batching engine (batch_engine.py, every request submitted at once, the target's and the
  head's matrices on labkit.cpu_kernels), the EAGLE head as its proposer at the fixed k that was fastest at
  batch 1 and with choose_k (the acceptance-aware policy, on costs measured here), against the same engine
  without speculation, at a few concurrencies (stage06b.sweep: its outputs must equal the target's greedy);
- the head's training report (labkit/assets/smollm2-eagle/config.json, written by labkit.train_eagle): the
  corpus and its generation time, the learning curve and the EAGLE-1 / EAGLE-3 recipes, copied as measured.

Hugging Face's assisted generation cannot take this draft: transformers 5.23's candidate generators
take a standalone causal LM (`assistant_model`), the model's own MTP layers (`num_mtp_layers` in its
config; SmolLM2 has none) or a cross-attending assistant (SinglePositionMultiTokenCandidateGenerator);
an EAGLE head is none of these (it reads the target's features, which assisted generation does not
hand to an assistant).

Whether each variant emits exactly the compiled baseline's tokens is recorded per prompt (a verification
over k + 1 tokens sums in another order than a one-token step, so a near-tie may flip).
"""

import contextlib
import dataclasses
import json
import os
import time

import torch

from labkit import bench, eagle, eagle_data, medusa, plot
from labkit.bench import floors
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.fast_decode import StaticDecoder
from labkit.fast_paged import accelerate
from labkit.fast_verify import StaticVerifier
from labkit.impl import current, load
from labkit.testing import real_labkit
from labkit.train import SMOLLM2_MEDUSA

from .stage06b import crossover, sweep

K = 4  # the longest chain timed; every k from 1 to K runs
PREFILL = "the prefills alone"  # timed beside the decoders: each runs the same eager prefill per prompt
# EAGLE-2's dynamic draft length (propose's threshold): draft on while the running product of the draft's own
# probabilities stays at or above it; chosen by calibrate() on held-out prompts main() does not time
THRESHOLD = 0.6
CONFIDENT = f"EAGLE, k<={K} while confident"
DRAFT_QUANTIZATION = "q8_0"  # the draft's matrices (eagle.packed): a draft step reads a quarter of the bytes
ENGINE_CONCURRENCY = [1, 2, 4]


def compiled_greedy(target, max_len: int):
    """prompt, n -> n greedy tokens: the eager prefill, then compiled one-token steps, one cache reused (n = 1:
    the prefill alone, which every decoder here runs the same way)."""
    cache = target.new_cache(1, max_len)
    decoder = StaticDecoder(target, cache, "compile", kernels="cpp")

    def run(prompt: list[int], n: int) -> list[int]:
        cache.truncate(0)
        out = [int(target(torch.tensor([prompt]), cache)[0, -1].argmax())]
        while len(out) < n:
            out.append(int(decoder(torch.tensor([out[-1:]]))[0, -1].argmax()))
        return out

    return run, decoder, cache


@contextlib.contextmanager
def compiled_verification(eg, target, cache, verifier: StaticVerifier, k: int):
    """Inside: eagle_generate's target cache is `cache` (rewound), and its target forwards of up to k + 1 tokens on
    it (the verifications, the last rounds' shorter ones included) run `verifier`, compiled once per length; the
    prefill stays eager, as the plain decode's does."""
    eager_forward, new_cache = eg.target_forward, target.new_cache

    def target_forward(model, c, ids):
        if c is not cache or len(ids) > k + 1:
            return eager_forward(model, c, ids)
        feats, logits = verifier(torch.tensor([ids]))
        return feats[0], logits[0].float()

    def shared_cache(batch, max_len):
        if batch != 1 or max_len > cache.max_seq_len:
            raise ValueError(f"the compiled verification's cache holds {cache.max_seq_len} positions, not {max_len}")
        cache.truncate(0)
        return cache

    eg.target_forward, target.new_cache = target_forward, shared_cache
    try:
        yield
    finally:
        eg.target_forward, target.new_cache = eager_forward, new_cache


def draft_step(eg, head, context: int = 96):
    """A closure timing one draft step (one position) after `context` cached draft positions."""
    cache = head.new_cache(context + 1)
    H = head.config.hidden_size
    eg.draft_forward(head, cache, torch.zeros(context, H), torch.ones(context, dtype=torch.long))
    feat, token = torch.zeros(1, H), torch.ones(1, dtype=torch.long)

    def step():
        eg.draft_forward(head, cache, feat, token)
        cache.truncate(context)

    return step


@dataclasses.dataclass
class Setup:
    """What every variant shares: the target and its heads, the held-out prompts, and the compiled plain decode
    with the one cache it shares with EAGLE's compiled verification."""

    eg: object
    target: object
    tok: object
    heads: dict
    prompts: list
    new: int
    plain: object
    decoder: object
    cache: object
    verifier: StaticVerifier
    reference: list


def setup(n_prompts: int, new: int) -> Setup:
    eg = load("stage06_speculative.eagle")
    folder = require_real_model()
    target, tok = real_labkit(), load_tokenizer(folder)
    head = eagle.load(eagle.REAL_EAGLE, target)
    full = eagle.load(eagle.REAL_EAGLE, target, full_vocab=True)
    heads = {"EAGLE": eagle.packed(head, DRAFT_QUANTIZATION), "EAGLE, float32 draft": eagle.packed(head),
             "EAGLE, eager draft": head, "EAGLE, full LM head": eagle.packed(full, DRAFT_QUANTIZATION)}  # fmt: skip
    prompts = [tok.encode(p).ids for p in eagle_data.prompts(n_prompts, heldout=True)]
    # one cache for the plain decode and EAGLE's verification: a prompt, its tokens and k + 1 drafts; 96 + k + 1
    # for the cost timings
    plain, decoder, cache = compiled_greedy(target, max(128, max(len(p) for p in prompts) + new + K + 1))
    reference = [plain(p, new) for p in prompts]  # also compiles the step before any timing
    verifier = StaticVerifier(target, cache, kernels="cpp")
    return Setup(eg, target, tok, heads, prompts, new, plain, decoder, cache, verifier, reference)


def variants(s: Setup):
    """The decoders timed, name -> a closure over every prompt; EAGLE's runs, name -> (head, k, threshold), whose
    verifications each closure counts into rounds[name] (drafted, accepted) and whose tokens land in
    outputs[name]; Medusa's (tokens, stats) per prompt land in medusa_runs[name]."""
    eg, target, prompts, new = s.eg, s.target, s.prompts, s.new
    rounds: dict[str, list[tuple[int, int]]] = {}
    verify = eg.verify

    def counted(name):
        def fn(target, cache, tokens, drafted, *args, **kwargs):
            out = verify(target, cache, tokens, drafted, *args, **kwargs)
            if drafted:
                rounds[name].append((len(drafted), len(out[0]) - 1))
            return out

        return fn

    runs = {f"EAGLE, k={k}": (s.heads["EAGLE"], k, 0.0) for k in range(1, K + 1)}
    runs[CONFIDENT] = (s.heads["EAGLE"], K, THRESHOLD)
    runs |= {f"{name}, k={K}": (head, K, 0.0) for name, head in s.heads.items() if name != "EAGLE"}
    outputs = {name: [] for name in runs}

    def timed(name):
        head, k, threshold = runs[name]

        def go():
            rounds[name], outputs[name] = [], []
            eg.verify = counted(name)
            with compiled_verification(eg, target, s.cache, s.verifier, k):
                for p in prompts:
                    outputs[name].append(eg.eagle_generate(target, head, p, new, k=k, threshold=threshold)[0])
            eg.verify = verify

        return go

    fns = {"plain, compiled step": lambda: [s.plain(p, new) for p in prompts]}
    fns[PREFILL] = lambda: [s.plain(p, 1) for p in prompts]
    fns["plain, eager model"] = lambda: [target.generate(p, new, stop_at_eos=False) for p in prompts]
    fns |= {name: timed(name) for name in runs}
    medusa_runs = {}  # Medusa heads on the same data (python -m labkit.train --only smollm2-medusa), eager verify
    if (SMOLLM2_MEDUSA / "config.json").is_file():
        md, heads_m = load("stage06_speculative.medusa"), medusa.load(SMOLLM2_MEDUSA, target)
        chain = [(0,) * d for d in range(1, K + 1)]
        for name, paths in {f"Medusa chain, k={K}, eager verify": chain,
                            f"Medusa {len(md.MEDUSA_CHOICES)}-node tree, eager verify": md.MEDUSA_CHOICES}.items():  # fmt: skip

            def go(name=name, paths=paths):
                medusa_runs[name] = [md.medusa_generate(target, heads_m, p, new, paths=paths) for p in prompts]

            fns[name] = go
    return fns, runs, rounds, outputs, medusa_runs


def step_costs(s: Setup, quick: bool) -> dict:
    """Timings of a target step (compiled, eager), a verification of k + 1 tokens (eager, compiled) and a draft
    step of each head, at 96 cached positions."""
    eg, target, cache = s.eg, s.target, s.cache

    def compiled_step():
        s.decoder(torch.ones(1, 1, dtype=torch.long))
        cache.truncate(cache.length - 1)

    cache.truncate(0)
    target(torch.ones(1, 96, dtype=torch.long), cache)

    def verify(T):
        return lambda: (s.verifier(torch.ones(1, T, dtype=torch.long)), cache.truncate(96))

    return bench.interleaved(
        {"target step, compiled": compiled_step, "target step, eager": bench.decode_step(target, 96, 1),
         f"verify {K + 1} tokens, eager": bench.decode_step(target, 96, K + 1),
         **{f"verify {k + 1} tokens, compiled": verify(k + 1) for k in range(1, K + 1)},
         **{f"draft step, {name}": draft_step(eg, head) for name, head in s.heads.items()}},
        10 if quick else 30, warmup=3,
    )  # fmt: skip


def decoder_rows(s: Setup, fns, runs, rounds, outputs, medusa_runs, times) -> list[dict]:
    """One row a decoder: its acceptance, how many prompts it decoded exactly as the compiled baseline, its
    time and speedup, and its floor (the plain decode's bytes)."""
    prompts, reference = s.prompts, s.reference
    base, prefill = times["plain, compiled step"].median, times[PREFILL].median

    def decode_speedup(t: float) -> float:  # the prefill every decoder shares taken out of both sides
        return (base - prefill) / (t - prefill)

    medusa_accepted = {}
    context = max(len(p) for p in prompts) + s.new // 2  # a step's mean context, for the bytes it must read
    floor_bytes = len(prompts) * s.new * floors.decode_bytes(s.target, context)
    for name, results in medusa_runs.items():
        outputs[name] = [out for out, _ in results]
        stats = [st for _, st in results]
        rounds_m = sum(st.target_forwards - 1 for st in stats)  # verifications (not the prefill)
        medusa_accepted[name] = round(sum(st.accepted for st in stats) / max(rounds_m, 1), 3)
    rows = [{"decoder": name, "accepted_per_verify": medusa_accepted.get(name), "acceptance_per_position": None,
             "identical_prompts": f"{sum(o == r for o, r in zip(outputs.get(name, reference), reference, strict=True))}/{len(prompts)}",
             "seconds": times[name].median, "speedup": base / times[name].median,
             "decode_speedup": decode_speedup(times[name].median),
             **floors.row(times[name].median, bytes=floor_bytes)} for name in fns if name not in runs and name != PREFILL]  # fmt: skip
    for name, (_, k, _) in runs.items():
        r = rounds[name]
        per_position = []
        for j in range(1, k + 1):
            reached = [n for d, n in r if d >= j and n >= j - 1]
            per_position.append(round(sum(n >= j for n in reached) / max(len(reached), 1), 3))
        rows.append({
            "decoder": name,
            "accepted_per_verify": round(sum(n for _, n in r) / max(len(r), 1), 3),
            "acceptance_per_position": per_position,
            "identical_prompts": f"{sum(o == ref for o, ref in zip(outputs[name], reference, strict=True))}/{len(prompts)}",
            "seconds": times[name].median,
            "speedup": base / times[name].median,
            "decode_speedup": decode_speedup(times[name].median),
            **floors.row(times[name].median, bytes=floor_bytes),
        })  # fmt: skip
    return rows


def engine_rows(s: Setup, quick: bool, k: int) -> list[dict]:
    """The EAGLE head inside stage 06's batching engine (stage06b.sweep) at fixed k and choose_k up to K, the
    target's and the head's matrices on labkit.cpu_kernels (fast_paged.accelerate), or one row with the error
    when a near-tie made an engine's tokens differ from the (same kernels') eager model's."""
    eng = load("stage06_speculative.batch_engine")
    target, head = accelerate(s.target), s.heads["EAGLE"]
    engine_prompts = [s.tok.encode(p).ids for p in eagle_data.prompts(max(ENGINE_CONCURRENCY), heldout=True)]
    engine_costs = eng.Costs.measure(target, head, ENGINE_CONCURRENCY, k_max=K)
    try:  # sweep checks every engine's tokens against the eager model's greedy decoding
        rows = sweep(target, head, engine_prompts, 16 if quick else 32, ENGINE_CONCURRENCY, k, engine_costs,
                     repeats=1 if quick else 3, k_max=K, warmup=0)  # fmt: skip
        bench.show(rows, f"EAGLE inside the batching engine, k = {k} fixed or choose_k up to {K}")
    except AssertionError as e:  # a near-tie the k + 1-token verification rounds the other way: say so, keep the rest
        rows = [{"error": str(e)}]
        print("engine sweep:", e)
    return rows


def break_even(rows: list[dict], costs: dict, rounds: dict) -> dict:
    """Per k: accepted drafts per verification (n), the verification's cost v and k draft steps (c each) in
    compiled target steps, the predicted speedup (1 + n) / (v + k c), the measured one, and the n that 1.3x
    would need at those costs. The confident chain's k varies by round: its k and v are means over its rounds."""
    c, out = costs["draft step, EAGLE"], {}
    for r in rows:
        name = r["decoder"]
        if name.startswith("EAGLE, k="):
            drafts = [int(name.removeprefix("EAGLE, k="))]
        elif name == CONFIDENT:
            drafts = [d for d, _ in rounds[name]]
        else:
            continue
        k = sum(drafts) / len(drafts)
        v = sum(costs[f"verify {d + 1} tokens, compiled"] for d in drafts) / len(drafts)
        n = r["accepted_per_verify"]
        out[drafts[0] if name != CONFIDENT else "confident"] = {
            "drafts": round(k, 3), "accepted": n, "verify": round(v, 3), "draft": c,
            "predicted_speedup": round((1 + n) / (v + k * c), 3), "measured_speedup": round(r["speedup"], 3),
            "measured_decode_speedup": round(r["decode_speedup"], 3), "accepted_for_1.3x": round(1.3 * (v + k * c) - 1, 3),
        }  # fmt: skip
    return out


def training_report() -> dict:
    """What the shipped head's training measured (labkit.train_eagle): corpus, learning curve, recipes."""
    report = json.loads((eagle.REAL_EAGLE / "config.json").read_text())
    keys = ("data", "recipe", "steps", "batch", "train_seconds", "heldout", "learning_curve", "recipes")
    return {key: report[key] for key in keys if key in report}


@torch.inference_mode()
def main(quick: bool = False) -> bench.Result:
    pin_threads(1)
    n_prompts, new, repeats = (2, 32, 1) if quick else (8, 64, 2)
    s = setup(n_prompts, new)
    fns, runs, rounds, outputs, medusa_runs = variants(s)
    for name in runs:  # compiles the verification of k + 1 tokens
        fns[name]()
    times = bench.interleaved(fns, repeats, warmup=0)  # the reference run above compiled the plain step
    costs = step_costs(s, quick)
    unit = costs["target step, compiled"].median
    rows = decoder_rows(s, fns, runs, rounds, outputs, medusa_runs, times)
    cost_rows = {name: round(t.median / unit, 3) for name, t in costs.items()}
    best = max((r for r in rows if r["decoder"].startswith("EAGLE, k=")), key=lambda r: r["speedup"])
    best_k = int(best["decoder"].removeprefix("EAGLE, k="))
    engine = engine_rows(s, quick, best_k)
    title = (
        f"stage 06b EAGLE: SmolLM2-135M-Instruct, head {eagle.REAL_EAGLE.name} "
        f"(vocab {len(s.heads['EAGLE'].vocab)}), {len(s.prompts)} held-out prompts x {new} tokens, greedy, "
        f"impl={current()}, median of {repeats}"
    )
    bench.show(rows, title)
    print(
        f"costs in compiled target steps ({unit * 1e3:.1f} ms): " + ", ".join(f"{n} {c}" for n, c in cost_rows.items())
    )
    ok = "error" not in engine[0]
    figures = {"prompts": len(s.prompts), "new_tokens": new, "repeats": repeats, "k": K, "best_k": best_k,
               "prefills_s": times[PREFILL].median,
               "prefill_share_of_plain": times[PREFILL].median / times["plain, compiled step"].median,
               "target_step_compiled_s": unit, "costs_in_compiled_target_steps": cost_rows,
               "break_even": break_even(rows, cost_rows, rounds), "head_vocab": len(s.heads["EAGLE"].vocab),
               "engine_k": best_k, "engine": engine, **floors.figures(),
               "engine_crossover_fixed_k": crossover(engine) if ok else None,
               "engine_crossover_adaptive": crossover(engine, "adaptive_speedup") if ok else None,
               "training": training_report()}  # fmt: skip
    return bench.Result(rows, figures, _plot(rows))


@torch.inference_mode()
def calibrate(thresholds=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), first: int = 8, count: int = 16, new: int = 64) -> dict:
    """How THRESHOLD was chosen: EAGLE with up to K drafts a round at each threshold (0: always K; 1: one draft a
    round) on held-out prompts first .. first + count - 1, none of which main() times; one interleaved run, each
    threshold's wall-clock speedup over the compiled plain decode and its drafts and accepted per verification,
    saved as bench_results/stage06b_eagle_calibration.json.

        .venv/bin/python -c "from labkit.bench.stage06b_eagle import calibrate; calibrate()"
    """
    pin_threads(1)
    load0 = os.getloadavg()[0]
    s = setup(first + count, new)
    prompts, eg, target, head = s.prompts[first:], s.eg, s.target, s.heads["EAGLE"]
    stats = {}

    def run(threshold):
        def go():
            with compiled_verification(eg, target, s.cache, s.verifier, K):
                stats[threshold] = [
                    eg.eagle_generate(target, head, p, new, k=K, threshold=threshold)[1] for p in prompts
                ]

        return go

    fns = {"plain": lambda: [s.plain(p, new) for p in prompts]} | {t: run(t) for t in thresholds}
    for fn in fns.values():  # compiles each verification length once
        fn()
    times = bench.interleaved(fns, 1, warmup=0)
    rows = []
    for t in thresholds:
        rounds = sum(st.target_forwards - 1 for st in stats[t])
        rows.append({"threshold": t, "speedup": round(times["plain"].median / times[t].median, 3),
                     "drafts_per_verification": round(sum(st.proposed for st in stats[t]) / rounds, 3),
                     "accepted_per_verification": round(sum(st.accepted for st in stats[t]) / rounds, 3)})  # fmt: skip
    bench.show(rows, f"EAGLE up to k = {K} by threshold: held-out prompts {first} .. {first + count - 1}, one run")
    run = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip
    figures = {"prompts": f"held-out {first} .. {first + count - 1}", "new_tokens": new, "k": K, "repeats": 1}
    bench.save(bench.Result(rows, figures), "stage06b_eagle_calibration", run)
    return rows


def _plot(rows: list[dict]):
    """Wall-clock speedup over the compiled plain decode, per decoder."""
    plt = plot.setup()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["decoder"] for r in rows]
    ax.barh(names, [r["speedup"] for r in rows])
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="speedup over plain greedy (compiled step)", title="SmolLM2, batch 1, one thread")
    ax.invert_yaxis()
    fig.tight_layout()
    return fig
