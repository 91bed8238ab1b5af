"""Stage 07 part 4 benchmark (lab 8): what a MoE layer costs, and what a real router's load looks like.

    make bench STAGE=07d            (LABS_IMPL=solution; IMPL=student runs your routing and grouped experts)

(a) One MoE layer (Qwen3-MoE's routing, E = 16 experts of D = 512 -> I = 256, k = 2) on N tokens: the
    per-token loop, grouped execution, the dense form (every expert on every token) and the anchor,
    transformers' Qwen3MoeSparseMoeBlock with the same weights. The floor counts what routing makes
    necessary: the bytes of the experts the batch touches (read once) or the routed pairs' FLOPs, whichever
    is slower on this machine.
(b) SmolLM2-135M MoEfied into E = 8 experts a layer (routers fitted on the course's training chat prompts):
    k = E against the dense model (logits), perplexity on the held-out stories against k, the per-expert load
    of every layer at k = 2 on held-out chat prompts, and the share of (token, expert) pairs a capacity factor
    drops at k = 2, beside the share a uniformly random router of the same shape would drop.
"""

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from labkit import bench, plot, quality
from labkit.bench import floors
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.impl import load
from labkit.model import from_pretrained

E, K, D, I = 16, 2, 512, 256
FACTORS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]


def hf_block(seed: int = 0) -> torch.nn.Module:
    config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * D**-0.5)
    return block


@torch.no_grad()
def layer_rows(tokens: list[int], repeats: int) -> list[dict]:
    mod = load("stage07_tensor_parallel.moe.block")
    hf = hf_block()
    block = mod.MoEBlock.from_hf(hf)
    rows = []
    for n in tokens:
        x = torch.randn(1, n, D, generator=torch.Generator().manual_seed(n))
        _, idx = block.route(x[0])
        touched = int(idx.unique().numel())
        variants = {
            "loop": lambda x=x: block(x, experts=mod.loop_experts),
            "grouped": lambda x=x: block(x),
            "dense": lambda x=x: block(x, experts=mod.dense_experts),
            "hf Qwen3MoeSparseMoeBlock": lambda x=x: hf(x),
        }
        want = hf(x)
        for name, fn in variants.items():
            if (fn() - want).abs().max() > 1e-4:
                raise AssertionError(f"{name} at N={n} differs from transformers' block")
        timings = bench.interleaved(variants, repeats=repeats)
        for name, t in timings.items():
            rows.append({
                "part": "layer", "tokens": n, "variant": name, "experts_touched": touched, "ms": t.median * 1e3,
                # the touched experts' weights read once, or the routed pairs' multiply-adds
                **floors.row(t.median, bytes=touched * 3 * D * I * 4, flops=n * K * 6 * D * I),
            })  # fmt: skip
    return rows


@torch.no_grad()
def moefied_smollm2(ks: list[int], n_tokens: int, prompts: int) -> dict:
    moefy = load("stage07_tensor_parallel.moe.moefy")
    folder = require_real_model()
    tok = load_tokenizer(folder)
    dense = from_pretrained(folder).eval()
    windows = quality.heldout(tok, n_tokens=n_tokens, seq=256)
    dense_logits, dense_ppl = dense(windows[:1]), quality.perplexity(dense, windows)
    model = moefy.moefy(from_pretrained(folder).eval(), 8, moefy.chat_ids(tok, prompts))
    out = {
        "dense_perplexity": dense_ppl,
        "k_equals_E_max_abs_logit_diff": float((model(windows[:1]) - dense_logits).abs().max()),
    }
    out["perplexity_by_k"] = {}
    for k in ks:
        moefy.set_k(model, k)
        out["perplexity_by_k"][k] = quality.perplexity(model, windows)
    moefy.set_k(model, 2)
    traffic = moefy.chat_ids(tok, prompts, heldout=True)
    model(traffic)
    layers = model.model.layers
    out["load_k2"] = [layer.mlp.load.tolist() for layer in layers]  # (layers, E) tokens per expert
    n = traffic.shape[1]
    ep = load("stage07_tensor_parallel.moe.expert_parallel")
    g = torch.Generator().manual_seed(0)
    uniform = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
    out["drop_rate_k2"] = {
        cf: {
            "moefied": sum(moefy.drop_rate(layer.mlp.last_idx, 8, ep.capacity(n, 2, 8, cf)) for layer in layers) / len(layers),
            "uniform_router": moefy.drop_rate(uniform, 8, ep.capacity(n, 2, 8, cf)),
        }
        for cf in FACTORS
    }  # fmt: skip
    out["traffic_tokens"] = n
    return out


def figure(rows: list[dict], real: dict):
    plt = plot.setup()
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ax[0, 0].plot([r["tokens"] for r in mine], [r["ms"] for r in mine], "o-", label=name)
    grouped = [r for r in rows if r["variant"] == "grouped"]
    ax[0, 0].plot([r["tokens"] for r in grouped], [r["floor ms"] for r in grouped], "k--", label="floor")
    ax[0, 0].set(xscale="log", yscale="log", xlabel="tokens N", ylabel="ms per MoE layer",
                 title=f"one layer, E={E}, k={K}, D={D}, I={I}")  # fmt: skip
    ax[0, 0].legend()
    ks = sorted(real["perplexity_by_k"])
    ax[0, 1].plot(ks, [real["perplexity_by_k"][k] for k in ks], "o-", label="MoEfied")
    ax[0, 1].axhline(real["dense_perplexity"], color="k", ls="--", label="dense SmolLM2")
    ax[0, 1].set(xlabel="experts a token (k of 8)", ylabel="held-out perplexity", yscale="log", title="MoEfied SmolLM2")
    ax[0, 1].legend()
    load_ = torch.tensor(real["load_k2"], dtype=torch.float)
    im = ax[1, 0].imshow(load_ / load_.mean(1, keepdim=True), aspect="auto", cmap="magma")
    ax[1, 0].set(xlabel="expert", ylabel="layer", title="load at k=2 / balanced share (held-out chat prompts)")
    fig.colorbar(im, ax=ax[1, 0])
    for key in ("moefied", "uniform_router"):
        ax[1, 1].plot(FACTORS, [real["drop_rate_k2"][cf][key] * 100 for cf in FACTORS], "o-", label=key)
    ax[1, 1].set(xlabel="capacity factor", ylabel="% of pairs dropped", title="drops at k=2")
    ax[1, 1].legend()
    fig.tight_layout()
    return fig


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # as every benchmark: one thread, so other work on a 2-core machine disturbs it least
    tokens, repeats = ([1, 64], 3) if quick else ([1, 8, 64, 256], 5)
    rows = layer_rows(tokens, repeats)
    print(bench.table(rows, "one MoE layer"))
    real = moefied_smollm2([8, 2, 1] if quick else [8, 6, 4, 3, 2, 1], 1024 if quick else 2048, 16 if quick else 32)
    print({k: round(v, 3) for k, v in real["perplexity_by_k"].items()}, "dense", round(real["dense_perplexity"], 3))
    return bench.Result(rows, {"moefied_smollm2": real}, figure(rows, real))
