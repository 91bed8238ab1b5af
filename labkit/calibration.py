"""Calibration plumbing for post-training quantization (stage 03): a calibration set drawn from
the training split, the inputs of the first decoder layer, and forward hooks that record what a
module sees. GPTQ, AWQ and SmoothQuant all run a model layer by layer on these.
"""

from contextlib import contextmanager

import torch
from torch import nn

from . import corpus
from .model import Llama, causal_mask, rope_cos_sin
from .quality import pack


def calibration_windows(tokenizer, n_windows: int = 8, seq: int = 256) -> torch.Tensor:
    """(n_windows, seq) int64 token windows from the *training* stories, never the held-out ones."""
    ids = pack(tokenizer, corpus.train_texts(4 * n_windows))[: n_windows * seq]
    if len(ids) < n_windows * seq:
        raise ValueError(f"not enough training text for {n_windows} windows of {seq} tokens")
    return ids.view(n_windows, seq)


@torch.no_grad()
def block_inputs(model: Llama, ids: torch.Tensor):
    """What Llama.forward hands its first decoder layer, so layers can be run one at a time:
    `x = layer(x, cos, sin, mask, None, i)`.

    ids: (B, T) int64 -> x (B, T, hidden), cos/sin (T, head_dim), mask (T, T) bool causal (and windowed)
    """
    T = ids.shape[1]
    x = model.model.embed_tokens(ids)
    c = model.config
    cos, sin = rope_cos_sin(torch.arange(T), c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    mask = causal_mask(0, T, c.sliding_window)
    return x, cos, sin, mask


@contextmanager
def record_inputs(modules: dict[str, nn.Module]):
    """Inside the `with`, every forward call of modules[name] appends its first input to inputs[name]."""
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, name=name: inputs[name].append(args[0].detach()))
        for name, m in modules.items()
    ]
    try:
        yield inputs
    finally:
        for h in hooks:
            h.remove()
