"""Stage 02 part 2 benchmark: MLA's cache and decode time, and eviction quality past the context.

    make bench STAGE=02b [QUICK=1]     (IMPL=solution for the answer key)

A. One random-init model shape (8 heads, hidden 256, 4 layers), three attentions: MLA decoding
   with absorbed weights, the same MLA expanding per-head K/V every step, and GQA (2 KV heads,
   stage 02's cached Llama). The cache is filled to each context length with random values
   (decode time does not depend on them), then one decode step is timed (median of repeats); the
   absorbed and expanded logits are compared, to show the speed comes at equal output.
B. The trained tiny target ($MODEL if set) on held-out stories longer than its 1,024-token context,
   fed one token at a time through a fixed-budget cache: window only, 4 sinks + window, H2O; and a
   cache that keeps everything (the plain causal forward pass). Perplexity per 128-token segment,
   and the share of attention position 0 receives in each layer: a model without attention sinks
   (the tiny target) has nothing for window-only eviction to lose. stage02b_sinks.py runs this
   part on SmolLM2, which has them.
"""

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from labkit import bench, corpus, plot
from labkit.bench import floors
from labkit.device import pin_threads
from labkit.impl import current, load
from labkit.model import Config, Llama, init_weights
from labkit.quality import pack

HIDDEN, HEADS, LAYERS = 256, 8, 4
SEGMENT = 128  # tokens per perplexity point


def mla_model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=2048,
        hidden_size=HIDDEN,
        intermediate_size=768,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=None,
        kv_lora_rank=128,  # DeepSeek-V3's ratios: r = 4 head_dims, rope key = head_dim / 2
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=LAYERS,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


def decode_times(contexts, repeats) -> tuple[list[dict], dict]:
    mla, cached_llama, kv_cache = (load(f"stage02_kv_cache.{m}") for m in ("mla", "cached_llama", "kv_cache"))
    deepseek = mla_model()
    gqa_config = Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS, num_key_value_heads=2)
    llama = init_weights(Llama(gqa_config)).eval()
    token = torch.tensor([[5]])
    rows = []
    for S in contexts:
        latent = mla.MLACache(deepseek.config, 1, S + 1)
        gqa = kv_cache.KVCache(gqa_config, 1, S + 1)
        for layer in latent.layers:
            layer.c_kv.normal_(), layer.k_pe.normal_()
            layer.length = S
        for layer in gqa.layers:
            layer.k.normal_(), layer.v.normal_()
            layer.length = S

        def step(cache, fn):
            length = cache.length
            out = fn()
            for layer in cache.layers:  # undo the step so every repeat decodes at context S
                layer.length = length
            return out

        # Equal quality: the two MLA forms compute the same logits (random weights, float32).
        absorbed = step(latent, lambda c=latent: mla.forward(deepseek, token, c, absorbed=True))
        expanded = step(latent, lambda c=latent: mla.forward(deepseek, token, c, absorbed=False))

        t_abs = bench.measure(lambda c=latent: step(c, lambda: mla.forward(deepseek, token, c, absorbed=True)), repeats)
        t_exp = bench.measure(
            lambda c=latent: step(c, lambda: mla.forward(deepseek, token, c, absorbed=False)), repeats
        )
        t_gqa = bench.measure(lambda c=gqa: step(c, lambda: cached_llama.forward(llama, token, c)), repeats)
        # floors: a step reads its weights once and its whole cache; both MLA forms read the same latent
        # cache (the expanded one then multiplies it out per head, work on top of the same bytes)
        dc = deepseek.config
        mla_bytes = (
            floors.weight_bytes(deepseek) + S * dc.num_hidden_layers * (dc.kv_lora_rank + dc.qk_rope_head_dim) * 4
        )
        rows.append(
            {
                "context": S,
                "mla_absorbed_ms": t_abs.median * 1e3,
                "mla_expanded_ms": t_exp.median * 1e3,
                "gqa_ms": t_gqa.median * 1e3,
                "expanded_over_absorbed": t_exp.median / t_abs.median,
                "logits_rel_diff": float((absorbed - expanded).abs().max() / expanded.abs().max()),
                **floors.row(t_abs.median, bytes=mla_bytes, name="mla_absorbed"),
                **floors.row(t_exp.median, bytes=mla_bytes, name="mla_expanded"),
                **floors.row(t_gqa.median, bytes=floors.decode_bytes(llama, S), name="gqa"),
            }
        )
    fp32 = 4
    bytes_per_token = {
        "MLA: latent c_kv + k_pe": mla.kv_bytes_per_token(deepseek.config, fp32),
        "MLA if it cached per-head K/V": mla.expanded_bytes_per_token(deepseek.config, fp32),
        "GQA: 2 KV heads": mla.kv_bytes_per_token(gqa_config, fp32),
        "MHA: 8 KV heads": mla.kv_bytes_per_token(replace(gqa_config, num_key_value_heads=HEADS), fp32),
    }
    return rows, bytes_per_token


@torch.no_grad()
def first_token_share(model, ids: torch.Tensor) -> list[float]:
    """Per layer, the share of attention that position 0 receives from the queries after the first 64.

    A model with attention sinks gives position 0 a large share; labkit's model attends with SDPA and
    returns no weights, so this reads q and k off each layer's projections and applies RoPE again."""
    from labkit.model import apply_rope, repeat_kv

    c, T = model.config, ids.shape[1]
    cos, sin = model.rope(0, T)
    captured = []
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, args, out: captured.append(args[0]))
        for layer in model.model.layers
    ]
    model(ids)
    for h in hooks:
        h.remove()
    shares = []
    for x, layer in zip(captured, model.model.layers, strict=True):
        attn = layer.self_attn
        q = attn.q_proj(x).view(1, T, -1, c.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, T, -1, c.head_dim).transpose(1, 2)
        q, k = attn.norm_qk(q, k)
        q, k = apply_rope(q, cos, sin), repeat_kv(apply_rope(k, cos, sin), q.shape[1] // k.shape[1])
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
        weights = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        shares.append(float(weights[0, :, 64:, 0].mean()))
    return shares


def eviction_perplexity(n_tokens: int, budget: int, model=None, label: str = "", tokenizer=None) -> dict:
    """Held-out stories through a `budget`-token cache under each policy, and through a full cache.
    model, label, tokenizer: default $MODEL's, else the tiny target (stage02b_sinks.py passes SmolLM2)."""
    sinks = load("stage02_kv_cache.sinks")
    if model is None:
        (model, label), tokenizer = bench.model(), bench.tokenizer()
    c = model.config
    bos = c.eos_token_id if c.bos_token_id is None else c.bos_token_id  # Qwen has no <s>: stories split on </s>
    ids = pack(tokenizer, corpus.valid_texts(), bos=bos, eos=c.eos_token_id)[: n_tokens + 1][None]
    print(f"eviction on {label}")
    policies = {
        "window only": sinks.SinkWindow(0),
        "4 sinks + window": sinks.SinkWindow(4),
        "H2O (half recent)": sinks.H2O(budget // 2),
    }
    out = {}
    for name, policy in policies.items():
        cache = sinks.StreamingCache(model.config, budget, policy)
        nll = F.cross_entropy(sinks.forward_streaming(model, ids[:, :-1], cache)[0], ids[0, 1:], reduction="none")
        out[name] = {"nll": nll, "cache_bytes": cache.nbytes}
        if name == "4 sinks + window":  # share of all attention (per head, per step) the 4 sinks received
            heads = model.config.num_attention_heads
            out[name]["sink_attention_share_per_layer"] = [
                float(layer.score[(layer.pos >= 0) & (layer.pos < 4)].sum()) / (heads * n_tokens)
                for layer in cache.layers
            ]
    # A cache that keeps everything evicts nothing and uses the original positions: that is the
    # plain causal forward pass, so it runs as one pass instead of token by token.
    with torch.no_grad():
        nll = F.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:], reduction="none")
    out["full cache"] = {
        "nll": nll,
        "cache_bytes": 2
        * model.config.num_hidden_layers
        * model.config.num_key_value_heads
        * model.config.head_dim
        * n_tokens
        * 4,
    }
    share = first_token_share(model, ids[:, : min(n_tokens, c.max_position_embeddings)])
    print("attention share of position 0 per layer (queries after the first 64):", [round(x, 4) for x in share])
    out["full cache"]["first_token_attention_share_per_layer"] = share
    for name, r in out.items():
        nll = r.pop("nll")
        r["perplexity"] = math.exp(nll.mean())
        r["segments"] = [math.exp(nll[a : a + SEGMENT].mean()) for a in range(0, n_tokens, SEGMENT)]
        print(
            f"{name:>18}: perplexity {r['perplexity']:.3f}, per {SEGMENT} tokens {[round(s, 2) for s in r['segments']]}"
        )
    return out | {"ids": ids}


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)
    contexts, repeats = ((64, 256), 3) if quick else ((256, 1024, 4096), 5)
    n_tokens, budget = (160, 32) if quick else (1152, 64)
    rows, bytes_per_token = decode_times(contexts, repeats)
    print(bench.table(rows, title=f"stage 02b: one decode step, impl={current()}, median of {repeats}"))
    for name, b in bytes_per_token.items():
        print(f"  {b:6d} B/token fp32  {name}")
    ppl = eviction_perplexity(n_tokens, budget)
    del ppl["ids"]
    figures = {
        "repeats": repeats,
        "kv_bytes_per_token_fp32": bytes_per_token,
        "eviction": {"n_tokens": n_tokens, "budget": budget, "segment": SEGMENT, "results": ppl},
    }

    plt = plot.setup()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ax1.barh(list(bytes_per_token), list(bytes_per_token.values()))
    ax1.set(xlabel="KV cache bytes per token (fp32)", title="cache size, same model width")
    x = [r["context"] for r in rows]
    for key, label in (("mla_absorbed_ms", "MLA absorbed"), ("mla_expanded_ms", "MLA expanded"), ("gqa_ms", "GQA")):
        ax2.plot(x, [r[key] for r in rows], "o-", label=label)
    ax2.set(xlabel="context (tokens)", ylabel="ms per decode step", xscale="log", yscale="log", title="decode time")
    ax2.set_xticks(x, [str(c) for c in x], minor=False)
    ax2.minorticks_off()
    ax2.legend()
    for label, r in ppl.items():
        ax3.plot([SEGMENT * (i + 0.5) for i in range(len(r["segments"]))], r["segments"], "o-", label=label)
    ax3.axvline(512, color="grey", ls=":", lw=1)  # the length the tiny target was trained on
    ax3.axvline(1024, color="grey", ls="--", lw=1)  # its max_position_embeddings
    ax3.set(
        xlabel="position in the text", ylabel=f"perplexity ({SEGMENT}-token segment)", title=f"budget {budget} tokens"
    )
    ax3.legend()
    return bench.Result(rows, figures, fig)
