"""Stage 01 on real checkpoints' architectures (issue 13): equal to HF, or refused by name.

Folders are random-init HF models built from real config.json fields (labkit.testing.FAMILY_CONFIGS),
saved the way the Hub's files are, then read through the stage's loaders.
"""

import json

import numpy as np
import pytest
import torch

from labkit.testing import FAMILY_CONFIGS, hf_logits, random_gpt2, random_tokens, relative_error, save_family

SEED = 21
T = 24  # longer than Mistral's window (5) and the llama3 scaling's original length (16)
PLAIN = ["llama2", "llama3-4x-layout", "smollm2"]  # what the Llama you wrote computes exactly
EXTRAS = {  # family -> the config field the plain loader must name when it refuses
    "llama3.1-4x-layout": "rope_scaling",
    "llama-linear-4x-type": "rope_scaling",
    "llama-attention-mlp-bias": "attention_bias",
    "mistral-window": "sliding_window",
    "qwen2-tied": "attention_bias",
    "qwen3": "qk_norm",
}
# Every GPT-2 size, shrunk: the head counts of small/medium/large/xl, its real config.json flags.
GPT2_SIZES = {"small": 12, "medium": 16, "large": 20, "xl": 25}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: (root / name, save_family(name, root / name, seed=SEED + i)) for i, name in enumerate(FAMILY_CONFIGS)}


@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_family_forward_equals_hf(impl, folders, name):
    families = impl("stage01_forward_numpy.families")
    path, hf = folders[name]
    ids = random_tokens(SEED, T, hf.config.vocab_size)
    got = families.family_forward(families.load_family_params(path), ids.numpy())
    err = relative_error(got, hf_logits(hf, ids))
    assert err < 1e-4, f"{name}: family_forward relative error {err:.2e} vs HF (seed={SEED})"


@pytest.mark.parametrize("name", PLAIN)
def test_your_llama_runs_plain_llama_checkpoints(impl, folders, name):
    llama = impl("stage01_forward_numpy.llama_numpy")
    path, hf = folders[name]
    ids = random_tokens(SEED, T, hf.config.vocab_size)
    err = relative_error(llama.llama_forward(llama.load_llama_params(path), ids.numpy()), hf_logits(hf, ids))
    assert err < 1e-4, f"{name}: llama_forward relative error {err:.2e} vs HF (seed={SEED})"


@pytest.mark.parametrize("name", EXTRAS)
def test_your_llama_refuses_what_it_does_not_compute(impl, folders, name):
    llama = impl("stage01_forward_numpy.llama_numpy")
    with pytest.raises(ValueError, match=EXTRAS[name]) as err:
        llama.load_llama_params(folders[name][0])
    assert "families" in str(err.value), f"{name}: the error should point to families.py: {err.value}"


@pytest.mark.parametrize("size", GPT2_SIZES)
def test_gpt2_checkpoints_of_every_size_equal_hf(impl, tmp_path, size):
    gpt2 = impl("stage01_forward_numpy.gpt2_numpy")
    heads = GPT2_SIZES[size]
    hf = random_gpt2(SEED, n_embd=4 * heads, n_head=heads, n_positions=64, activation_function="gelu_new")
    hf.save_pretrained(tmp_path)
    ids = random_tokens(SEED, 40, hf.config.vocab_size)
    err = relative_error(gpt2.gpt2_forward(gpt2.load_gpt2_params(tmp_path), ids.numpy()), hf_logits(hf, ids))
    assert err < 1e-4, f"gpt2-{size} flags: relative error {err:.2e} vs HF (seed={SEED})"


@pytest.mark.parametrize(
    "field,value",
    [
        ("activation_function", "gelu"),
        ("activation_function", "relu"),
        ("scale_attn_weights", False),
        ("scale_attn_by_inverse_layer_idx", True),
    ],
)
def test_gpt2_flags_it_does_not_implement_are_refused(impl, tmp_path, field, value):
    gpt2 = impl("stage01_forward_numpy.gpt2_numpy")
    random_gpt2(SEED).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        gpt2.load_gpt2_params(tmp_path)


def test_gpt2_longer_than_n_positions_says_so(impl):
    gpt2 = impl("stage01_forward_numpy.gpt2_numpy")
    hf = random_gpt2(SEED, n_positions=16)
    params = gpt2.load_gpt2_params({k: v.numpy() for k, v in hf.state_dict().items()}, hf.config.to_dict())
    ids = np.asarray(random_tokens(SEED, 17, hf.config.vocab_size))
    with pytest.raises(ValueError, match="n_positions=16"):
        gpt2.gpt2_forward(params, ids)


def _with_extra_tensor(src, dst, name):
    """A copy of folder src whose safetensors file also holds `name`: a feature nothing reads."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({**load_file(src / "model.safetensors"), name: torch.ones(3)}, dst / "model.safetensors")
    return dst


def test_loaders_refuse_a_tensor_nothing_reads(impl, folders, tmp_path):
    llama = impl("stage01_forward_numpy.llama_numpy")
    path = _with_extra_tensor(folders["llama2"][0], tmp_path / "llama", "model.layers.0.self_attn.q_proj.bias")
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        llama.load_llama_params(path)
    gpt2 = impl("stage01_forward_numpy.gpt2_numpy")
    random_gpt2(SEED).save_pretrained(tmp_path / "gpt2")
    path = _with_extra_tensor(tmp_path / "gpt2", tmp_path / "gpt2-extra", "transformer.h.0.attn.q_norm.weight")
    with pytest.raises(ValueError, match=r"q_norm"):
        gpt2.load_gpt2_params(path)
