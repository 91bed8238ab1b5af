"""Stage 01: parameter and FLOP counts, against the HF models themselves and PyTorch's FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config

from labkit.testing import LLAMA_CONFIGS, random_gpt2, random_llama, random_tokens

MODULE = "stage01_forward_numpy.flops"
GPT2_CONFIGS = {
    "3heads-tied": dict(n_embd=48, n_head=3, n_layer=2, vocab_size=101),
    "5heads-untied": dict(n_embd=60, n_head=5, n_layer=3, vocab_size=97, tie_word_embeddings=False),
    "7heads-ninner": dict(n_embd=56, n_head=7, n_layer=1, n_inner=100, vocab_size=67, n_positions=77),
}
LLAMA_EXTRA = {"headdim-24": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24)}


def models():
    """(name, random-init HF model) for every GPT-2 and Llama config, eager attention so matmuls are visible."""
    for name, cfg in GPT2_CONFIGS.items():
        yield f"gpt2-{name}", lambda cfg=cfg: random_gpt2(0, attn_implementation="eager", **cfg)
    for name, cfg in (LLAMA_CONFIGS | LLAMA_EXTRA).items():
        yield f"llama-{name}", lambda cfg=cfg: random_llama(0, attn_implementation="eager", **cfg)


MODELS = dict(models())


@pytest.mark.parametrize("name", MODELS)
def test_param_count_matches_the_hf_model(impl, name):
    hf = MODELS[name]()
    expected = sum(p.numel() for p in hf.parameters())  # a tied matrix is one Parameter, counted once
    got = impl(MODULE).param_count(hf.config.to_dict())
    assert got == expected, f"{name}: param_count = {got:,}, the HF model has {expected:,} parameters"


# The models whose tying is their family's default (GPT-2 ties, Llama does not).
DEFAULT_TYING = [n for n in MODELS if n not in ("gpt2-5heads-untied", "llama-gqa2-tied")]


@pytest.mark.parametrize("name", DEFAULT_TYING)
def test_param_count_reads_the_family_default_when_the_config_omits_tying(impl, name):
    """A config.json may leave tie_word_embeddings out: GPT-2 then ties (HF's default), Llama does not."""
    hf = MODELS[name]()
    config = hf.config.to_dict()
    assert config.pop("tie_word_embeddings") == (config["model_type"] == "gpt2"), f"{name} is not default-tied"
    expected = sum(p.numel() for p in hf.parameters())
    got = impl(MODULE).param_count(config)
    assert got == expected, f"{name} without tie_word_embeddings: param_count = {got:,}, HF has {expected:,}"


def test_param_count_of_gpt2_small_is_124m(impl):
    got = impl(MODULE).param_count(GPT2Config().to_dict())
    assert got == 124_439_808, f"GPT-2 small (124M) has 124,439,808 parameters, param_count says {got:,}"


@pytest.mark.parametrize("seq_len", [1, 37])
@pytest.mark.parametrize("name", MODELS)
def test_forward_flops_match_torch_flop_counter(impl, name, seq_len):
    hf = MODELS[name]()
    ids = random_tokens(seq_len, seq_len, hf.config.vocab_size)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(ids[None])
    expected = counter.get_total_flops()
    got = impl(MODULE).forward_flops(hf.config.to_dict(), seq_len)
    assert got == expected, (
        f"{name}, prefill of {seq_len} tokens: forward_flops = {got:,}, FlopCounterMode {expected:,}"
    )
