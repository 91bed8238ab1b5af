"""Hugging Face model folders: config.json + model.safetensors (+ tokenizer.json), and nothing else.

Reads and writes the same files `save_pretrained` does, so a folder written here loads with
`AutoModelForCausalLM.from_pretrained`, and a real GPT-2 or Llama-family checkpoint loads here.
Only safetensors is read: a pickle checkpoint (pytorch_model.bin) can run code when loaded.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FAMILIES = {"gpt2": ("gpt2",), "llama": ("llama", "mistral", "qwen2")}


class CheckpointError(ValueError):
    """A model folder that cannot be used, with what is wrong and what to do about it."""


def read_config(path: str | os.PathLike, family: str | None = None) -> dict:
    """Read config.json; with `family` ('gpt2' or 'llama'), check the architecture matches."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder. Pass the folder that holds config.json.")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json; it is not a Hugging Face model folder.")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}). Re-save the model.") from e
    if family is not None:
        model_type = config.get("model_type")
        if model_type not in FAMILIES[family]:
            raise CheckpointError(
                f"{path} holds a {model_type!r} model, but this loader reads the {family} family "
                f"(model_type one of {FAMILIES[family]})."
            )
    return config


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the folder, from model.safetensors or a sharded model.safetensors.index.json."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(path / shard))
        return state
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(
            f"{path} has only pickle weights (.bin/.pt), which this course never loads. Convert them: "
            "load the model with transformers and call save_pretrained(folder, safe_serialization=True)."
        )
    raise CheckpointError(f"{path} has no model.safetensors (or sharded index); nothing to load.")


def check_shapes(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], path) -> None:
    """Raise on a missing tensor or a tensor whose shape disagrees with config.json."""
    for name, shape in expected.items():
        if name not in state:
            raise CheckpointError(f"{path}: tensor {name!r} is missing; the checkpoint is incomplete.")
        if tuple(state[name].shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(state[name].shape)} but config.json implies "
                f"{tuple(shape)}. The weights and config.json come from different models."
            )


def save(path: str | os.PathLike, config: dict, state: dict[str, torch.Tensor], extra_files=()) -> None:
    """Write a model folder atomically: everything goes to a temporary folder that is renamed last,
    so a crash mid-write leaves the old folder intact rather than half a checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is meant to be shared
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        for f in extra_files:
            shutil.copy(f, tmp / Path(f).name)
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_arrays(path: str | os.PathLike) -> dict:
    """The folder's tensors as float32 NumPy arrays (bf16/fp16 weights are upcast exactly)."""
    return {k: v.float().numpy() for k, v in load_state_dict(path).items()}
