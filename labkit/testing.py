"""Helpers for graded tests: random-init Hugging Face models (nothing is downloaded; each family's shrunk config
in labkit/family_configs.py) and conversions between them and labkit's model. The references the tests compare against come
from these HF models, never from the solutions."""

import functools

import numpy as np
import torch

from .checkpoint import load_tokenizer, require_real_model
from .family_configs import (  # noqa: F401  (tests read them as labkit.testing.FAMILY_CONFIGS, ...)
    FAMILY_CONFIGS,
    LLAMA3_ROPE,
    SMALL,
    family_config_json,
    random_family,
    save_family,
)
from .model import Config, Llama, init_weights

# Configs that exercise the corners: GQA ratios 1, 2, 4, MQA, odd head counts, tied and untied.
LLAMA_CONFIGS = {
    "mha-untied": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=False),
    "gqa2-tied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4-3layers": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
    "mqa-odd": dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=False),
}
# The default shape of both random Llamas: 2 layers, vocab 97, 4 query heads sharing 2 KV heads.
TINY_LLAMA = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def kept(fn, *args, **kwargs):
    """fn(*args, **kwargs), left where the learner's code runs. In an instructor's grading the learner's code runs
    in a worker process (labkit.grading.worker) and results cross by value, so a real model's params dict (540 MB)
    would cross back, and forth again at every call; this returns a handle to it instead. In-process, the value."""
    keep = getattr(fn, "_keep", None)
    return keep(*args, **kwargs) if keep is not None else fn(*args, **kwargs)


def random_llama(seed: int = 0, **overrides):
    """A random-init transformers LlamaForCausalLM in float32, eval mode.

    Defaults are tiny (2 layers, vocab 97); pass any LlamaConfig field to override."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        TINY_LLAMA,
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


def random_labkit_llama(seed: int = 0, **overrides) -> Llama:
    """A random-init labkit Llama in float32, eval mode, for tests that need no HF twin.

    TINY_LLAMA's shape and labkit's Config defaults otherwise (tied embeddings); pass any Config
    field to override. head_dim follows hidden_size / num_attention_heads. Weights have std 0.08,
    as random_llama's, so argmax ties are rare."""
    kw = dict(TINY_LLAMA, **overrides)
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    return init_weights(Llama(Config(**kw)), seed=seed, std=0.08).float().eval()


def with_random_biases(model: torch.nn.Module, seed: int = 0, std: float = 0.5) -> torch.nn.Module:
    """Give every bias of `model` Normal(0, std) values, in place (init_weights zeroes them, which
    would let code that drops a bias pass); returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def random_gpt2(seed: int = 0, **overrides):
    """A random-init transformers GPT2LMHeadModel in float32, eval mode, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    kw = dict(vocab_size=101, n_positions=128, n_embd=48, n_layer=2, n_head=3)
    kw.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" not in name and "ln_f" not in name:
                p.normal_(0.0, 0.08)
    return model


def labkit_from_hf(hf_model) -> Llama:
    """labkit's Llama holding the same weights as a transformers Llama-family model (strict)."""
    config = Config.from_hf(hf_model.config.to_dict())
    model = Llama(config)
    state = dict(hf_model.state_dict())
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.float().eval()


def hf_from_labkit(model: Llama):
    """The transformers model of labkit's model_type holding the same weights (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = model.config.to_hf()
    hf_cfg.pop("torch_dtype")
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg)).float().eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the parity measure of the family tests (float32: < 1e-4)."""
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    return float((got - want).abs().max() / want.abs().max())


def assert_argmax_within(got: torch.Tensor, want: torch.Tensor, margin: float, what: str) -> None:
    """Each greedy token of got (..., V) is one the reference want (..., V) could pick: its reference logit
    lies within `margin` of the reference maximum at that position.

    For two paths whose sums round differently (bfloat16 kernels, compiled against eager, batched
    against single), exact argmax equality is luck: which last bits differ depends on the kernels
    PyTorch picks for the CPU, and a near-tie flips with them. The caller bounds |got - want| first
    (against an error scale the code under test does not set), then passes that bound as the margin."""
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    picked = want.gather(-1, got.argmax(-1, keepdim=True))[..., 0]
    short = want.max(-1).values - picked
    worst = int(short.flatten().argmax())
    assert short.max().item() <= margin, (
        f"{what}: greedy token {got.argmax(-1).flatten()[worst].item()} at position {worst} is "
        f"{short.flatten()[worst].item():.3g} below the reference maximum (token "
        f"{want.argmax(-1).flatten()[worst].item()}), more than the paths' error bound {margin:.3g}"
    )


def assert_greedy_within(got: list[int], want: list[int], want_logits, margin: float, what: str) -> None:
    """Greedy sequences from one prompt agree up to the first token where got differs; there the reference
    had a near-tie: want_logits[i] (V,), the logits that chose want[i], rate got[i] within `margin` of it.
    Past that token the prefixes differ and nothing more can be compared (assert_argmax_within says why
    an exact comparison of two differently rounded paths is luck). want_logits may be a function that
    returns them (greedy_logits), called only where the sequences part. A path that stops at EOS may stop
    early only by choosing EOS where the reference did not, a near-tie like any other."""
    got, want = list(got), list(want)
    i = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), None)
    if i is None:
        assert len(got) == len(want), f"{what}: {len(got)} tokens, the reference made {len(want)}: {got}, {want}"
        return
    logits = torch.as_tensor((want_logits() if callable(want_logits) else want_logits)[i]).float()
    short = (logits[want[i]] - logits[got[i]]).item()
    assert short <= margin, (
        f"{what}: token {i} is {got[i]}, the reference's {want[i]}, which it rates {short:.3g} higher "
        f"(more than the paths' error bound {margin:.3g}); got {got}, reference {want}"
    )


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
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # every prompt token is real, even one equal to pad_token_id
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=hf_model.config.vocab_size,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_greedy_logits(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """hf_greedy's tokens and the raw logits (max_new_tokens, V) float32 that chose each of them, for
    assert_greedy_within."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=hf_model.config.vocab_size,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


# Float32 paths on the tiny random models agree within ~1e-6 of their logits whatever order they sum in;
# the logits tests allow 1e-4 (check_numpy_forward). Where such a path's greedy token parts from the
# reference's, the reference must rate it within twice that of its maximum; a bug is off by units.
FP32_MARGIN = 2e-4
# Float32 paths on the real model (30 layers) stay within 3e-4 of HF's logits (stage 01 measures 1e-4).
REAL_MARGIN = 6e-4


def assert_decisive(want: list[int], want_logits, margin: float, what: str) -> None:
    """Each of the reference's greedy tokens want[i] is the argmax of want_logits[i] and leads its runner-up by
    more than margin, so every path within margin / 2 of the reference's logits picks exactly want: where only
    text can be compared (a server's answer), this makes an exact comparison sound on every CPU.

    want and want_logits both come from the reference (labkit's contiguous-cache model, HF), never from the
    code under test: a decisive reference says nothing about tokens the reference did not choose."""
    logits = torch.as_tensor(want_logits[: len(want)]).float()
    assert len(logits) == len(want), f"{what}: {len(want)} tokens but logits for {len(logits)} positions"
    top = logits.argmax(-1)
    chosen = logits.gather(-1, torch.as_tensor(want, dtype=torch.long)[:, None])[:, 0]
    if (wrong := (chosen < logits.max(-1).values).nonzero()).numel():
        i = int(wrong[0])
        raise AssertionError(
            f"{what}: the reference's token {i} is {want[i]}, but its logits' maximum is token {int(top[i])}, "
            f"{float(logits[i, top[i]] - chosen[i]):.3g} higher: want is not these logits' greedy sequence"
        )
    top2 = logits.topk(2, -1).values
    gap = top2[:, 0] - top2[:, 1]
    i = int(gap.argmin())
    assert gap[i] > margin, (
        f"{what}: the reference's token {i} ({want[i]}) leads by {gap[i]:.3g} only (<= {margin:.3g})"
    )


def assert_hf_greedy(got: list[int], hf_model, prompt: list[int], n: int, margin: float, what: str) -> None:
    """got, n greedy tokens after prompt from a path whose logits lie within margin / 2 of hf_model's, are
    HF generate's (hf_greedy) up to a near-tie of HF's (assert_greedy_within)."""
    want, logits = hf_greedy_logits(hf_model, prompt, n)
    assert_greedy_within(got, want, logits, margin, f"{what}: HF generate(do_sample=False)")


@torch.no_grad()
def greedy_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits (len(tokens), V) float32 that `model` (labkit's Llama or a transformers causal LM) gives
    for each of `tokens` after `prompt`, from one forward pass: the reference's scores where another path's
    greedy tokens part from its own (assert_greedy_within)."""
    out = model(torch.tensor([list(prompt) + list(tokens)[:-1]]))
    return getattr(out, "logits", out)[0, len(prompt) - 1 :].float()


def hf_greedy_variants(hf_model, prompt: list[int], n: int, margin: float, limit: int = 8) -> list[list[int]]:
    """Every n-token greedy sequence a path within margin / 2 of hf_model's logits may produce: HF's own, and
    at each near-tie (another token within margin of the maximum) that token, continued greedily; at most
    `limit` of them. Where only text can be compared and the reference is not decisive (assert_decisive),
    the text must be one of these."""
    found, todo = [], [[]]
    while todo and len(found) < limit:
        prefix = todo.pop()
        tail, logits = hf_greedy_logits(hf_model, prompt + prefix, n - len(prefix)) if len(prefix) < n else ([], [])
        found.append(prefix + tail)
        for i, row in enumerate(logits):
            for t in (row >= row.max() - margin).nonzero()[:, 0].tolist():
                if t != tail[i]:
                    todo.append(prefix + tail[:i] + [t])
    return found


@torch.no_grad()
def hf_logits(hf_model, ids: torch.Tensor) -> np.ndarray:
    """The HF model's logits (T, vocab) float32 for one sequence ids (T,) int64."""
    return hf_model(ids[None]).logits[0].numpy()


def capture(module, run):
    """(hidden_states going into `module`, its output) while run() executes the whole model."""
    seen = {}

    def hook(mod, args, kwargs, out):
        seen["in"] = args[0] if args else kwargs["hidden_states"]
        seen["out"] = out[0] if isinstance(out, tuple) else out

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return seen["in"][0].numpy(), seen["out"][0].numpy()


def check_numpy_forward(forward, to_params, hf_model, seed: int, length: int, what: str) -> None:
    """A NumPy forward(params, ids (T,)) on `length` seeded tokens must give the HF model's logits:
    shape (T, vocab), float32, within 1e-4. to_params(hf_model) builds the params dict it reads."""
    ids = random_tokens(seed, length, hf_model.config.vocab_size)
    got = forward(to_params(hf_model), ids.numpy())
    expected = hf_logits(hf_model, ids)
    assert got.shape == expected.shape, f"{what}: logits shape {got.shape}, expected (T, V) = {expected.shape}"
    assert got.dtype == np.float32, f"{what}: logits are {got.dtype}; keep every array float32"
    delta = np.abs(got - expected).max()
    name = type(hf_model).__name__
    assert delta < 1e-4, f"{what} (seed={seed}, T={length}): max |Δlogits| vs {name} = {delta:.2e}"


def check_numpy_greedy(generate, forward, to_params, hf_model, seed: int, prompt_length: int, what: str) -> None:
    """generate(forward, params, prompt, 12) from a seeded prompt must pick HF generate(do_sample=False)'s
    12 tokens, up to a near-tie of HF's. to_params(hf_model) builds the params dict forward reads."""
    prompt = random_tokens(seed, prompt_length, hf_model.config.vocab_size).tolist()
    expected, logits = hf_greedy_logits(hf_model, prompt, 12)
    got = generate(forward, to_params(hf_model), prompt, 12)
    assert_greedy_within(got, expected, logits, FP32_MARGIN, f"{what} (seed={seed}) prompt {prompt}: HF generate")


# Text for the real-model tests: prose, code, numbers, unicode and a chat turn, so that every kind of
# token the vocabulary has takes part. Written for the course; nothing is downloaded.
REAL_TEXT = (
    "The key-value cache keeps the keys and values of every past token, so that each new token costs one "
    "matrix-vector product per weight instead of a whole forward pass. On a 2-core CPU the weights, "
    "538 MB in float32, are read once per token: decode is bound by memory bandwidth.\n\n"
    "def softmax(x):\n    m = max(x)\n    e = [math.exp(v - m) for v in x]\n    return [v / sum(e) for v in e]\n\n"
    "Café, naïve, Straße, 東京, 🤖 — 3.14159 × 10^5 ≠ 314159.\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@functools.cache
def real_hf():
    """The real model (SmolLM2-135M-Instruct, the folder `make setup` converts) as transformers'
    LlamaForCausalLM, float32, eval mode; loaded once per process. Fails, never skips, when it is missing."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(require_real_model(), dtype=torch.float32).eval()


@functools.cache
def real_labkit() -> Llama:
    """The real model as labkit's Llama, float32, eval mode; loaded once per process."""
    from .model import from_pretrained

    return from_pretrained(require_real_model()).eval()


def real_ids(length: int | None = None) -> torch.Tensor:
    """REAL_TEXT as the real model's token ids, (T,) int64, cut to `length` tokens."""
    ids = load_tokenizer(require_real_model()).encode(REAL_TEXT).ids
    if length is not None and length > len(ids):
        raise ValueError(f"REAL_TEXT has {len(ids)} tokens; ask for at most that many")
    return torch.tensor(ids[:length], dtype=torch.long)
