"""Stage 02 part 2 on the course's real model (SmolLM2-135M-Instruct, `make setup`): attention sinks.

    make bench STAGE=02b_sinks [QUICK=1]     (MODEL=dir for another model; IMPL=student for your code)

A. The share of attention that position 0 receives in each layer, from queries after the first
   64 (read off each layer's q and k over one plain forward pass).
B. StreamingLLM's experiment: held-out stories longer than the cache, fed through a 64-token
   cache with window only, 4 sinks + window and H2O (half recent), and through a cache that keeps
   everything (the plain forward pass); perplexity per 128-token segment (stage02b.py's
   eviction_perplexity, which the tiny target runs in stage02b.json).
C. Why the streaming forward is layer-major: the same tokens through the same cache policy, in one
   call (each layer takes all of them, its attention walks them in order) against one call per
   token (every weight read once per token, as before the change), timed interleaved.
"""

import os

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.checkpoint import load_tokenizer, model_folder, require_real_model
from labkit.device import pin_threads
from labkit.impl import current, load
from labkit.model import from_pretrained

from .stage02b import SEGMENT, eviction_perplexity

BUDGET = 64


def streaming_speed(model, ids: torch.Tensor, repeats: int) -> dict:
    """Seconds to stream `ids` (1, T) through a fresh 4-sinks cache: one call, or one call per token."""
    sinks = load("stage02_kv_cache.sinks")

    def fresh():
        return sinks.StreamingCache(model.config, BUDGET, sinks.SinkWindow(4))

    def per_token():
        cache = fresh()
        return torch.cat([sinks.forward_streaming(model, ids[:, t : t + 1], cache) for t in range(ids.shape[1])], 1)

    one_call = sinks.forward_streaming(model, ids, fresh())
    same = float((one_call - per_token()).abs().max())
    by_token, by_layer, speedup = bench.compare(
        per_token, lambda: sinks.forward_streaming(model, ids, fresh()), repeats
    )
    # floors: one call per token reads every weight once per token (its small cache left out); one call
    # reads the weights once and is bound by its FLOPs: each token's matrices and attention to one key at
    # least (a lower bound: a token attends to up to BUDGET keys)
    T = ids.shape[1]
    return {
        "tokens": T,
        "per_token_s": by_token.median,
        "one_call_s": by_layer.median,
        "speedup": speedup,
        "max_logit_difference": same,
        **floors.row(by_token.median, bytes=T * floors.weight_bytes(model), name="per_token"),
        **floors.row(
            by_layer.median, bytes=floors.weight_bytes(model), flops=T * floors.forward_flops(model, 1), name="one_call"
        ),
    }


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)
    folder = model_folder() if os.environ.get("MODEL") else require_real_model()
    model = from_pretrained(folder).eval()
    label = f"{folder.name} ({model.num_params() / 1e6:.1f}M params)"
    n_tokens, repeats = (320, 1) if quick else (1152, 3)
    ppl = eviction_perplexity(n_tokens, BUDGET, model, label, load_tokenizer(folder))
    speed = streaming_speed(model, ppl.pop("ids")[:, : 64 + 32], repeats)
    print(
        f"streaming {speed['tokens']} tokens through a {BUDGET}-token cache, impl={current()}, median of {repeats}: "
        f"one call per token {speed['per_token_s']:.2f} s, one call {speed['one_call_s']:.2f} s "
        f"({speed['speedup']:.1f}x; logits differ by {speed['max_logit_difference']:.1e})"
    )
    rows = [
        {"cache": name, "perplexity": round(r["perplexity"], 3), "cache KiB": r["cache_bytes"] / 1024}
        for name, r in ppl.items()
    ]
    print(bench.table(rows, title=f"{label}: {n_tokens} held-out tokens, budget {BUDGET}"))
    figures = {"model": label, "repeats": repeats, "speed": speed,
               "eviction": {"n_tokens": n_tokens, "budget": BUDGET, "segment": SEGMENT, "results": ppl}}  # fmt: skip

    plt = plot.setup()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    share = ppl["full cache"]["first_token_attention_share_per_layer"]
    ax1.bar(range(len(share)), [100 * s for s in share])
    ax1.set(xlabel="layer", ylabel="% of attention on position 0", title="queries after the first 64, full cache")
    for name, r in ppl.items():
        ax2.plot([SEGMENT * (i + 0.5) for i in range(len(r["segments"]))], r["segments"], "o-", label=name)
    ax2.set(xlabel="position in the text", ylabel=f"perplexity ({SEGMENT}-token segment)", yscale="log",
            title=f"{folder.name}, cache of {BUDGET} tokens")  # fmt: skip
    ax2.legend()
    return bench.Result(rows, figures, fig)
