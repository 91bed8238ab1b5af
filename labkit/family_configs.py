"""The shrunk config.json of each model family labkit supports, and random-init Hugging Face models of them
(nothing is downloaded): the references of the family tests. labkit.testing re-exports every name here."""

import torch

# Each real checkpoint's config.json, shrunk (layers, widths, vocab) with every architectural flag
# kept: head ratios, explicit head_dim, biases, tied embeddings, qk-norm, θ, norm eps. RoPE scaling
# keeps its type and factors but a small original_max_position_embeddings, and Mistral's window is
# short, so both change the logits at test lengths. "layout": "4.x" writes RoPE the way the Hub's
# files do (rope_scaling + a top-level rope_theta) instead of 5.x's rope_parameters.
SMALL = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
FAMILY_CONFIGS = {
    "llama2": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5),
    "llama3-4x-layout": dict(
        model_type="llama", num_attention_heads=8, num_key_value_heads=2, rope_theta=500_000.0, layout="4.x"
    ),
    "llama3.1-4x-layout": dict(
        model_type="llama",
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=500_000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
        layout="4.x",
    ),
    "llama3.2-tied": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500_000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True,
    ),
    "llama-linear-4x-type": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_scaling={"type": "linear", "factor": 4.0},
        layout="4.x",
    ),
    "llama-linear-5x": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "llama-attention-mlp-bias": dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True
    ),
    "smollm2": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_size=64,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
    ),
    "mistral-window": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=2, sliding_window=5),
    "qwen2-tied": dict(
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32,
        max_window_layers=1,
    ),
    "qwen2.5-untied": dict(model_type="qwen2", num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6),
    "qwen3": dict(
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-bias-untied": dict(
        model_type="qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=24, attention_bias=True
    ),
}


def family_config_json(name: str, **overrides) -> dict:
    """FAMILY_CONFIGS[name] (and overrides) as a config.json dict in the layout it names (5.x unless "layout": "4.x")."""
    cfg = {**SMALL, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", **FAMILY_CONFIGS[name], **overrides}
    layout = cfg.pop("layout", "5.x")
    theta, scaling = cfg.pop("rope_theta", 10_000.0), cfg.pop("rope_scaling", None)
    if layout == "4.x":
        cfg.update(rope_theta=theta, rope_scaling=scaling)
    else:
        cfg["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return cfg


def random_family(name: str, seed: int = 0, **overrides):
    """A random-init transformers model of FAMILY_CONFIGS[name], float32, eval mode; returns (model, config.json dict).

    Every weight is random, norms and biases included, so a feature the code ignores shows in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = family_config_json(name, **overrides)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).float().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    return hf, cfg


def save_family(name: str, path, seed: int = 0):
    """random_family(name) saved as an HF folder whose config.json is exactly family_config_json(name)
    (so a 4.x layout stays 4.x); returns the in-memory HF model."""
    import json

    hf, cfg = random_family(name, seed)
    hf.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": [type(hf).__name__]}, indent=2))
    return hf
