"""Stage 06 part 2 benchmark, EAGLE on SmolLM2-135M-Instruct: the shipped feature-space draft head
(labkit/assets/smollm2-eagle, trained by `python -m labkit.train --only eagle`) against plain greedy decoding.

    make bench STAGE=06b_eagle        (needs make setup; LABS_IMPL=solution, IMPL=student times your code)

Batch 1, greedy, one thread, every held-out chat prompt (labkit.eagle_data: subjects no training prompt names).
The baseline is the fastest plain decode the course has: the compiled one-token step (labkit.fast_decode.
StaticDecoder, kernels="cpp": labkit.cpu_kernels' float32 loop). EAGLE's verification runs the same weights and
loop compiled for k + 1 tokens (labkit.fast_verify.StaticVerifier, on the same cache; the loop reads each weight
once for all rows), and its draft step is compiled the same way (StaticDraft), the draft's matrices in Q8_0: a
draft step is memory-bound, and its rounding can cost acceptance but never change a verified token. The main
group (EAGLE at k = 1 .. K, and up to K while the draft is confident: propose's threshold, EAGLE-2's confidence)
runs interleaved with the plain decode, medians of repeats; a side group on the first SIDE_PROMPTS, one run, times
the slower decoders (the eager model's generate; Medusa heads trained on the same answers, as a chain and as
stage 06's tree, eager verification) and, at k = K, the draft not compiled, in float32, eager and with the whole
49,152-token LM head. Each row's floor: its target forwards at the weights' and cache's bytes, and its draft
steps at the draft's, at the measured bandwidth. Also measured:

- acceptance per draft position j (of the rounds whose drafts 1..j-1 were all accepted, how many accepted draft
  j too) and accepted per verification (the mean run of accepted drafts);
- the costs of a draft step and a verification of k + 1 tokens in plain target steps, which decide whether
  accepted tokens pay: speedup ~ (accepted + 1) / (verify + k * draft) (figures["break_even"], beside the
  measured speedup and the acceptance 1.3x needs); the prefills alone, timed beside them, so "decode_speedup"
  can take them out of both sides;
- inside stage 06's batching engine, the head as its proposer at the best fixed k and with choose_k, against the
  same engine without speculation, at a few concurrencies (stage06b.sweep checks its tokens against greedy);
- the head's training report (corpus, learning curve, EAGLE-1 / EAGLE-3 recipes), copied as measured.

Hugging Face's assisted generation cannot take this draft: transformers 5.23's candidate generators take a
standalone causal LM (`assistant_model`), the model's own MTP layers (`num_mtp_layers`; SmolLM2 has none) or a
cross-attending assistant; an EAGLE head reads the target's features, which assisted generation does not hand
over. Whether each variant emits exactly the baseline's tokens is recorded per prompt (a verification sums in
another order than a one-token step, so a near-tie may flip).
"""

import contextlib
import dataclasses
import json
import os
import time

import torch
from torch import nn

from labkit import bench, eagle, eagle_data, medusa, plot
from labkit.bench import floors
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.fast_decode import StaticDecoder
from labkit.fast_paged import accelerate
from labkit.fast_verify import StaticDraft, StaticVerifier
from labkit.impl import current, load
from labkit.testing import real_labkit
from labkit.train import SMOLLM2_MEDUSA

from .stage06b import crossover, sweep

K = 4  # the longest chain timed; every k from 1 to K runs
PLAIN = "plain, compiled step"  # every group's baseline
PREFILL = "the prefills alone"  # timed beside the decoders: each runs the same eager prefill per prompt
# EAGLE-2's dynamic draft length (propose's threshold): draft on while the running product of the draft's own
# probabilities stays at or above it; chosen by calibrate() (its first run, on held-out prompts 8 .. 23)
THRESHOLD = 0.6
CONFIDENT = f"EAGLE, k<={K} while confident"
DRAFT_QUANTIZATION = "q8_0"  # the draft's matrices (eagle.packed): a draft step reads a quarter of the bytes
ENGINE_CONCURRENCY = [1, 2, 4]
SIDE_PROMPTS = 8  # the side group's decoders (2-5x slower, or variants of the draft) time the first 8 prompts


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
def compiled_steps(eg, s: "Setup", head, k: int, draft: StaticDraft | None):
    """Inside: eagle_generate's target cache is s.cache (rewound), and its target forwards of up to k + 1 tokens on
    it (the verifications, the last rounds' shorter ones included) run s.verifier, compiled once per length; with a
    `draft`, `head`'s cache is draft.cache and its draft forwards of up to k + 1 positions run `draft` the same way.
    The prefills (the prompt through the target, then through the draft) stay eager, as the plain decode's does."""
    eager_target, eager_draft = eg.target_forward, eg.draft_forward

    def target_forward(model, c, ids):
        if c is not s.cache or len(ids) > k + 1:
            return eager_target(model, c, ids)
        feats, logits = s.verifier(torch.tensor([ids]))
        return feats[0], logits[0].float()

    def draft_forward(h, c, feats, next_ids):
        if draft is None or c is not draft.cache or len(next_ids) > k + 1:
            return eager_draft(h, c, feats, next_ids)
        return draft(feats, next_ids)

    def rewound(cache):
        def new_cache(*args):  # (batch, max_len) for the target, (max_len,) for the head
            if args[-1] > cache.max_seq_len or args[:-1] not in ((), (1,)):
                raise ValueError(f"the compiled steps' cache holds one sequence of {cache.max_seq_len}, not {args}")
            cache.truncate(0)
            return cache

        return new_cache

    eg.target_forward, eg.draft_forward, s.target.new_cache = target_forward, draft_forward, rewound(s.cache)
    if draft is not None:
        head.new_cache = rewound(draft.cache)
    try:
        yield
    finally:
        eg.target_forward, eg.draft_forward = eager_target, eager_draft
        del s.target.new_cache
        if draft is not None:
            del head.new_cache


def draft_step(forward, cache, hidden: int, context: int = 96):
    """A closure timing one draft step, forward(feats, ids) on `cache`, after `context` cached positions."""
    cache.truncate(0)
    forward(torch.zeros(context, hidden), torch.ones(context, dtype=torch.long))
    feat, token = torch.zeros(1, hidden), torch.ones(1, dtype=torch.long)

    def step():
        forward(feat, token)
        cache.truncate(context)

    return step


@dataclasses.dataclass
class Setup:
    """What every variant shares: the target, its heads, the prompts, the compiled steps and their caches."""

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
    draft: StaticDraft
    reference: list


def setup(n_prompts: int, new: int) -> Setup:
    eg, target, tok = load("stage06_speculative.eagle"), real_labkit(), load_tokenizer(require_real_model())
    head = eagle.load(eagle.REAL_EAGLE, target)
    full = eagle.load(eagle.REAL_EAGLE, target, full_vocab=True)
    q8 = eagle.packed(head, DRAFT_QUANTIZATION)
    heads = {"EAGLE": q8, "EAGLE, draft not compiled": q8, "EAGLE, float32 draft": eagle.packed(head),
             "EAGLE, eager draft": head, "EAGLE, full LM head": eagle.packed(full, DRAFT_QUANTIZATION)}  # fmt: skip
    prompts = [tok.encode(p).ids for p in eagle_data.prompts(n_prompts, heldout=True)]
    # one cache for the plain decode and EAGLE's verification: a prompt, its tokens, k + 1 drafts (costs: 96 + k + 1)
    size = max(128, max(len(p) for p in prompts) + new + K + 1)
    plain, decoder, cache = compiled_greedy(target, size)
    reference = [plain(p, new) for p in prompts]  # also compiles the step before any timing
    verifier, draft = StaticVerifier(target, cache, kernels="cpp"), StaticDraft(head, head.new_cache(size))
    for T in range(1, K + 2):  # compiles every length a round verifies, or drafts after a verification
        cache.truncate(0)
        verifier(torch.ones(1, T, dtype=torch.long))
        draft.cache.truncate(0)
        draft(torch.zeros(T, head.config.hidden_size), torch.ones(T, dtype=torch.long))
    return Setup(eg, target, tok, heads, prompts, new, plain, decoder, cache, verifier, draft, reference)


@dataclasses.dataclass
class Group:
    """Decoders timed together, interleaved, over the same prompts: `fns`, name -> a closure over them; EAGLE's
    `runs`, name -> (head, k, threshold, compiled draft or None), each round in rounds[name] (drafted, accepted), the
    tokens in outputs[name]; Medusa's (tokens, stats) in medusa_runs[name]; the medians in `times` once timed."""

    prompts: list
    reference: list
    fns: dict
    runs: dict
    rounds: dict
    outputs: dict
    medusa_runs: dict
    times: dict = dataclasses.field(default_factory=dict)


def variants(s: Setup, side: bool) -> Group:
    """The main group: EAGLE at k = 1 .. K and while confident, its draft compiled, on every prompt. The side group,
    on the first SIDE_PROMPTS: the slower decoders (the eager model, Medusa) and the draft's variants at k = K (not
    compiled, float32, eager, the whole LM head). Both time the compiled plain decode and the prefills beside them."""
    eg, target, new = s.eg, s.target, s.new
    prompts, reference = (s.prompts[:SIDE_PROMPTS], s.reference[:SIDE_PROMPTS]) if side else (s.prompts, s.reference)
    if side:
        runs = {f"{name}, k={K}": (head, K, 0.0, None) for name, head in s.heads.items() if name != "EAGLE"}
    else:
        runs = {f"EAGLE, k={k}": (s.heads["EAGLE"], k, 0.0, s.draft) for k in range(1, K + 1)}
        runs[CONFIDENT] = (s.heads["EAGLE"], K, THRESHOLD, s.draft)
    g = Group(prompts, reference, {}, runs, {}, {name: [] for name in runs}, {})
    verify = eg.verify

    def counted(name):
        def fn(target, cache, tokens, drafted, *args, **kwargs):
            out = verify(target, cache, tokens, drafted, *args, **kwargs)
            g.rounds[name].append((len(drafted), len(out[0]) - 1))  # (0, 0): a last round with no room to draft
            return out

        return fn

    def timed(name):
        head, k, threshold, draft = runs[name]

        def go():
            g.rounds[name], g.outputs[name] = [], []
            eg.verify = counted(name)
            with compiled_steps(eg, s, head, k, draft):
                for p in prompts:
                    g.outputs[name].append(eg.eagle_generate(target, head, p, new, k=k, threshold=threshold)[0])
            eg.verify = verify

        return go

    g.fns = {PLAIN: lambda: [s.plain(p, new) for p in prompts], PREFILL: lambda: [s.plain(p, 1) for p in prompts]}
    if side:
        g.fns["plain, eager model"] = lambda: [target.generate(p, new, stop_at_eos=False) for p in prompts]
    g.fns |= {name: timed(name) for name in runs}
    if side and (SMOLLM2_MEDUSA / "config.json").is_file():  # heads on the same data, eager verification
        md, heads_m = load("stage06_speculative.medusa"), medusa.load(SMOLLM2_MEDUSA, target)
        chain = [(0,) * d for d in range(1, K + 1)]
        for name, paths in {f"Medusa chain, k={K}, eager verify": chain,
                            f"Medusa {len(md.MEDUSA_CHOICES)}-node tree, eager verify": md.MEDUSA_CHOICES}.items():  # fmt: skip

            def go(name=name, paths=paths):
                g.medusa_runs[name] = [md.medusa_generate(target, heads_m, p, new, paths=paths) for p in prompts]

            g.fns[name] = go
    return g


def step_costs(s: Setup, quick: bool) -> dict:
    """Timings of a target step (compiled, eager), a verification of k + 1 tokens (eager, compiled) and a draft
    step of each head (the shipped one compiled and not), at 96 cached positions."""
    eg, target, cache = s.eg, s.target, s.cache

    def compiled_step():
        s.decoder(torch.ones(1, 1, dtype=torch.long))
        cache.truncate(cache.length - 1)

    cache.truncate(0)
    target(torch.ones(1, 96, dtype=torch.long), cache)

    def verify(T):
        return lambda: (s.verifier(torch.ones(1, T, dtype=torch.long)), cache.truncate(96))

    H = target.config.hidden_size
    drafts = {"EAGLE": draft_step(s.draft, s.draft.cache, H)}
    for name, head in s.heads.items():
        if name != "EAGLE":
            c = head.new_cache(97)
            drafts[name] = draft_step(lambda f, i, head=head, c=c: eg.draft_forward(head, c, f, i), c, H)
    return bench.interleaved(
        {"target step, compiled": compiled_step, "target step, eager": bench.decode_step(target, 96, 1),
         f"verify {K + 1} tokens, eager": bench.decode_step(target, 96, K + 1),
         **{f"verify {k + 1} tokens, compiled": verify(k + 1) for k in range(1, K + 1)},
         **{f"draft step, {name}": fn for name, fn in drafts.items()}},
        10 if quick else 30, warmup=3,
    )  # fmt: skip


def decoder_rows(s: Setup, g: Group) -> list[dict]:
    """One row a decoder of group g: its acceptance, how many prompts it decoded exactly as the compiled baseline,
    its time and speedup over the group's compiled plain decode, and its floor: every target forward (prefills
    included) reading the weights and a mean context's cache, every draft step the draft's matrices in Q8_0 (34
    bytes a 32 weights, the fewest any variant stores them in)."""
    prompts, reference, times = g.prompts, g.reference, g.times
    base, prefill = times[PLAIN].median, times[PREFILL].median

    def decode_speedup(t: float) -> float:  # the prefill every decoder shares taken out of both sides
        return (base - prefill) / (t - prefill)

    context = max(len(p) for p in prompts) + s.new // 2
    step_bytes = floors.decode_bytes(s.target, context)
    draft_bytes = 34 / 32 * sum(m.weight.numel() for m in s.heads["EAGLE"].modules() if isinstance(m, nn.Linear))
    forwards, drafts = dict.fromkeys(g.fns, len(prompts) * s.new), dict.fromkeys(g.fns, 0)
    accepted, per_position = {}, {}
    for name, results in g.medusa_runs.items():
        g.outputs[name] = [out for out, _ in results]
        stats = [st for _, st in results]
        forwards[name] = sum(st.target_forwards for st in stats)
        accepted[name] = round(sum(st.accepted for st in stats) / max(forwards[name] - len(prompts), 1), 3)
    for name, (_, k, _, _) in g.runs.items():
        forwards[name], drafts[name] = len(prompts) + len(g.rounds[name]), sum(d for d, _ in g.rounds[name])
        r = [(d, n) for d, n in g.rounds[name] if d]
        accepted[name] = round(sum(n for _, n in r) / max(len(r), 1), 3)
        per_position[name] = []
        for j in range(1, k + 1):
            reached = [n for d, n in r if d >= j and n >= j - 1]
            per_position[name].append(round(sum(n >= j for n in reached) / max(len(reached), 1), 3))
    return [{"decoder": name, "prompts": len(prompts), "target_forwards": forwards[name],
             "accepted_per_verify": accepted.get(name), "acceptance_per_position": per_position.get(name),
             "identical_prompts": f"{sum(o == r for o, r in zip(g.outputs.get(name, reference), reference, strict=True))}/{len(prompts)}",
             "seconds": times[name].median, "speedup": base / times[name].median,
             "decode_speedup": decode_speedup(times[name].median),
             **floors.row(times[name].median, bytes=forwards[name] * step_bytes + drafts[name] * draft_bytes)}
            for name in g.fns if name != PREFILL]  # fmt: skip


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
            drafts = [d for d, _ in rounds[name] if d]
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
    n_prompts, new, repeats = (2, 32, 1) if quick else (eagle_data.HELDOUT, 64, 2)
    s = setup(n_prompts, new)
    main_group, side = variants(s, side=False), variants(s, side=True)
    main_group.times = bench.interleaved(main_group.fns, repeats, warmup=0)  # setup compiled every step
    side.times = bench.interleaved(side.fns, 1, warmup=0)
    costs = step_costs(s, quick)
    unit = costs["target step, compiled"].median
    rows, side_rows = decoder_rows(s, main_group), decoder_rows(s, side)
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
    bench.show(side_rows, f"beside them, on the first {len(side.prompts)} of the prompts, one run")
    print(
        f"costs in compiled target steps ({unit * 1e3:.1f} ms): " + ", ".join(f"{n} {c}" for n, c in cost_rows.items())
    )
    ok = "error" not in engine[0]
    figures = {"prompts": len(s.prompts), "new_tokens": new, "repeats": repeats, "k": K, "best_k": best_k,
               "side_prompts": len(side.prompts), "side_repeats": 1,
               "prefills_s": main_group.times[PREFILL].median,
               "prefill_share_of_plain": main_group.times[PREFILL].median / main_group.times[PLAIN].median,
               "target_step_compiled_s": unit, "costs_in_compiled_target_steps": cost_rows,
               "break_even": break_even(rows, cost_rows, main_group.rounds), "head_vocab": len(s.heads["EAGLE"].vocab),
               "engine_k": best_k, "engine": engine, **floors.figures(),
               "engine_crossover_fixed_k": crossover(engine) if ok else None,
               "engine_crossover_adaptive": crossover(engine, "adaptive_speedup") if ok else None,
               "training": training_report()}  # fmt: skip
    return bench.Result(rows + side_rows, figures, _plot(rows + side_rows))


@torch.inference_mode()
def calibrate(
    thresholds=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), first: int = eagle_data.HELDOUT, count: int = 16, new: int = 64
):
    """How THRESHOLD is chosen (`python -c "from labkit.bench.stage06b_eagle import calibrate; calibrate()"`): EAGLE
    with up to K drafts a round at each threshold (0: always K; 1: one draft a round) on held-out prompts first ..
    first + count - 1 (by default past the HELDOUT that main() times); one interleaved run, each threshold's
    wall-clock speedup over the compiled plain decode and its drafts and accepted per verification, saved as
    bench_results/stage06b_eagle_calibration.json."""
    pin_threads(1)
    load0 = os.getloadavg()[0]
    s = setup(first + count, new)
    prompts, eg, target, head = s.prompts[first:], s.eg, s.target, s.heads["EAGLE"]
    stats = {}

    def run(threshold):
        def go():
            with compiled_steps(eg, s, head, K, s.draft):
                stats[threshold] = [
                    eg.eagle_generate(target, head, p, new, k=K, threshold=threshold)[1] for p in prompts
                ]

        return go

    fns = {"plain": lambda: [s.plain(p, new) for p in prompts]} | {t: run(t) for t in thresholds}
    times = bench.interleaved(fns, 1, warmup=0)  # setup compiled every step
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
    ax.barh([r["decoder"] for r in rows], [r["speedup"] for r in rows])
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="speedup over plain greedy (compiled step)", title="SmolLM2, batch 1, one thread")
    ax.invert_yaxis()
    fig.tight_layout()
    return fig
