"""What a model folder's config.json says, for labkit.model: the supported families (ARCHITECTURES), the
Config they read into (Config.from_hf, the way HF's modeling file of each family reads it; Config.to_hf back),
and the extras (EXTRAS: biases, qk_norm, sliding_window, rope_scaling) that code re-implementing part of the
forward pass refuses unless it implements them (refuse_extras). A field the model does not implement is an
error that names it, never an approximation. labkit.model re-exports every name here.
"""

from dataclasses import asdict, dataclass, fields

from . import checkpoint

# model_type -> the HF class a folder of that type loads as. Every other model_type is refused.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 2/3/3.1/3.2, SmolLM2, TinyLlama
    "mistral": "MistralForCausalLM",  # + sliding-window attention
    "qwen2": "Qwen2ForCausalLM",  # + q/k/v biases
    "qwen3": "Qwen3ForCausalLM",  # + RMSNorm on every query and key head
}
ROPE_TYPES = ("default", "linear", "llama3")


def unsupported(field: str, value, supported: str) -> checkpoint.CheckpointError:
    """The error for a config.json field this model does not implement: never approximate it."""
    return checkpoint.CheckpointError(
        f"config.json has {field}={value!r}, which labkit.model does not implement (supported: {supported}). "
        "Running it anyway would give logits that differ from Hugging Face's; use a checkpoint of a "
        f"supported family ({', '.join(ARCHITECTURES)})."
    )


@dataclass
class Config:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2
    model_type: str = "llama"
    attention_bias: bool = False  # biases on q_proj, k_proj, v_proj (Qwen2, Llama attention_bias)
    o_proj_bias: bool = False  # a bias on o_proj too (Llama attention_bias, Qwen3 attention_bias)
    mlp_bias: bool = False  # biases on gate/up/down_proj (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on every query and key head (Qwen3)
    sliding_window: int | None = None  # a query sees only the last `sliding_window` keys (Mistral)
    rope_scaling: dict | None = None  # HF's rope_parameters minus rope_theta, for linear and llama3

    @classmethod
    def from_hf(cls, hf: dict) -> "Config":
        """From a config.json dict of a supported model_type; anything it cannot honour is an error.

        RoPE comes in two layouts: transformers 5.x writes rope_parameters = {rope_type, rope_theta, ...};
        the Hub's 4.x files write rope_scaling = {rope_type (or type), factor, ...} next to a top-level rope_theta.
        """
        model_type = hf.get("model_type", "llama")
        if model_type not in ARCHITECTURES:
            raise unsupported("model_type", model_type, ", ".join(ARCHITECTURES))
        if hf.get("hidden_act", "silu") != "silu":
            raise unsupported("hidden_act", hf["hidden_act"], "'silu' (SwiGLU)")
        known = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling", "sliding_window", "model_type"}
        kw = {k: v for k, v in hf.items() if k in known and v is not None}
        kw["model_type"] = model_type
        # A field config.json leaves out takes the default of that family's HF config class.
        kv_default = {"mistral": 8, "qwen2": 32, "qwen3": 32}.get(model_type, hf["num_attention_heads"])
        kw.setdefault("num_key_value_heads", kv_default)
        kw.setdefault("head_dim", 128 if model_type == "qwen3" else hf["hidden_size"] // hf["num_attention_heads"])
        kw.setdefault("rms_norm_eps", 1e-6)
        kw.setdefault("tie_word_embeddings", False)
        kw.update(family_features(model_type, hf))
        kw.update(rope_from_hf(hf))
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    def to_hf(self) -> dict:
        """A config.json dict that transformers reads as this model_type's *ForCausalLM."""
        d = asdict(self)
        theta, scaling = d.pop("rope_theta"), d.pop("rope_scaling")
        qkv_bias, o_bias = d.pop("attention_bias"), d.pop("o_proj_bias")
        d.pop("qk_norm")  # implied by model_type qwen3
        if self.model_type == "llama":
            if qkv_bias != o_bias:
                raise ValueError("a Llama config has one attention_bias for q, k, v and o; they must agree")
            d["attention_bias"] = qkv_bias
        elif self.model_type == "qwen3":
            d["attention_bias"] = o_bias
        if self.model_type != "llama":
            d.pop("mlp_bias")
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        else:
            d.pop("sliding_window")
        d.update(
            architectures=[ARCHITECTURES[self.model_type]],
            hidden_act="silu",
            rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": theta},
            torch_dtype="bfloat16",
        )
        return d


def family_features(model_type: str, hf: dict) -> dict:
    """The Config flags each family sets, read the way HF's modeling file of that family reads them."""
    if model_type == "llama":
        bias = bool(hf.get("attention_bias", False))
        return dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))
    if model_type == "mistral":  # MistralAttention has no biases whatever the config says
        return dict(sliding_window=hf.get("sliding_window"))
    # Qwen2/Qwen3 can make some layers sliding-window (use_sliding_window, layer_types): not implemented.
    if hf.get("use_sliding_window"):
        raise unsupported("use_sliding_window", hf["use_sliding_window"], "false (full attention in every layer)")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise unsupported("layer_types", sorted(layer_types), "every layer 'full_attention'")
    if model_type == "qwen2":  # q/k/v always have biases, o_proj never
        return dict(attention_bias=True, o_proj_bias=False)
    bias = bool(hf.get("attention_bias", False))  # qwen3
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True)


def rope_from_hf(hf: dict) -> dict:
    """rope_theta and rope_scaling from either layout, refusing RoPE variants not implemented here."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise unsupported("rope_parameters", rope, "one RoPE for every layer")
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise unsupported("rope_type", rope_type, ", ".join(ROPE_TYPES))
    factor = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1.0):
        raise unsupported("partial_rotary_factor", factor, "1.0 (RoPE on the whole head)")
    theta = float(rope.pop("rope_theta", hf.get("rope_theta") or Config.rope_theta))
    if rope_type == "default":
        return dict(rope_theta=theta)
    needs = {"linear": ("factor",), "llama3": LLAMA3_KEYS}[rope_type]
    missing = [k for k in needs if k not in rope]
    if missing:
        raise checkpoint.CheckpointError(f"config.json: rope_type={rope_type!r} needs {missing}, which it lacks")
    return dict(rope_theta=theta, rope_scaling={"rope_type": rope_type, **{k: rope[k] for k in needs}})


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


EXTRAS = ("attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "sliding_window", "rope_scaling")


def refuse_extras(config: Config, where: str, supported: tuple[str, ...] = (), max_len: int | None = None) -> None:
    """For code that re-implements part of Llama.forward: raise if `config` needs an extra (EXTRAS)
    that `where` does not implement. A sliding window no sequence (of at most max_len) can exceed is harmless."""
    for name in EXTRAS:
        value = getattr(config, name)
        if name == "sliding_window" and value is not None and max_len is not None and max_len <= value:
            continue
        if value and name not in supported:
            raise checkpoint.CheckpointError(
                f"{where} does not implement {name}={value!r}, which this {config.model_type} checkpoint uses "
                f"(it implements {', '.join(supported) or 'none of ' + ', '.join(EXTRAS)}). Its output would "
                "not match Hugging Face's; run this checkpoint with labkit.model.Llama's own forward and generate."
            )
