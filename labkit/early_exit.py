"""An early-exit draft for self-speculation: the target's first n layers, its final norm and its LM head.

Speculative decoding needs a draft that speaks the target's tokenizer. No smaller SmolLM2 ships as a
package, and training one on two CPU cores is out of reach, so the course cuts one out of the target
(the draft half of LayerSkip, Elhoushi et al. 2024, without its training): the residual stream after
layer n, read through the shared final norm and LM head, is the draft's guess of the target's next
token. Nothing is trained, so the draft is exact to rebuild; the handout's §9 measures how seldom an
untrained exit agrees with the target, and that it does not pay.

The draft is an ordinary Llama with num_hidden_layers=n, so every stage-06 path takes it as a draft,
and written as a Hugging Face folder it is also an `assistant_model` for transformers' assisted
generation. It keeps its own KV cache: the draft's layers recompute what the target's first n layers
already computed, the price of reusing stage 06's two-model code unchanged.

    python -m labkit.early_exit [--layers 24]   writes the real model's draft folder and prints its path
"""

import argparse
import dataclasses
import shutil
from pathlib import Path

import torch
from torch import nn

from . import checkpoint
from .model import Llama

# Measured on SmolLM2-135M (bench_results/stage06_real.json, and the stage 06 handout's §9): an
# untrained exit agrees with the target on a few percent of tokens up to layer 18 and on 0.3-0.5 at
# layer 24, the deepest exit that still reads clearly fewer bytes than the target (about 0.8 of them).
# No depth pays without training; the default is the one that is accepted most.
LAYERS = 24
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def check_layers(layers: int, total: int) -> None:
    if not 1 <= layers < total:
        raise ValueError(
            f"an early-exit draft keeps 1 to {total - 1} of the target's {total} layers, not {layers}: "
            "with all of them it is the target itself"
        )


def early_exit(target: Llama, layers: int = LAYERS) -> Llama:
    """A Llama made of `target`'s first `layers` blocks, final norm and LM head, sharing their tensors
    (no copy: the draft costs no memory and cannot drift from the target)."""
    check_layers(layers, target.config.num_hidden_layers)
    with torch.device("meta"):  # the skeleton only: every module is replaced by the target's own
        draft = Llama(dataclasses.replace(target.config, num_hidden_layers=layers))
    draft.model.embed_tokens, draft.model.norm = target.model.embed_tokens, target.model.norm
    draft.lm_head = target.lm_head
    draft.model.layers = nn.ModuleList(target.model.layers[:layers])
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    return draft.train(target.training)


def save_early_exit(target_folder, out_folder, layers: int = LAYERS) -> Path:
    """Write the Hugging Face folder of `target_folder`'s early-exit draft: config.json with
    num_hidden_layers=layers, the kept tensors as they are stored, and the tokenizer files."""
    target_folder, out_folder = Path(target_folder), Path(out_folder)
    config = checkpoint.read_config(target_folder, "llama")
    check_layers(layers, config["num_hidden_layers"])
    state = checkpoint.load_state_dict(target_folder)
    dropped = tuple(f"model.layers.{i}." for i in range(layers, config["num_hidden_layers"]))
    kept = {name: t for name, t in state.items() if not name.startswith(dropped)}
    extra = [target_folder / f for f in TOKENIZER_FILES if (target_folder / f).is_file()]
    checkpoint.save(out_folder, {**config, "num_hidden_layers": layers}, kept, extra)
    return out_folder


def real_draft_folder(layers: int = LAYERS) -> Path:
    """The real model's early-exit draft folder, next to the converted model; written on first use
    (a few seconds: it copies tensors, trains nothing). Fails with 'run make setup' without the model."""
    target = checkpoint.require_real_model()
    folder = target.with_name(f"{target.name}-exit{layers}")
    stale = folder.is_dir() and folder.stat().st_mtime < (target / "model.safetensors").stat().st_mtime
    if stale:
        shutil.rmtree(folder)
    if not (folder / "model.safetensors").is_file():
        save_early_exit(target, folder, layers)
    return folder


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Write the real model's early-exit draft folder (for DRAFT=...).")
    ap.add_argument("--layers", type=int, default=LAYERS, help=f"layers the draft keeps (default {LAYERS})")
    print(real_draft_folder(ap.parse_args().layers))
