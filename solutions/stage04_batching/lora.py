"""Multi-LoRA serving: one base model, many adapters, one batch (Punica's BGMV, S-LoRA's adapter pool).

A LoRA adapter (Hu et al. 2021) changes a linear layer y = x W^T into y = x W^T + scaling (x A^T) B^T,
with A (r, d_in) and B (d_out, r) of a small rank r. Merging scaling B A into W gives one full model
per adapter; keeping them apart lets one batch carry rows of many adapters over the SAME base weights:
the base matmul is shared, and each token adds the small term of its own adapter.

    registry = AdapterRegistry(model.config, {"zoe": LORA / "zoe"}, max_loras=2)
    engine = LoRAEngine(model, tokenizer, registry)          # lora_engine.py: the engine side
    engine.generate([prompt], SamplingParams(lora="zoe"))

The adapters live in `max_loras` slots of preallocated tensors, one pair per (layer, module), so a
forward pass gathers every token's A and B by slot index; `AdapterRegistry` decides which adapter
sits in which slot (load on demand, evict the least recently used one that no request uses).
"""

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from labkit.model import Config, Llama

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's tensor names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def bgmv(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """The LoRA term of every token of a packed batch, each token with its own adapter.

    x:       (N, d_in) float32, the N tokens of a batch (prefill chunks and decodes packed together)
    lora_a:  (S, r, d_in) float32, the A matrices of the S adapter slots (zero rows pad a smaller rank)
    lora_b:  (S, d_out, r) float32, the B matrices
    indices: (N,) int64, the slot of each token's adapter; -1 = no adapter (the base model)
    scaling: (S,) float32, each slot's scaling (lora_alpha / r)
    returns  (N, d_out) float32: token n gets scaling[s] * B[s] A[s] x[n] with s = indices[n]
             (A first: two thin matmuls, never the d_out x d_in product), exactly zero where s = -1
    """
    out = x.new_zeros(len(x), lora_b.shape[1])
    for s in indices.unique().tolist():
        if s < 0:
            continue  # base-model tokens get no LoRA term
        rows = indices == s
        out[rows] = (x[rows] @ lora_a[s].T) @ lora_b[s].T * scaling[s]
    return out


def read_adapter(path: str | os.PathLike, config: Config, max_rank: int) -> tuple[float, dict]:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) checked against the base model.

    Returns (scaling, {(layer, module): (A (r, d_in), B (d_out, r))}) in float32. Refuses, naming the
    field, what the forward does not implement (DoRA, LoRA biases, per-module ranks, ...)."""
    path = Path(path)
    file = path / "adapter_config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no adapter_config.json; pass a folder that peft's save_pretrained wrote")
    cfg = json.loads(file.read_text())
    refused = {
        "peft_type": cfg.get("peft_type") != "LORA",
        "use_dora": cfg.get("use_dora"),
        "bias": cfg.get("bias", "none") != "none",
        "lora_bias": cfg.get("lora_bias"),
        "fan_in_fan_out": cfg.get("fan_in_fan_out"),
        "rank_pattern": cfg.get("rank_pattern"),
        "alpha_pattern": cfg.get("alpha_pattern"),
        "modules_to_save": cfg.get("modules_to_save"),
        "layer_replication": cfg.get("layer_replication"),
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{path}: adapter_config.json field {name}={cfg.get(name)!r} is not supported here")
    rank = cfg["r"]
    if rank > max_rank:
        raise ValueError(f"{path}: rank {rank} exceeds max_rank={max_rank}; raise max_rank")
    scaling = cfg["lora_alpha"] / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    shapes = module_shapes(config)
    weights: dict[tuple[int, str], list] = {}
    for key, tensor in load_file(path / "adapter_model.safetensors").items():
        m = PEFT_KEY.fullmatch(key)
        if m is None or int(m.group(1)) >= config.num_hidden_layers or m.group(2) not in TARGET_MODULES:
            raise ValueError(f"{path}: tensor {key} adapts nothing this model has (LoRA on {TARGET_MODULES})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        d_out, d_in = shapes[module]
        want = (rank, d_in) if which == "A" else (d_out, rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{path}: {key} has shape {tuple(tensor.shape)}, expected {want}")
        weights.setdefault((layer, module), [None, None])["AB".index(which)] = tensor.float()
    for key, (a, b) in weights.items():
        if a is None or b is None:
            raise ValueError(f"{path}: layer {key[0]} {key[1]} has lora_A or lora_B but not both")
    return scaling, {key: tuple(ab) for key, ab in weights.items()}


def module_shapes(config: Config) -> dict[str, tuple[int, int]]:
    """(d_out, d_in) of each LoRA target module of one layer."""
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }


class AdapterRegistry:
    """The adapters a server knows (name -> PEFT folder) and the max_loras slots that hold loaded ones.

    lora_a[(layer, module)]: (max_loras, max_rank, d_in), lora_b[...]: (max_loras, d_out, max_rank) and
    scaling (max_loras,) are allocated once: the memory budget. slots: loaded adapter -> its slot, in
    least-recently-used-first order; pins: loaded adapter -> number of requests using it now. An adapter
    with a pin is never evicted, so a request never runs with another adapter's weights.
    """

    def __init__(self, config: Config, adapters: dict[str, str | os.PathLike], max_loras: int = 4, max_rank: int = 16):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        for path in adapters.values():
            read_adapter(path, config, max_rank)  # refuse a bad adapter at startup, not at its first request
        self.paths = {name: Path(path) for name, path in adapters.items()}
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.lora_a, self.lora_b = {}, {}
        for layer in range(config.num_hidden_layers):
            for module, (d_out, d_in) in module_shapes(config).items():
                self.lora_a[layer, module] = torch.zeros(max_loras, max_rank, d_in)
                self.lora_b[layer, module] = torch.zeros(max_loras, d_out, max_rank)
        self.scaling = torch.zeros(max_loras)
        self.slots: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.num_loads = 0  # adapters read from disk so far (a hit in `slots` costs none)

    def check_known(self, name: str) -> None:
        """ValueError naming `name` and the known adapters when the registry has no such adapter."""
        if name not in self.paths:
            raise ValueError(f"unknown LoRA adapter {name!r}; this server has: {sorted(self.paths) or 'none'}")

    def acquire(self, name: str) -> int | None:
        """Pin adapter `name` for one more request and return its slot; None if it cannot be loaded now.

        Already loaded: it becomes the most recently used. Otherwise it is loaded (self.load) into a
        free slot, else into the slot of the least recently used adapter that no request pins (that
        one is evicted); when every slot is pinned, nothing changes and the answer is None.
        """
        if name not in self.slots:
            free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
            if free:
                slot = free[0]
            else:
                victim = next((n for n in self.slots if self.pins.get(n, 0) == 0), None)
                if victim is None:
                    return None
                slot = self.slots.pop(victim)
                self.pins.pop(victim, None)
            self.load(name, slot)
            self.slots[name] = slot
        self.slots[name] = self.slots.pop(name)  # dicts keep insertion order: the end is most recent
        self.pins[name] = self.pins.get(name, 0) + 1
        return self.slots[name]

    def release(self, name: str) -> None:
        """A request that pinned `name` is done: drop one pin (the adapter stays loaded, evictable at zero)."""
        self.pins[name] -= 1

    def load(self, name: str, slot: int) -> None:
        """Copy adapter `name`'s weights into `slot` of every (layer, module), zero where it adapts nothing."""
        scaling, weights = read_adapter(self.paths[name], self.config, self.max_rank)
        for key in self.lora_a:
            self.lora_a[key][slot].zero_()
            self.lora_b[key][slot].zero_()
            if key in weights:
                a, b = weights[key]
                self.lora_a[key][slot, : len(a)] = a  # rank r < max_rank: zero rows add nothing
                self.lora_b[key][slot, :, : len(a)] = b
        self.scaling[slot] = scaling
        self.num_loads += 1

    def nbytes(self) -> int:
        """Bytes of the slot tensors: what max_loras adapters cost next to the one base model."""
        return sum(t.nbytes for t in (*self.lora_a.values(), *self.lora_b.values(), self.scaling))


class LoRAMapping:
    """The adapter slot of each token of the batch the next forward pass runs (N,) int64, or None
    when no token has an adapter (the base model then runs alone)."""

    def __init__(self):
        self.indices: torch.Tensor | None = None


class LinearWithLoRA(nn.Module):
    """A base nn.Linear plus each token's LoRA term (vLLM's *LinearWithLoRA layers)."""

    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling, mapping: LoRAMapping):
        super().__init__()
        self.base, self.lora_a, self.lora_b, self.scaling, self.mapping = base, lora_a, lora_b, scaling, mapping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.mapping.indices is None:
            return y
        if x.dim() != 2 or len(x) != len(self.mapping.indices):
            raise ValueError(f"LoRA mapping covers {len(self.mapping.indices)} tokens, this input is {tuple(x.shape)}")
        delta = bgmv(x.to(self.lora_a.dtype), self.lora_a, self.lora_b, self.mapping.indices, self.scaling)
        return y + delta.to(y.dtype)  # adapters stay float32 under a bf16 base model


def add_lora_layers(model: Llama, registry: AdapterRegistry, mapping: LoRAMapping) -> None:
    """Replace, in place, every LoRA target module of `model` by a LinearWithLoRA over the registry's slots."""
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for module in TARGET_MODULES:
                if isinstance(getattr(parent, module, None), nn.Linear):
                    base = getattr(parent, module)
                    a, b = registry.lora_a[i, module], registry.lora_b[i, module]
                    setattr(parent, module, LinearWithLoRA(base, a, b, registry.scaling, mapping))
