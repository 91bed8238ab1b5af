"""Stage 06 on the real model: SmolLM2-135M-Instruct drafted by its own first layers (labkit.early_exit).

    make bench STAGE=06_real          (needs make setup; LABS_IMPL=solution, IMPL=student times your code)

Batch 1, greedy, two chat prompts (a question, and a spelling fix whose answer copies its prompt),
a fixed number of new tokens. Every variant below must return the target's own greedy tokens, and
all are timed interleaved in one run as medians of repeats, against plain greedy decoding on the
same stack (labkit.model.Llama.generate for the course's rows, HF's generate for HF's):

- the course's greedy_speculative with early-exit drafts of several depths (layers) and k;
- the course's prompt lookup (lookup_decode), no draft model;
- HF's assisted generation with the same early-exit draft, as a folder (`assistant_model=`);
- HF's prompt lookup (`prompt_lookup_num_tokens`).

alpha is the per-token acceptance (accepted / (accepted + rejected rounds)), the figure Leviathan
et al.'s speedup formula takes; acceptance is accepted / proposed.
"""

import torch
from transformers import AutoModelForCausalLM

from labkit import bench, early_exit, plot
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.impl import current
from labkit.testing import real_hf, real_labkit

from .stage06 import hf_generate, plain_floor

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France, and what is it famous for?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nFix the spelling in this sentence: The key-value cache keeps the keys and valeus of every "
    "past tokne, so that each new tokne costs one matrix-vector product per weight.<|im_end|>\n<|im_start|>assistant\n",
]


def hf_lookup(hf_target, prompt: list[int], n: int, k: int) -> list[int]:
    """HF's prompt lookup decoding: up to k tokens copied per round from an earlier match of up to 3 tokens."""
    out = hf_target.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
        prompt_lookup_num_tokens=k, max_matching_ngram_size=3,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def checked(name: str, decode, prompts, reference, stats: dict):
    """A timed variant: decode(prompt) -> tokens or (tokens, SpecStats); checks the tokens, keeps the stats."""

    def fn():
        stats[name] = []
        for p, ref in zip(prompts, reference, strict=True):
            out = decode(p)
            if isinstance(out, tuple):
                out, s = out
                stats[name].append(s)
            if out != ref:
                raise AssertionError(f"{name}: the output differs from the target's greedy decoding")

    return fn


def rows_of(times: dict, stats: dict, floor: float) -> list[dict]:
    """A row a variant: its time, its speedup over plain decoding on its own side (HF's or the course's), against
    plain decoding's floor, and what the course's own loops accepted (HF's generate does not report it)."""
    rows = []
    for name, t in times.items():
        base = times["hf plain" if name.startswith("hf") else "plain"].median
        s = stats[name]
        row = {"variant": name, "seconds": t.median, "speedup": base / t.median, "alpha": None, "accept_rate": None,
               "tok_per_fwd": None, "vs plain decoding's floor": round(t.median / floor, 2)}  # fmt: skip
        if s:
            accepted, rejected = sum(x.accepted for x in s), sum(x.rejected for x in s)
            row |= {"alpha": accepted / max(accepted + rejected, 1),
                    "accept_rate": accepted / max(sum(x.proposed for x in s), 1),
                    "tok_per_fwd": sum(x.generated for x in s) / sum(x.target_forwards for x in s)}  # fmt: skip
        rows.append(row)
    return rows


def main(quick: bool = False) -> bench.Result:
    spec, lookup = bench.stages("stage06_speculative", "speculative", "prompt_lookup")
    pin_threads(1)  # as every benchmark: one thread, so other work on a 2-core machine disturbs it least
    # (layers, k) of the course's rows; HF's assisted generation runs the default draft at its k
    runs, new, repeats = ([(early_exit.LAYERS, 1)], 16, 1) if quick else ([(8, 1), (16, 1), (24, 1), (24, 2)], 32, 3)
    depth, k_hf = early_exit.LAYERS, 1
    folder = require_real_model()
    target, hf_target = real_labkit(), real_hf()
    hf_target.config.eos_token_id = hf_target.generation_config.eos_token_id = 10**6  # fixed-length answers
    tok = load_tokenizer(folder)
    prompts = [tok.encode(p).ids for p in PROMPTS]
    reference = [target.generate(p, new, stop_at_eos=False) for p in prompts]
    drafts = {n: early_exit.early_exit(target, n) for n, _ in runs}
    hf_draft = AutoModelForCausalLM.from_pretrained(early_exit.real_draft_folder(depth), dtype=torch.float32)
    hf_draft.eval().generation_config.eos_token_id = 10**6

    decoders = {
        "plain": lambda p: target.generate(p, new, stop_at_eos=False),
        "hf plain": lambda p: hf_generate(hf_target, p, new),
    }
    for n, k in runs:
        decoders[f"early exit {n}, k={k}"] = lambda p, n=n, k=k: spec.greedy_speculative(target, drafts[n], p, new, k=k)
    decoders[f"hf assisted, early exit {depth}, k={k_hf}"] = lambda p: hf_generate(hf_target, p, new, hf_draft, k_hf)
    decoders["prompt lookup, k=4"] = lambda p: lookup.lookup_decode(target, p, new, k=4)
    decoders["hf prompt lookup, k=4"] = lambda p: hf_lookup(hf_target, p, new, 4)

    stats: dict[str, list] = {}
    fns = {name: checked(name, d, prompts, reference, stats) for name, d in decoders.items()}
    times = bench.interleaved(fns, repeats, warmup=0)
    floor = plain_floor(target, prompts, new)
    rows = rows_of(times, stats, floor)
    title = (
        f"stage 06 on the real model: SmolLM2-135M-Instruct, early-exit drafts, {len(prompts)} prompts x {new} "
        f"tokens, impl={current()}, median of {repeats}; every row gives the target's greedy tokens"
    )
    bench.show([{k: ("-" if v is None else v) for k, v in r.items()} for r in rows], title)
    ours = [r for r in rows if r["variant"].startswith("early exit")]
    best = max(ours, key=lambda r: r["speedup"])
    figures = {"target": folder.name, "prompts": len(prompts), "new_tokens": new, "repeats": repeats,
               "draft_layers": depth, "best": best["variant"], "best_speedup": best["speedup"],
               "plain_floor_s": round(floor, 4)}  # fmt: skip
    return bench.Result(rows, figures, _plot(rows))


def _plot(rows: list[dict]):
    """Speedup of each variant over plain greedy decoding on its own stack."""
    plt = plot.setup()
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["variant"] for r in rows]
    ax.barh(names, [r["speedup"] for r in rows], color=["C1" if n.startswith("hf") else "C0" for n in names])
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.invert_yaxis()
    ax.set(xlabel="speedup over plain greedy decoding (same stack)", title="SmolLM2-135M, batch 1, greedy, 1 thread")
    return fig
