"""Read a llama.cpp GGUF file back into a Hugging Face Llama folder: the way back from gguf_export.py.

A GGUF carries everything a model folder does, in llama.cpp's terms: its metadata is config.json
(`llama.block_count`, `llama.attention.head_count_kv`, ...) and tokenizer.json (`tokenizer.ggml.tokens`,
`.merges`, `.token_type`, `.pre`) with the chat template; its tensors are quantized blocks under
llama.cpp's names, q/k rows in llama.cpp's rotary pairing. Undo each of those and the folder loads
in `labkit.model.from_pretrained` and in transformers.
"""

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, TokenType

from labkit.checkpoint import save
from labkit.gguf_model import fields, hf_name

from .llamacpp_quants import dequantize_q4_0, dequantize_q4_k, dequantize_q6_k, dequantize_q8_0, fp16_value

DEQUANTIZERS = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_K": dequantize_q4_k, "Q6_K": dequantize_q6_k}
Q4_1_BLOCK = (32, 20)  # weights, bytes: d fp16 | m fp16 | 16 B of nibbles

# The regexes llama.cpp splits text with before byte-level BPE, applied one after the other, by the
# name in `tokenizer.ggml.pre` (llama-vocab.cpp). "gpt-2" is what gguf_export.py writes, "smollm"
# what SmolLM2's file says: every digit on its own first, then GPT-2's split.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_TOKENIZERS = {"gpt-2": [GPT2_SPLIT], "smollm": [r"\p{N}", GPT2_SPLIT], "starcoder": [r"\p{N}", GPT2_SPLIT]}

# --- given plumbing: the file's fields and tensors, the folder ----------------------------------------


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict]:
    """(metadata, tensors) of a GGUF file: metadata maps each key to its value (str, int, float, bool or
    a list of them); tensors maps each llama.cpp name to gguf's ReaderTensor (`.data` as stored, memory-mapped:
    float32 or float16 (rows, cols), or uint8 (rows, n_bytes) for block types; `.tensor_type.name` its type)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the path of a .gguf file")
    reader = GGUFReader(path)
    return fields(reader), {t.name: t for t in reader.tensors}


def state_dict_from_gguf(tensors: dict, config: dict, path: str | os.PathLike = "") -> dict[str, torch.Tensor]:
    """HF name -> float32 tensor for every tensor of the file: dequantized, shaped (rows, cols) as HF
    stores it (ggml lists the dimensions the other way round), q/k rows back in HF's pairing."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state = {}
    for name, t in tensors.items():
        w = dequantize(np.asarray(t.data), t.tensor_type.name).reshape(tuple(int(d) for d in t.shape[::-1]))
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in heads:
            w = unpermute_qk(w, heads[kind])
        state[hf_name(name, path)] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    return state


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert the Llama GGUF `path` into the HF folder `out_dir`; returns out_dir (see write_folder)."""
    return write_folder(*read_gguf(path), out_dir, path)


def write_folder(metadata: dict, tensors: dict, out_dir: str | os.PathLike, path: str | os.PathLike = "") -> Path:
    """Write read_gguf's (metadata, tensors) as an HF folder: config.json, model.safetensors in float32,
    tokenizer.json, and tokenizer_config.json with the chat template. Returns out_dir.

    Whole or not at all: everything is built first and labkit's `save` writes a temporary folder that
    it renames into place, so a file this importer refuses (an unknown pre-tokenizer) leaves no
    folder that would load without its tokenizer."""
    config = config_from_gguf(metadata, sorted(tensors))
    tokenizer = tokenizer_json(metadata)
    state = state_dict_from_gguf(tensors, config, path)
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / "tokenizer.json", Path(tmp) / "tokenizer_config.json"]
        files[0].write_text(json.dumps(tokenizer, ensure_ascii=False))
        files[1].write_text(json.dumps(tokenizer_config(metadata), indent=2) + "\n")
        save(out_dir, config, state, extra_files=files)
    return Path(out_dir)


# --- §10 blocks back to floats ---------------------------------------------------------------------


def dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """(..., n_bytes) uint8 in Q4_1 -> (..., cols) float32: d · q + m per block of 32, q in 0…15.

    A block is 20 bytes: d fp16 | m fp16 | 16 B where byte j holds weight j in its low nibble and
    weight j + 16 in its high nibble (Q4_0's packing). m is the block's minimum, so no offset of 8.
    Bit for bit what ggml computes: d and m widened to float32, then (d · q) + m in float32.
    """
    weights, nbytes = Q4_1_BLOCK
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.ndim == 0 or data.shape[-1] % nbytes != 0:
        raise ValueError(f"Q4_1 rows are whole {nbytes}-byte blocks; got bytes of shape {data.shape}")
    blocks = data.reshape(-1, nbytes)
    d, m, qs = fp16_value(blocks[:, 0:2]), fp16_value(blocks[:, 2:4]), blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(*data.shape[:-1], data.shape[-1] // nbytes * weights)


def dequantize(data: np.ndarray, kind: str) -> np.ndarray:
    """A GGUF tensor as stored -> float32 (rows, cols), or (n,) for a 1-D tensor.

    data: float32 or float16 values for "F32" and "F16", uint8 blocks (rows, n_bytes) for "Q8_0", "Q4_0",
    "Q4_1", "Q4_K" and "Q6_K" (llamacpp_quants' dequantizers and dequantize_q4_1).
    Any other type is a ValueError that names it and the types this reader knows.
    """
    if kind in ("F32", "F16"):
        return np.asarray(data).astype(np.float32)
    if kind == "Q4_1":
        return dequantize_q4_1(data)
    if kind in DEQUANTIZERS:
        return DEQUANTIZERS[kind](data)
    raise ValueError(
        f"tensor type {kind} is not one this reader dequantizes (F32, F16, Q4_1, {', '.join(DEQUANTIZERS)}); "
        "re-quantize the model to one of those with llama.cpp's llama-quantize"
    )


# --- §11 the rotary row order ----------------------------------------------------------------------


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a GGUF attn_q/attn_k weight from llama.cpp's rotary pairing back to HF's.

    w: (n_head * head_dim, in) -> same shape; the inverse of gguf_export.permute_qk: within each head,
    rows 2i and 2i+1 of the file (a rotated pair of neighbours) go back to rows i and i + head_dim/2.
    For attn_k, n_head is the number of KV heads.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- §12 config.json -------------------------------------------------------------------------------


def config_from_gguf(metadata: dict, tensor_names: list[str]) -> dict:
    """HF config.json (a dict) of the Llama a GGUF file describes.

    metadata: read_gguf's; tensor_names: the file's tensor names. The result has model_type "llama",
    architectures ["LlamaForCausalLM"], hidden_act "silu", no biases, torch_dtype "float32", and from the
    `llama.*` keys: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads (the query heads when the key is absent), head_dim (attention.key_length, else
    hidden_size / heads), max_position_embeddings, rms_norm_eps, rope_parameters {rope_type "default",
    rope_theta (10,000 when absent)}, vocab_size (llama.vocab_size, else the number of tokens);
    tie_word_embeddings when the file has no output.weight; bos, eos and pad token ids where the file
    has them. A file that is not general.architecture "llama", or whose rotary dimension is not
    head_dim, or that scales RoPE, is a ValueError naming the key.
    """
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}; this reader converts 'llama' files only")
    key = lambda name, default=None: metadata.get(f"llama.{name}", default)  # noqa: E731
    n_head = key("attention.head_count")
    head_dim = key("attention.key_length", key("embedding_length") // n_head)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(
            f"llama.rope.dimension_count is {key('rope.dimension_count')}, not head_dim {head_dim}: partial RoPE"
        )
    if key("rope.scaling.type", "none") != "none":
        raise ValueError(f"llama.rope.scaling.type is {key('rope.scaling.type')!r}; only unscaled RoPE is read")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": key("attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {"rope_type": "default", "rope_theta": key("rope.freq_base", 10_000.0)},
        "vocab_size": key("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if f"tokenizer.ggml.{gguf_key}_token_id" in metadata:
            config[f"{name}_token_id"] = metadata[f"tokenizer.ggml.{gguf_key}_token_id"]
    return config


# --- §13 tokenizer.json and the chat template ------------------------------------------------------


def tokenizer_json(metadata: dict) -> dict:
    """The `tokenizers` library's tokenizer.json (a dict) for a byte-level BPE GGUF ("gpt2" model).

    - model: BPE with vocab {token: its index in tokenizer.ggml.tokens} and the merges as pairs
      ("Ġ t" -> ["Ġ", "t"]), no unk token, no byte fallback;
    - added_tokens: each CONTROL token (special: true) and USER_DEFINED token (special: false), with
      its id, not normalized, no strip, not single_word;
    - pre_tokenizer: a Sequence of one Split per regex of PRE_TOKENIZERS[tokenizer.ggml.pre]
      (behavior "Isolated", not inverted), then ByteLevel without its own regex (use_regex false, no prefix space);
    - decoder ByteLevel; no normalizer, no post-processor.
    Another tokenizer model, or a pre-tokenizer name missing from PRE_TOKENIZERS, is a ValueError that names it.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; this reader builds byte-level BPE ('gpt2') only")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre is {pre!r}, not one of {sorted(PRE_TOKENIZERS)}; add its regexes to "
            "PRE_TOKENIZERS from llama.cpp's llama-vocab.cpp"
        )
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    added = [
        dict(
            id=i,
            content=t,
            single_word=False,
            lstrip=False,
            rstrip=False,
            normalized=False,
            special=k == TokenType.CONTROL,
        )
        for i, (t, k) in enumerate(zip(tokens, types, strict=True))
        if k in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    splits = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in PRE_TOKENIZERS[pre]
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ") for m in metadata["tokenizer.ggml.merges"]],
        },
    }


def tokenizer_config(metadata: dict) -> dict:
    """tokenizer_config.json (a dict): tokenizer_class "PreTrainedTokenizerFast"; bos_token, eos_token,
    unk_token and pad_token as the token strings at the file's ids (where it has them); add_bos_token
    (False when absent); model_max_length llama.context_length; chat_template where the file has one."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": metadata.get("tokenizer.ggml.add_bos_token", False),
        "model_max_length": metadata.get("llama.context_length"),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if f"tokenizer.ggml.{key}_token_id" in metadata:
            config[f"{name}_token"] = tokens[metadata[f"tokenizer.ggml.{key}_token_id"]]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config
