"""Calibration plumbing for post-training quantization (stage 03): a calibration set drawn from
the training split, and forward hooks that record what a module sees. GPTQ, AWQ and SmoothQuant
all run a model layer by layer on these, starting from `model.layer_inputs(windows)` (labkit.model).
"""

from contextlib import contextmanager

import torch
from torch import nn

from . import corpus
from .quality import pack


def calibration_windows(tokenizer, n_windows: int = 8, seq: int = 256) -> torch.Tensor:
    """(n_windows, seq) int64 token windows from the *training* stories, never the held-out ones."""
    ids = pack(tokenizer, corpus.train_texts(4 * n_windows))[: n_windows * seq]
    if len(ids) < n_windows * seq:
        raise ValueError(f"not enough training text for {n_windows} windows of {seq} tokens")
    return ids.view(n_windows, seq)


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
