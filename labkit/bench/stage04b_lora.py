"""Stage 04 part 2 benchmark (multi-LoRA): one mixed batch vs serving each adapter's requests apart.

    LABS_IMPL=solution python -m labkit.bench 04b_lora [--quick]

A seeded workload on the tiny target: 32 requests, all arriving at once, EOS ignored, concurrency 16,
spread evenly over N adapters: the course's three (labkit/assets/lora), then N = 1, 4, 8, 16 random
rank-8 adapters on all linear layers (written to a temporary folder), as N tenants would be:
- mixed batch: one LoRAEngine, every adapter in its own slot, requests of all adapters in one batch;
- per-adapter merged: for each adapter, a model with scaling * B A added to its weights, serving that
  adapter's requests (max_num_seqs=16), the adapters one after another;
- base model: the same requests without any adapter (what LoRA costs).
Then the memory of the base model plus N adapters against N merged models.
"""

import copy
import json
import random
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from labkit import LORA, bench, plot
from labkit.bench import floors
from labkit.bench.stage04 import workload_floor
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


def random_adapters(folder: Path, config, n: int) -> dict[str, Path]:
    """n rank-8 adapters on all seven linear layers with random weights, in PEFT's format (the
    weights do not change the timing; the course ships only three real ones)."""
    shapes = load("stage04_batching.lora").module_shapes(config)
    g = torch.Generator().manual_seed(0)
    paths = {}
    for i in range(n):
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (d_out, d_in) in shapes.items():
                part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(8, d_in, generator=g) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, 8, generator=g) * 0.02
        paths[f"t{i}"] = folder / f"t{i}"
        paths[f"t{i}"].mkdir(parents=True)
        save_file(tensors, paths[f"t{i}"] / "adapter_model.safetensors")
        config_json = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(shapes)}
        (paths[f"t{i}"] / "adapter_config.json").write_text(json.dumps(config_json))
    return paths


def variants(mods, base, setups, prompts, max_tokens, c) -> dict:
    """(adapters, variant) -> a closure serving every request: the base model alone, then per setup one mixed
    batch through LoRA slots and each adapter's requests apart through its own merged model."""
    engine_mod, lora_mod, lora_engine, sequence = mods
    n = len(prompts)

    def params(i, lora):
        return sequence.SamplingParams(max_tokens=max_tokens[i], ignore_eos=True, lora=lora)

    def serve_base():
        engine_mod.LLMEngine(base, num_blocks=1024, max_num_seqs=c).generate(
            prompts, [params(i, None) for i in range(n)]
        )

    fns = {("none", "base model only"): serve_base}
    for label, paths in setups.items():
        names = sorted(paths)
        loras = [names[i % len(names)] for i in range(n)]
        registry = lora_mod.AdapterRegistry(base.config, paths, max_loras=len(names), max_rank=8)
        mixed = lora_engine.LoRAEngine(copy.deepcopy(base), None, registry, num_blocks=1024, max_num_seqs=c)
        merged = {m: merged_model(lora_mod, base, paths[m]) for m in names}

        def serve_mixed(mixed=mixed, loras=loras):
            mixed.generate(prompts, [params(i, loras[i]) for i in range(n)])

        def serve_apart(merged=merged, loras=loras):
            for m, model in merged.items():
                idx = [i for i in range(n) if loras[i] == m]
                engine = engine_mod.LLMEngine(model, num_blocks=1024, max_num_seqs=c)
                engine.generate([prompts[i] for i in idx], [params(i, None) for i in idx])

        fns[label, "mixed batch (LoRA slots)"] = serve_mixed
        fns[label, "per-adapter merged, apart"] = serve_apart
    return fns


def floor(base, prompts, max_tokens, c, adapters: dict, variant: str) -> dict:
    """The base model's work in the run (adapters' FLOPs and bytes left out): a mixed batch steps all
    requests together, c at a time; served apart, each adapter's requests make their own steps."""
    if variant != "per-adapter merged, apart":
        return workload_floor(base, prompts, max_tokens, c)
    names, n = sorted(adapters), len(prompts)
    groups = [[i for i in range(n) if names[i % len(names)] == m] for m in names]
    steps = sum(sum(max_tokens[i] for i in g) / min(len(g), c) for g in groups if g)
    return {**workload_floor(base, prompts, max_tokens, c), "bytes": steps * floors.weight_bytes(base)}


def ratios_of(tps: dict, setups: dict) -> dict:
    """Per setup: the mixed batch's throughput over serving apart, and over the base model alone."""
    ratios = {
        f"mixed_vs_apart_{label}": tps[label, "mixed batch (LoRA slots)"] / tps[label, "per-adapter merged, apart"]
        for label in setups
    }
    ratios.update(
        {
            f"mixed_vs_base_{label}": tps[label, "mixed batch (LoRA slots)"] / tps["none", "base model only"]
            for label in setups
        }
    )
    return ratios


def memory_rows(lora_mod, base, setups: dict) -> list[dict]:
    """Per setup: the base model and its adapters against one merged model per adapter (float32)."""
    base_bytes = sum(p.nbytes for p in base.parameters())
    memory = []
    for label, paths in setups.items():
        adapters = sum(
            t.nbytes for p in paths.values() for ab in lora_mod.read_adapter(p, base.config, 64)[1].values() for t in ab
        )
        memory.append(
            {
                "adapters": label,
                "base_plus_adapters_mb": (base_bytes + adapters) / 2**20,
                "merged_models_mb": len(paths) * base_bytes / 2**20,
                "merged_over_adapters": len(paths) * base_bytes / (base_bytes + adapters),
            }
        )
    bench.show(memory, f"Memory (float32; the base model is {base_bytes / 2**20:.1f} MB)")
    return memory


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # the tiny model's matrices are too small for threads to pay off
    mods = bench.stages("stage04_batching", "engine", "lora", "lora_engine", "sequence")
    base, which = bench.model()
    n, c = (16 if quick else 32), 16
    rng = random.Random(0)
    V = base.config.vocab_size
    prompts = [[1] + [rng.randrange(3, V) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    max_tokens = [rng.randint(8, 16) if quick else rng.randint(16, 32) for _ in range(n)]
    total = sum(max_tokens)

    tmp = tempfile.TemporaryDirectory()
    course = {p.name: p for p in sorted(LORA.iterdir())}
    setups = {"course (3)": course}
    for k in [4, 16] if quick else [1, 4, 8, 16]:
        setups[f"random ({k})"] = random_adapters(Path(tmp.name) / str(k), base.config, k)
    fns = variants(mods, base, setups, prompts, max_tokens, c)
    timings = bench.interleaved(fns, repeats=1 if quick else 3)
    rows = [
        {"adapters": label, "variant": variant, "concurrency": c, "tokens_per_s": total / t.median,
         **floors.row(t.median, **floor(base, prompts, max_tokens, c, setups.get(label, {}), variant), name="workload")}
        for (label, variant), t in timings.items()
    ]  # fmt: skip
    tps = {(r["adapters"], r["variant"]): r["tokens_per_s"] for r in rows}
    ratios = ratios_of(tps, setups)
    bench.show(rows, f"{which}: {n} requests spread evenly over the adapters, {total} output tokens")
    bench.show([{k: round(v, 3) for k, v in ratios.items()}], "Throughput ratios at concurrency 16")
    memory = memory_rows(mods[1], base, setups)
    tmp.cleanup()
    return bench.Result(rows, {"model": which, "ratios": ratios, "memory": memory}, _plot(setups, tps, memory, c))


def _plot(setups, tps, memory, c):
    plt = plot.setup()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = list(setups)
    for variant in ("mixed batch (LoRA slots)", "per-adapter merged, apart"):
        left.plot(labels, [tps[label, variant] for label in labels], marker="o", label=variant)
    left.axhline(tps["none", "base model only"], color="grey", ls=":", label="base model only")
    left.set(xlabel="adapters the requests spread over", ylabel="output tokens / s", title=f"concurrency {c}")
    left.legend()
    right.plot(labels, [m["base_plus_adapters_mb"] for m in memory], marker="o", label="base + adapters")
    right.plot(labels, [m["merged_models_mb"] for m in memory], marker="o", label="one merged model each")
    right.set(xlabel="adapters", ylabel="MB (float32)", title="memory")
    right.legend()
    fig.tight_layout()
    return fig
