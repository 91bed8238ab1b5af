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
from gguf import GGUFReader, TokenType  # noqa: F401

from labkit.checkpoint import save
from labkit.gguf_model import fields, hf_name

from .llamacpp_quants import dequantize_q4_0, dequantize_q4_k, dequantize_q6_k, dequantize_q8_0, fp16_value  # noqa: F401

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
    raise NotImplementedError("stage03: dequantize_q4_1 — see lab2.ipynb §10")


def dequantize(data: np.ndarray, kind: str) -> np.ndarray:
    """A GGUF tensor as stored -> float32 (rows, cols), or (n,) for a 1-D tensor.

    data: float32 or float16 values for "F32" and "F16", uint8 blocks (rows, n_bytes) for "Q8_0", "Q4_0",
    "Q4_1", "Q4_K" and "Q6_K" (llamacpp_quants' dequantizers and dequantize_q4_1).
    Any other type is a ValueError that names it and the types this reader knows.
    """
    raise NotImplementedError("stage03: dequantize — see lab2.ipynb §10")


# --- §11 the rotary row order ----------------------------------------------------------------------


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a GGUF attn_q/attn_k weight from llama.cpp's rotary pairing back to HF's.

    w: (n_head * head_dim, in) -> same shape; the inverse of gguf_export.permute_qk: within each head,
    rows 2i and 2i+1 of the file (a rotated pair of neighbours) go back to rows i and i + head_dim/2.
    For attn_k, n_head is the number of KV heads.
    """
    raise NotImplementedError("stage03: unpermute_qk — see lab2.ipynb §11")


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
    raise NotImplementedError("stage03: config_from_gguf — see lab2.ipynb §12")


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
    raise NotImplementedError("stage03: tokenizer_json — see lab2.ipynb §13")


def tokenizer_config(metadata: dict) -> dict:
    """tokenizer_config.json (a dict): tokenizer_class "PreTrainedTokenizerFast"; bos_token, eos_token,
    unk_token and pad_token as the token strings at the file's ids (where it has them); add_bos_token
    (False when absent); model_max_length llama.context_length; chat_template where the file has one."""
    raise NotImplementedError("stage03: tokenizer_config — see lab2.ipynb §13")
