"""Helpers for graded tests: random-init Hugging Face models (nothing is downloaded) and
conversions between them and labkit's model. The references the tests compare against come
from these HF models, never from the solutions."""

import numpy as np
import torch

from .model import Config, Llama

# Configs that exercise the corners: GQA ratios 1, 2, 4, MQA, odd head counts, tied and untied.
LLAMA_CONFIGS = {
    "mha-untied": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=False),
    "gqa2-tied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4-3layers": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
    "mqa-odd": dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=False),
}


def random_llama(seed: int = 0, **overrides):
    """A random-init transformers LlamaForCausalLM in float32, eval mode.

    Defaults are tiny (2 layers, vocab 97); pass any LlamaConfig field to override."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).float().eval()
    # HF's default init (std 0.02) gives near-uniform logits; widen it so argmax ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    return model


def random_gpt2(seed: int = 0, **overrides):
    """A random-init transformers GPT2LMHeadModel in float32, eval mode, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    kw = dict(
        vocab_size=101,
        n_positions=128,
        n_embd=48,
        n_layer=2,
        n_head=3,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" not in name and "ln_f" not in name:
                p.normal_(0.0, 0.08)
    return model


def labkit_from_hf(hf_model) -> Llama:
    """labkit's Llama holding the same weights as a transformers LlamaForCausalLM."""
    config = Config.from_hf(hf_model.config.to_dict())
    model = Llama(config)
    state = dict(hf_model.state_dict())
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.float().eval()


def hf_from_labkit(model: Llama):
    """transformers LlamaForCausalLM holding the same weights as labkit's Llama (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = model.config.to_hf()
    hf_cfg.pop("torch_dtype")
    hf = LlamaForCausalLM(LlamaConfig(**hf_cfg)).float().eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def random_tokens(seed: int, length: int, vocab_size: int, batch: int | None = None) -> torch.Tensor:
    """Seeded token ids, (length,) or (batch, length) int64."""
    rng = np.random.default_rng(seed)
    shape = (length,) if batch is None else (batch, length)
    return torch.from_numpy(rng.integers(0, vocab_size, size=shape)).long()


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) for exactly max_new_tokens argmax tokens; returns the new ones.

    EOS may be chosen like any other token but does not stop generation: the stop id is set to one
    the vocabulary cannot produce. (min_new_tokens would instead forbid EOS, changing the argmax.)"""
    out = hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=hf_model.config.vocab_size,
    )
    return out[0, len(prompt) :].tolist()
