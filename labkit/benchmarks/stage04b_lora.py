"""Stage 04 part 2 benchmark (multi-LoRA): one mixed batch vs serving each adapter's requests apart.

    LABS_IMPL=solution python -m labkit.bench 04b_lora [--quick]

A seeded workload on the tiny target, requests spread over the course's adapters (labkit/assets/lora),
all arriving at once, EOS ignored, concurrency 16:
- mixed batch: one LoRAEngine, every adapter in its own slot, requests of all adapters in one batch;
- per-adapter merged: for each adapter, a model with scaling * B A added to its weights, serving that
  adapter's requests (max_num_seqs=16), the adapters one after another;
- base model: the same requests without any adapter (the cost LoRA adds).
Then the memory of the base model plus N adapters against N merged models.
"""

import copy
import random

import torch

from labkit import LORA, bench, plot
from labkit.device import pin_threads
from labkit.impl import load


def merged_model(lora_mod, base, folder):
    """A copy of `base` with the adapter's scaling * B @ A added to every weight it adapts."""
    model = copy.deepcopy(base)
    scaling, weights = lora_mod.read_adapter(folder, base.config, max_rank=64)
    with torch.no_grad():
        for (layer, module), (a, b) in weights.items():
            block = model.model.layers[layer]
            linear = getattr(block.self_attn if hasattr(block.self_attn, module) else block.mlp, module)
            linear.weight += scaling * b @ a
    return model


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # the tiny model's matrices are too small for threads to pay off
    engine_mod = load("stage04_batching.engine")
    lora_mod = load("stage04_batching.lora")
    lora_engine = load("stage04_batching.lora_engine")
    sequence = load("stage04_batching.sequence")
    base, which = bench.model()
    names = sorted(p.name for p in LORA.iterdir())
    n, c = (24 if quick else 48), 16
    rng = random.Random(0)
    V = base.config.vocab_size
    prompts = [[1] + [rng.randrange(3, V) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    max_tokens = [rng.randint(8, 24) if quick else rng.randint(16, 48) for _ in range(n)]
    loras = [names[i % len(names)] for i in range(n)]
    total = sum(max_tokens)

    def params(i, lora):
        return sequence.SamplingParams(max_tokens=max_tokens[i], ignore_eos=True, lora=lora)

    registry = lora_mod.AdapterRegistry(base.config, {m: LORA / m for m in names}, max_loras=len(names))
    mixed = lora_engine.LoRAEngine(copy.deepcopy(base), None, registry, num_blocks=1024, max_num_seqs=c)
    merged = {m: merged_model(lora_mod, base, LORA / m) for m in names}

    def serve_mixed():
        mixed.generate(prompts, [params(i, loras[i]) for i in range(n)])

    def serve_apart():
        for m in names:
            idx = [i for i in range(n) if loras[i] == m]
            engine = engine_mod.LLMEngine(merged[m], num_blocks=1024, max_num_seqs=c)
            engine.generate([prompts[i] for i in idx], [params(i, None) for i in idx])

    def serve_base():
        engine = engine_mod.LLMEngine(base, num_blocks=1024, max_num_seqs=c)
        engine.generate(prompts, [params(i, None) for i in range(n)])

    timings = bench.interleaved(
        {
            "mixed batch (LoRA slots)": serve_mixed,
            "per-adapter merged, apart": serve_apart,
            "base model only": serve_base,
        },
        repeats=1 if quick else 3,
    )
    rows = [
        {"variant": k, "concurrency": c, "seconds": t.median, "tokens_per_s": total / t.median}
        for k, t in timings.items()
    ]
    tps = {r["variant"]: r["tokens_per_s"] for r in rows}
    ratios = {
        "mixed_vs_apart_at_16": tps["mixed batch (LoRA slots)"] / tps["per-adapter merged, apart"],
        "mixed_vs_base_at_16": tps["mixed batch (LoRA slots)"] / tps["base model only"],
    }
    print(bench.table(rows, f"{which}: {n} requests over adapters {names}, {total} output tokens"))
    print(bench.table([ratios], "Throughput ratios at concurrency 16"))

    base_bytes = sum(p.nbytes for p in base.parameters())
    adapter_bytes = {m: sum(t.nbytes for ab in lora_mod.read_adapter(LORA / m, base.config, 64)[1].values() for t in ab) for m in names}  # fmt: skip
    memory = {
        "base_model_mb": base_bytes / 2**20,
        "adapters_mb": {m: b / 2**20 for m, b in adapter_bytes.items()},
        "base_plus_adapters_mb": (base_bytes + sum(adapter_bytes.values())) / 2**20,
        "merged_models_mb": len(names) * base_bytes / 2**20,
        "registry_slots_mb": registry.nbytes() / 2**20,
    }
    memory["merged_over_adapters"] = memory["merged_models_mb"] / memory["base_plus_adapters_mb"]
    print(bench.table([{k: v for k, v in memory.items() if k != "adapters_mb"}], "Memory (float32)"))

    plt = plot.setup()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.barh(list(tps), list(tps.values()))
    left.set(xlabel="output tokens / s", title=f"concurrency {c}, {len(names)} adapters")
    right.bar(["base + adapters", "merged models"], [memory["base_plus_adapters_mb"], memory["merged_models_mb"]])
    right.set(ylabel="MB (float32)", title=f"memory for {len(names)} adapters")
    fig.tight_layout()
    return bench.Result(rows, {"model": which, "adapters": names, "ratios": ratios, "memory": memory}, fig)
