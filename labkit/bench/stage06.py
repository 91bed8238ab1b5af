"""Stage 06 benchmark: greedy speculative decoding on the tiny pair against plain target decoding.

    make bench STAGE=06                      (LABS_IMPL=solution; IMPL=student times your own code)
    make bench STAGE=06 MODEL=dir DRAFT=dir  (your own target/draft pair, sharing a tokenizer)
    make bench STAGE=06_real                 (the real model drafted by its own first layers: stage06_real.py)

Batch 1, greedy, held-out story prompts. For each k: acceptance rate, the per-token acceptance
alpha, tokens per target forward, and the wall-clock speedup over the target's own cached greedy
decoding (labkit.model.Llama.generate), timed interleaved in one run as medians of repeats; every
run must produce the target's greedy tokens. Hugging Face's assisted generation (the same weights,
drafting exactly k tokens) is timed the same way against HF's plain greedy generate.

The prediction uses Leviathan et al.'s formula with two measured costs: c (draft step / target
step) and v(k) (one target forward over k + 1 tokens / one target step; the paper assumes 1, which
holds on a memory-bound GPU but not for a CPU).
"""

import os

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import current
from labkit.quality import heldout
from labkit.testing import hf_from_labkit


def step_costs(target, draft, ks: list[int], context: int = 96, repeats: int = 30) -> dict[str, float]:
    """Median seconds of one cached forward after `context` tokens: the draft over 1 new token
    ("draft"), the target over n = 1 and every k + 1 ("target<n>"), all timed interleaved."""
    steps = {"draft": bench.decode_step(draft, context)}
    steps |= {f"target{n}": bench.decode_step(target, context, n) for n in sorted({1, *(k + 1 for k in ks)})}
    return {name: t.median for name, t in bench.interleaved(steps, repeats, warmup=3).items()}


def hf_generate(hf_target, prompt: list[int], n: int, assistant=None, k: int = 0) -> list[int]:
    """HF greedy generate of exactly n tokens; with an assistant, drafting exactly k per round."""
    extra = {}
    if assistant is not None:
        extra = dict(
            assistant_model=assistant,
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
    out = hf_target.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **extra
    )
    return out[0, len(prompt) :].tolist()


def refuse_real_without_draft() -> None:
    """MODEL=real with the default (tiny) draft would pair two tokenizers; say what to run instead."""
    if os.environ.get("MODEL") == "real" and not os.environ.get("DRAFT"):
        raise SystemExit(
            "MODEL=real needs a draft with its tokenizer, and the tiny draft has another: run "
            "`make bench STAGE=06_real` (SmolLM2 drafted by its own first layers), or pass DRAFT=<folder> "
            "(python -m labkit.early_exit writes one)."
        )


@torch.inference_mode()
def plain_floor(target, prompts: list[list[int]], new: int) -> float:
    """The floor of plain decoding: each prompt's prefill FLOPs (the LM head at its last position), then each
    token's bytes (weights + cache)."""
    return sum(floors.floor_s(flops=floors.forward_flops(target, len(p), logits=1))
               + sum(floors.floor_s(bytes=floors.decode_bytes(target, len(p) + i)) for i in range(new))
               for p in prompts)  # fmt: skip


def at_k(k, spec, models, prompts, reference, new, repeats, warmup) -> tuple[list, tuple, tuple]:
    """Speculative decoding at k against plain decoding, the course's loop and HF's assisted generation alike:
    the course's SpecStats per prompt, then (plain, speculative, ratio) for each side."""
    target, draft, hf_target, hf_draft = models
    stats = []

    def check(out: list[int], ref: list[int], who: str) -> None:
        if out != ref:
            raise AssertionError(f"k={k}: {who} output differs from the target's greedy decoding")

    def ours():
        stats.clear()
        for p, ref in zip(prompts, reference, strict=True):
            out, s = spec.greedy_speculative(target, draft, p, new, k=k)
            check(out, ref, "speculative")
            stats.append(s)

    def hf_assisted():
        for p, ref in zip(prompts, reference, strict=True):
            check(hf_generate(hf_target, p, new, hf_draft, k), ref, "HF assisted")

    course = bench.compare(lambda: [target.generate(p, new, stop_at_eos=False) for p in prompts], ours, repeats, warmup)
    # HF's generate is slower per call; fewer repeats keep the run short (its ratio is context, not the claim)
    hf = bench.compare(
        lambda: [hf_generate(hf_target, p, new) for p in prompts], hf_assisted, max(1, repeats - 1), warmup
    )
    return stats, course, hf


def main(quick: bool = False) -> bench.Result:
    refuse_real_without_draft()
    spec, speedup = bench.stages("stage06_speculative", "speculative", "speedup")
    # Batch-1 decoding of a 6.6M-parameter model gains nothing from intra-op threads; on a shared
    # 2-core machine their spin-waiting only adds noise. Both sides run on one thread.
    pin_threads(1)
    ks, n_prompts, new, repeats = ([2, 4], 1, 48, 1) if quick else ([1, 2, 3, 4, 6, 8], 2, 96, 3)
    (target, which), (draft, which_draft) = bench.model(), bench.model("DRAFT")
    prompts = [w[:64].tolist() for w in heldout(bench.tokenizer(), n_tokens=512 * n_prompts, seq=512)]
    hf_target, hf_draft = hf_from_labkit(target), hf_from_labkit(draft)
    for hf in (hf_target, hf_draft):  # decode a fixed number of tokens, as the labkit side does
        hf.config.eos_token_id = hf.generation_config.eos_token_id = 10**6
    reference = [target.generate(p, new, stop_at_eos=False) for p in prompts]

    costs = step_costs(target, draft, ks)
    t_step = costs["target1"]
    c = costs["draft"] / t_step
    rows = []
    for k in ks:
        models = (target, draft, hf_target, hf_draft)
        stats, (base, cand, ratio), (hf_base, hf_cand, hf_ratio) = at_k(
            k, spec, models, prompts, reference, new, repeats, 0 if rows else 1
        )
        floor = plain_floor(target, prompts, new)
        rows.append(_row(k, stats, costs, speedup) | {"plain_s": base.median, "spec_s": cand.median, "speedup": ratio,
                     "hf_plain_s": hf_base.median, "hf_assist_s": hf_cand.median, "hf_speedup": hf_ratio,
                     "plain floor s": round(floor, 4), "plain vs floor": round(base.median / floor, 2),
                     "spec vs plain floor": round(cand.median / floor, 2)})  # fmt: skip
    best = max(rows, key=lambda r: r["speedup"])
    title = (
        f"stage 06: greedy speculative decoding, target {which}, draft {which_draft}, {len(prompts)} prompts x "
        f"{new} tokens, impl={current()}, median of {repeats}; c = {c:.3f}, target step {t_step * 1e3:.2f} ms"
    )
    bench.show(rows, title)
    print(f"best: k={best['k']} {best['speedup']:.2f}x (HF assisted at that k: {best['hf_speedup']:.2f}x), same output")
    figures = {"target": which, "draft": which_draft, "prompts": len(prompts), "new_tokens": new,
               "repeats": repeats, "draft_cost_ratio_c": c, "target_step_s": t_step, "best_k": best["k"],
               "target_step_vs_floor": round(t_step / floors.floor_s(bytes=floors.weight_bytes(target)), 2),
               "best_speedup": best["speedup"]}  # fmt: skip
    return bench.Result(rows, figures, _plot(rows, c))


def _row(k: int, stats: list, costs: dict[str, float], speedup) -> dict:
    """Acceptance figures of one k's runs next to Leviathan et al.'s predictions from measured α, c, v(k)."""
    accepted = sum(s.accepted for s in stats)
    alpha = accepted / (accepted + sum(s.rejected for s in stats))
    c, v = costs["draft"] / costs["target1"], costs[f"target{k + 1}"] / costs["target1"]
    tokens = speedup.expected_tokens_per_step(alpha, k)
    return {
        "k": k,
        "accept_rate": accepted / sum(s.proposed for s in stats),
        "alpha": alpha,
        "tok_per_fwd": sum(s.generated for s in stats) / sum(s.target_forwards for s in stats),
        "formula_tok": tokens,
        "verify_cost_v": v,
        "predicted": tokens / (k * c + v),
        "paper_pred": speedup.expected_speedup(alpha, k, c),
    }


def _plot(rows: list[dict], c: float):
    """Left: measured and predicted speed-ups per k; right: tokens per target forward and v(k)."""
    plt = plot.setup()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["k"] for r in rows]
    ax1.plot(x, [r["speedup"] for r in rows], "o-", label="ours, measured")
    ax1.plot(x, [r["predicted"] for r in rows], "--", label="formula with measured α, c, v(k)")
    ax1.plot(x, [r["paper_pred"] for r in rows], ":", label="formula assuming v = 1 (GPU)")
    ax1.plot(x, [r["hf_speedup"] for r in rows], "s-", label="HF assisted generation, measured")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xlabel="k (drafted tokens per round)", ylabel="speedup over plain greedy", title="wall clock")
    ax1.legend()
    ax2.plot(x, [r["tok_per_fwd"] for r in rows], "o-", label="tokens per target forward")
    ax2.plot(x, [r["formula_tok"] for r in rows], "--", label="(1 − α^(k+1)) / (1 − α)")
    ax2.plot(x, [r["verify_cost_v"] for r in rows], "^-", label="v(k): cost of verifying k + 1 tokens")
    ax2.set(xlabel="k", title=f"acceptance α ≈ {sum(r['alpha'] for r in rows) / len(rows):.2f}, c = {c:.2f}")
    ax2.legend()
    return fig
