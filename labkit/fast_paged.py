"""The engine's linear layers through labkit.cpu_kernels: the same forward, its matrix products streamed.

Stage 04's forward_paged runs labkit.model's nn.Linear modules: PyTorch's BLAS, which at a few rows (a
decode step of a few chats) reads each weight matrix at a fraction of the bandwidth that
labkit.cpu_kernels' loops reach (fast_decode.py says why). This module gives an engine a copy of the
model whose linear layers (the LM head included) call those loops; every other module and tensor is
the model's own, shared, and the learner's code (paged attention, the KV pool, the scheduler, sampling)
runs exactly as before, so a learner's finished engine gets the same speed.

    fast = accelerate(model, kernels="cpp", quantization="q8_0")   # a new Llama; model is untouched
    logits = fast(ids)                                             # or stage 04's forward_paged(fast, ...)

- kernels="cpp": a pass of at most CPP_MAX_ROWS rows (decodes, short chunks) goes through the packed
  float32 matrix-vector loop, which reads each weight once for all its rows; a longer pass (a prefill
  chunk) through PyTorch's GEMM, which is compute-bound there and faster. kernels="torch" returns the
  model itself. Where the kernels cannot be built (no compiler, no AVX2) "cpp" falls back to "torch".
- quantization="q8_0" / "q4_0" / "q4_1" (GGUF's type names): every matrix quantized once to llama.cpp's blocks of
  32, and every pass, long or short, runs the integer loops (the float weights stay in the model).
- A plain Llama layer (no biases, no q/k norm) also gets a FusedLayer: the work on either side of the paged
  attention in one C++ call each, q/k/v and gate/up stacked into one packing (stage 04's forward_paged
  calls it; the layer's modules stay, for everything else). On SmolLM2 it took a one-chat decode step from
  25.4 to 16.2 ms (float32) and 16.1 to 9.9 ms (q8_0), two threads (bench_results/serve.json's step_breakdown).
- The per-row summation order of every loop depends on neither the number of rows nor the thread split,
  so a row gets the same bits in any batch that takes the same path; with max_rows=math.inf every pass
  takes it (row_invariant), which is how stage 04's batch-invariant mode runs on the kernels.
"""

import copy
import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .model import MLP, Llama, RMSNorm

KERNELS = ("cpp", "torch")
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1")  # GGUF's names for the int8 and 4-bit blocks cpu_kernels reads
# each format's loop; Q8_0 and Q4_0 with their rows interleaved in eights, which serve several x rows a load:
# 4 rows through all of SmolLM2's matrices cost 1.3x one row in Q8_0, 3.4x in Q4_1 (bench multirow, one thread)
OPS = {None: "f32_matvec", "q8_0": "q8_0x8_matvec", "q4_0": "q4_0_matvec", "q4_1": "q4_1_matvec"}
CPP_MAX_ROWS = 128  # passes of more rows take PyTorch's GEMM (float32); bench multirow: the kernel ahead to 128
_PACKED: dict[int, dict] = {}  # id(weight) -> {(quantization, its version): packed}, while the weight lives


class PackedLinear(nn.Linear):
    """An nn.Linear (same weight and bias, shared) whose product runs labkit.cpu_kernels' loops.

    Still an nn.Linear, so code that wraps linear layers (stage 04's LoRA) wraps this one the same way."""

    def __init__(self, base: nn.Linear, ops, quantization: str | None, max_rows: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self._forward_hooks, self._forward_pre_hooks = base._forward_hooks, base._forward_pre_hooks
        self.quantization, self.max_rows = quantization, max_rows
        self.op = getattr(ops, OPS[quantization])
        if id(base.weight) not in _PACKED:  # engines built on one model share its packing
            _PACKED[id(base.weight)] = {}
            weakref.finalize(base.weight, _PACKED.pop, id(base.weight), None)
        packs = _PACKED[id(base.weight)]
        key = (quantization, _version(base.weight))  # an in-place change of the weight packs it again
        if key not in packs:
            for stale in [k for k in packs if len(k) == 2 and k[1] != key[1]]:  # a Group's keys are longer
                del packs[stale]
            w = base.weight.detach()
            pad = -w.shape[0] % cpu_kernels.MR  # zero rows to whole panels of 16
            packs[key] = {None: lambda: (cpu_kernels.pack_f32(F.pad(w, (0, 0, 0, pad))),),
                          "q8_0": lambda: cpu_kernels.pack_q8_0x8(*cpu_kernels.quantize_q8_0(w)),
                          "q4_0": lambda: cpu_kernels.quantize_q4_0(w),
                          "q4_1": lambda: cpu_kernels.quantize_q4_1(w)}[quantization]()  # fmt: skip
        self.packed = packs[key]

    @property
    def row_invariant(self) -> bool:
        """Whether every pass runs the kernels, whose sum for a row depends on neither the other rows nor the
        threads (a float32 pass of more than max_rows rows takes PyTorch's GEMM, whose order may)."""
        return self.quantization is not None or self.max_rows == math.inf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.quantization is None and len(flat) > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        y = self.op(flat.float(), *self.packed)[:, : self.out_features]  # a padded panel's zero rows dropped
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, quantization={self.quantization or 'f32'}"


def _version(weight: torch.Tensor) -> int:
    """The weight's in-place write count; an inference tensor (a model loaded under torch.inference_mode) keeps
    none, and is packed once."""
    return 0 if weight.is_inference() else weight._version


def fits(linear: nn.Linear, quantization: str | None) -> bool:
    """Whether the kernels take this matrix: float32 of any shape (its last panel padded with zero rows), or
    quantized with inputs a multiple of 32 (the blocks) and outputs of 4 (Q4_1) or 8 (rows interleaved in eights)."""
    out, inp = linear.weight.shape
    shape_ok = (
        inp % cpu_kernels.BLOCK == 0 and out % (4 if quantization == "q4_1" else 8) == 0 if quantization else True
    )
    return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu" and shape_ok


def accelerate(model: Llama, kernels: str = "cpp", quantization: str | None = None,
               max_rows: float = CPP_MAX_ROWS) -> Llama:  # fmt: skip
    """A Llama sharing every parameter of `model` whose linear layers run labkit.cpu_kernels (see the module
    docstring); `model` itself is left as it was. kernels="torch" without quantization returns `model`."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}; choose one of {KERNELS}")
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization={quantization!r}; choose one of {QUANTIZATIONS} (or None for float32)")
    ops = cpu_kernels.ops() if kernels == "cpp" or quantization else None
    if ops is None:
        if quantization:
            raise ValueError(f"quantization={quantization!r} runs labkit.cpu_kernels, which cannot be built here")
        return model
    packed: dict[int, PackedLinear] = {}

    def rebuilt(module: nn.Module) -> nn.Module:
        """A shallow copy of `module` (its tensors and hooks shared) on the way to a linear layer; the rest shared."""
        if type(module) is nn.Linear and fits(module, quantization):
            if id(module) not in packed:
                packed[id(module)] = PackedLinear(module, ops, quantization, max_rows)
            return packed[id(module)]
        if not any(type(m) is nn.Linear for m in module.modules()):
            return module
        new = copy.copy(module)
        new._modules = {name: child and rebuilt(child) for name, child in module._modules.items()}
        return new

    fast = rebuilt(model)
    groups = []
    for layer in fast.model.layers:
        if FusedLayer.fits(layer, quantization):
            layer.fused = FusedLayer(layer, ops)
            groups += [layer.fused.qkv_group, layer.fused.gate_up_group]
    grouped = {id(lin) for group in groups for lin in group.linears}
    singles = [lay for lay in packed.values() if id(lay) not in grouped]
    # every packed matrix in one buffer on 2 MB pages, once per packing: a third more bandwidth here
    fresh = [g for g in groups if g.packed[0].storage_offset() == 0]
    fresh_singles = [lay for lay in singles if lay.packed[0].storage_offset() == 0]
    copies = cpu_kernels.huge_pages([g.packed for g in fresh] + [lay.packed for lay in fresh_singles])
    for group, copied in zip(fresh, copies[: len(fresh)], strict=True):
        group.adopt(copied)
    for layer, copied in zip(fresh_singles, copies[len(fresh) :], strict=True):
        layer.packed = _PACKED[id(layer.weight)][(layer.quantization, _version(layer.weight))] = copied
    return fast


class Group:
    """Linear layers that read the same input (q, k, v; gate, up) as one packing, stacked by output rows, that
    one matrix loop streams: each layer's own packing becomes a view into it, so no weight is stored twice."""

    def __init__(self, linears: list[PackedLinear]):
        self.linears = linears
        key = tuple((id(lin.weight), _version(lin.weight)) for lin in linears) + (linears[0].quantization,)
        self.packs = _PACKED[id(linears[0].weight)]  # dropped with the first weight, as its own packings
        if key not in self.packs:  # else an earlier engine on this model stacked them (and its layers are views)
            self.packs[key] = tuple(torch.cat(parts) for parts in zip(*(lin.packed for lin in linears), strict=True))
        self.key = key
        self.adopt(self.packs[key])

    def adopt(self, stacked: tuple[torch.Tensor, ...]) -> None:
        """Take `stacked` (the stacked packing, or its copy on 2 MB pages) and point every layer's packing into it."""
        self.packed = self.packs[self.key] = stacked
        start = 0
        for lin in self.linears:
            rows = lin.packed[0].shape[0]  # panels of 16 for float32, output rows for the blocks
            lin.packed = tuple(t[start : start + rows] for t in stacked)
            _PACKED[id(lin.weight)][(lin.quantization, _version(lin.weight))] = lin.packed
            start += rows


class FusedLayer:
    """A decoder layer's work on either side of its attention in one C++ call each (cpu_kernels.cpp's layer_qkv:
    input norm, the stacked q/k/v product, RoPE; layer_out: o_proj, residual, norm, the stacked gate/up product,
    SwiGLU, down_proj, residual), for stage 04's forward_paged, which runs the paged attention between them.

    The ~60 small eager ops a layer these replace cost a third of SmolLM2's float32 step (25.4 against 16.2 ms).
    Only a plain Llama layer fuses (no biases, no Qwen3 q/k norm); a call returns None, and forward_paged runs
    the layer's modules, where the modules were swapped since (stage 04's LoRA wraps them) or where a float32
    pass has more than max_rows rows (the GEMM, where eager ops cost little beside the matrix work)."""

    def __init__(self, layer: nn.Module, ops):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.ops, self.c = layer, ops, attn.c
        # where each linear layer sits, read from the modules' own dicts: nn.Module's attribute lookup made the
        # check that none was swapped cost 8 us a call, 0.5 ms of a SmolLM2 step
        self.slots = [(attn._modules, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        self.slots += [(mlp._modules, n) for n in ("gate_proj", "up_proj", "down_proj")]
        self.linears = tuple(modules[name] for modules, name in self.slots)
        self.qkv_group = Group([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_group = Group([mlp.gate_proj, mlp.up_proj])

    @staticmethod
    def fits(layer: nn.Module, quantization: str | None) -> bool:
        attn, mlp, c = layer.self_attn, layer.mlp, layer.self_attn.c
        parts = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        stacked_whole = quantization or all(lin.out_features % cpu_kernels.MR == 0 for lin in parts[:2] + parts[4:5])
        return (type(mlp) is MLP and all(type(lin) is PackedLinear and lin.bias is None for lin in parts)
                and type(layer.input_layernorm) is type(layer.post_attention_layernorm) is RMSNorm
                and not c.qk_norm and bool(stacked_whole))  # fmt: skip

    @property
    def row_invariant(self) -> bool:
        """Whether every pass takes the C++ calls (PackedLinear.row_invariant), each row summed in one order there."""
        return self.linears[0].row_invariant

    def _applies(self, rows: int) -> bool:
        lin = self.linears[0]
        if lin.quantization is None and rows > lin.max_rows:
            return False
        for (modules, name), own in zip(self.slots, self.linears, strict=True):
            if modules[name] is not own or own._forward_hooks or own._forward_pre_hooks:
                return False
        return True

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (N, hidden), cos and sin (N, 1, head_dim) -> q (N, H, D), k and v (N, KV, D); None where it does not apply."""
        if not self._applies(len(x)):
            return None
        norm, c = self.layer.input_layernorm, self.c
        return self.ops.layer_qkv(x, norm.weight, norm.eps, list(self.qkv_group.packed), cos, sin,
                                  c.num_attention_heads, c.num_key_value_heads)  # fmt: skip

    def out(self, x: torch.Tensor, y: torch.Tensor):
        """x (N, hidden) the layer's input, y (N, H, D) its attention -> the layer's output; None where it does not apply."""
        if not self._applies(len(x)):
            return None
        norm, o, down = self.layer.post_attention_layernorm, self.linears[3], self.linears[6]
        return self.ops.layer_out(x, y, list(o.packed), norm.weight, norm.eps, list(self.gate_up_group.packed),
                                  list(down.packed), self.c.intermediate_size)  # fmt: skip
