"""Write a Llama checkpoint as a GGUF file that llama.cpp runs: F32, Q8_0, Q4_0 or a Q4_K_M mix.

A GGUF file is a header of typed key/value metadata (architecture, sizes, the tokenizer) followed
by named tensors, each with its own ggml type. llama.cpp needs three things from us beyond the
bytes: its tensor names (`blk.3.attn_q.weight`), q/k rows in its rotary pairing, and a tokenizer it
recognises. Every quantized tensor is written with the block formats of llamacpp_quants.py.
"""

import json
import os
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType

from labkit.checkpoint import load_state_dict, read_config

from .llamacpp_quants import quantize_q4_0, quantize_q4_k, quantize_q6_k, quantize_q8_0

MIXES = ("F32", "Q8_0", "Q4_0", "Q4_K_M")
FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
}
QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}

# HF Llama parameter names -> llama.cpp's (gguf-py's TensorNameMap for LLM_ARCH_LLAMA)
_NAMES = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"blk.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"blk.\1.attn_q.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"blk.\1.attn_k.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"blk.\1.attn_v.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"blk.\1.attn_output.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"blk.\1.ffn_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"blk.\1.ffn_gate.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"blk.\1.ffn_up.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"blk.\1.ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'; ValueError for an unknown name."""
    for pattern, name in _NAMES.items():
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, name, hf_name)
    raise ValueError(f"no GGUF name for {hf_name!r}: this exporter writes plain Llama checkpoints only")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a q_proj/k_proj weight from HF's rotary pairing to llama.cpp's.

    w: (n_head * head_dim, in) -> same shape. HF rotates dimension i of a head with i + head_dim/2
    (halves); llama.cpp's LLM_ARCH_LLAMA rotates 2i with 2i+1 (neighbours). Within each head, the
    new row 2i is old row i and the new row 2i+1 is old row i + head_dim/2, so q·k is unchanged
    after either rotation. For k_proj, n_head is the number of KV heads.
    """
    raise NotImplementedError("stage03: permute_qk — see lab2.ipynb §6")


def tensor_type(name: str, shape: tuple[int, ...], mix: str, n_layer: int, has_output: bool = False) -> str:
    """The ggml type llama.cpp's quantizer (llama_tensor_get_type) gives a tensor in file type `mix`.

    name: a GGUF name ('blk.3.ffn_down.weight'); shape: its HF shape (rows, cols) or (n,);
    has_output: whether the file has its own output.weight (False when the embeddings are tied).
    returns one of "F32", "Q8_0", "Q4_0", "Q4_K", "Q6_K":
    - 1-D tensors (the norms) stay F32 in every mix, and everything is F32 in "F32";
    - the output matrix (output.weight, or token_embd.weight when there is no output.weight because
      the embeddings are tied) is the most sensitive one: Q6_K in Q4_0 and Q4_K_M (Q8_0 stays Q8_0);
    - Q4_K_M: attn_v and ffn_down of the layers where use_more_bits(i, n_layer) holds get Q6_K,
      every other matrix Q4_K. use_more_bits(i, n) = i < n/8 or i ≥ 7n/8 or (i - n/8) % 3 == 2
      (integer division): the first and last eighth of the layers and every third one between;
    - Q8_0 and Q4_0: every other matrix in that type.
    A matrix whose rows are not a multiple of the chosen block stays F32 here (llama.cpp would pick
    a fallback type).
    """
    raise NotImplementedError("stage03: tensor_type — see lab2.ipynb §7")


def gguf_tensors(model_dir: str | os.PathLike, mix: str) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (data, type) for every tensor of a Llama folder in file type `mix`.

    data is float32 (rows, cols) or (n,) for F32, else the quantized bytes (rows, n_bytes) uint8.
    The token embedding doubles as the output matrix when the checkpoint ties them.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; expected one of {MIXES}")
    config = read_config(model_dir, "llama")
    n_layer = config["num_hidden_layers"]
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    state = load_state_dict(model_dir)
    has_output = "lm_head.weight" in state
    out = {}
    for hf_name, t in sorted(state.items()):
        w = t.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            w = permute_qk(w, n_head)
        elif hf_name.endswith("k_proj.weight"):
            w = permute_qk(w, n_kv)
        name = gguf_name(hf_name)
        kind = tensor_type(name, w.shape, mix, n_layer, has_output)
        out[name] = (w, kind) if kind == "F32" else (QUANTIZERS[kind](w), kind)
    return out


def _tokenizer(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """llama.cpp's 'gpt2' tokenizer from a byte-level BPE tokenizer.json, as convert_hf_to_gguf.py writes it.

    The pre-tokenizer must be a name llama.cpp knows: GPT-2's regex is "gpt-2" (not "gpt2").
    Rows of the embedding beyond the tokenizer's vocabulary get unused [PAD] tokens.
    """
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE" or (tok.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(
            f"{model_dir}/tokenizer.json is not a byte-level BPE tokenizer; this exporter writes only those"
        )
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    by_id = {i: s for s, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [
        TokenType.CONTROL if i in special else TokenType.NORMAL if i in by_id else TokenType.UNUSED
        for i in range(vocab_size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if config.get(key) in vocab:
            add(vocab[config[key]])
    writer.add_add_bos_token(False)  # HF's tokenizer.json adds no <s>; the course packs it explicitly


def export_gguf(model_dir: str | os.PathLike, path: str | os.PathLike, mix: str = "Q8_0") -> Path:
    """Write the Llama folder `model_dir` (config.json, model.safetensors, tokenizer.json) to `path`
    as a GGUF file of type `mix` (one of MIXES) that llama.cpp loads. Returns the path."""
    model_dir, path = Path(model_dir), Path(path)
    config = read_config(model_dir, "llama")
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError(f"{model_dir}: only default RoPE is exported; found {rope or config.get('rope_scaling')}")

    writer = GGUFWriter(path, "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads", n_head))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(FILE_TYPES[mix])
    _tokenizer(writer, model_dir, config["vocab_size"])
    for name, (data, kind) in gguf_tensors(model_dir, mix).items():
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
