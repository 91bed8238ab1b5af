"""§5–§6 generation with and without the cache, the never-recompute check, left-padded batches."""

import copy

import pytest
import torch

import labkit.model
from labkit.testing import (
    FP32_MARGIN,
    LLAMA_CONFIGS,
    assert_greedy_within,
    greedy_logits,
    labkit_from_hf,
    random_llama,
    random_tokens,
)

GENERATE = "stage02_kv_cache.generate"


def forbid_labkit_forward(monkeypatch):
    """labkit's own Llama/Attention forward (and its KVCache) must not do the lab's work."""

    def forbidden(*args, **kwargs):
        raise AssertionError("use the stage's forward/attention_block and your KVCache, not labkit.model's forward")

    monkeypatch.setattr(labkit.model.Llama, "forward", forbidden)
    monkeypatch.setattr(labkit.model.Attention, "forward", forbidden)


def models(name: str, seed: int):
    hf = random_llama(seed, **LLAMA_CONFIGS[name])
    return hf, labkit_from_hf(hf)


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    return random_tokens(seed, length, vocab).tolist()


@torch.no_grad()
def hf_generate(hf, p: list[int], n: int) -> list[int]:
    """HF greedy generate of exactly n new tokens. EOS may be generated and does not stop it: the
    stop id is one the vocabulary cannot produce (min_new_tokens would instead forbid EOS)."""
    out = hf.generate(
        torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=hf.config.vocab_size
    )
    return out[0, len(p) :].tolist()


@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_greedy_kv_cache_generation_matches_hf_generate(impl, name, monkeypatch):
    hf, model = models(name, 0)
    p = prompt(0, 9, hf.config.vocab_size)
    expected = hf_generate(hf, p, 12)
    forbid_labkit_forward(monkeypatch)
    got = impl(GENERATE).generate_kv_cache(model, p, 12)
    what = f"config={name} seed=0: greedy tokens against HF generate"
    assert_greedy_within(got, expected, lambda: greedy_logits(hf, p, expected), FP32_MARGIN, what)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_cache_generation_runs_in_the_models_dtype(impl, dtype):
    hf32, model = models("gqa2-tied", 3)
    hf, model = copy.deepcopy(hf32).to(dtype), model.to(dtype)
    p = prompt(3, 7, hf.config.vocab_size)
    got = impl(GENERATE).generate_kv_cache(model, p, 8)
    want = hf_generate(hf, p, 8)
    # Both paths round every op to dtype, each about as far from float32 as HF's own logits are (err, set by the
    # two reference paths), so they part only where HF rates the other token within twice that (2 err) of its
    # maximum. (bfloat16, seed 3: err 0.019; only the last of the 8 steps has a second token within 2 err.)
    logits = greedy_logits(hf, p, want)
    err = (logits - greedy_logits(hf32, p, want)).abs().max().item()
    what = f"dtype={dtype} seed=3: the cache must hold the model's dtype (HF's {dtype} vs float32 error {err:.3g})"
    assert_greedy_within(got, want, logits, 2 * err, what)


@pytest.mark.parametrize("name", ["mha-untied", "mqa-odd"])
def test_greedy_no_cache_generation_matches_hf_generate(impl, name):
    hf, model = models(name, 1)
    p = prompt(1, 5, hf.config.vocab_size)
    got, want = impl(GENERATE).generate_no_cache(model, p, 8), hf_generate(hf, p, 8)
    what = f"config={name} seed=1: greedy tokens against HF generate"
    assert_greedy_within(got, want, lambda: greedy_logits(hf, p, want), FP32_MARGIN, what)


@torch.no_grad()
def reference_sampling(hf, p: list[int], n: int, temperature: float, seed: int) -> list[int]:
    """The slow obvious sampler: full HF forward every step, one multinomial draw per step."""
    g = torch.Generator().manual_seed(seed)
    ids = list(p)
    for _ in range(n):
        probs = torch.softmax(hf(torch.tensor([ids])).logits[0, -1] / temperature, dim=-1)
        ids.append(int(torch.multinomial(probs[None], 1, generator=g)))
    return ids[len(p) :]


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_is_the_same_with_and_without_the_cache(impl, seed):
    hf, model = models("gqa2-tied", seed)
    p = prompt(seed, 6, hf.config.vocab_size)
    gen = impl(GENERATE)
    expected = reference_sampling(hf, p, 8, 0.8, seed)
    cached = gen.generate_kv_cache(model, p, 8, temperature=0.8, generator=torch.Generator().manual_seed(seed))
    uncached = gen.generate_no_cache(model, p, 8, temperature=0.8, generator=torch.Generator().manual_seed(seed))
    assert cached == expected, f"seed={seed}: cached sampling differs from the reference sampler"
    assert uncached == expected, f"seed={seed}: uncached sampling differs from the reference sampler"


def tokens_seen_by_each_layer(model):
    """Hooks on every layer's q_proj recording how many tokens each call processes."""
    seen = [[] for _ in model.model.layers]
    handles = [
        layer.self_attn.q_proj.register_forward_hook(lambda mod, args, out, i=i: seen[i].append(args[0].shape[1]))
        for i, layer in enumerate(model.model.layers)
    ]
    return seen, handles


@pytest.mark.parametrize("prompt_len", [1, 7])
@pytest.mark.in_process("counts the tokens each layer sees with hooks on the test's model")
def test_cached_generation_never_reruns_the_prefix(impl, prompt_len, monkeypatch):
    hf, model = models("gqa4-3layers", 0)
    forbid_labkit_forward(monkeypatch)
    seen, handles = tokens_seen_by_each_layer(model)
    try:
        impl(GENERATE).generate_kv_cache(model, prompt(0, prompt_len, hf.config.vocab_size), 6)
    finally:
        for h in handles:
            h.remove()
    allowed = ([prompt_len] + [1] * 5, [prompt_len] + [1] * 6)
    for i, counts in enumerate(seen):
        assert counts in allowed, (
            f"layer {i} processed {counts} tokens per call; a cached generation prefills {prompt_len} "
            "tokens once, then runs exactly 1 token per step"
        )


@pytest.mark.in_process("counts the tokens each layer sees with hooks on the test's model")
def test_no_cache_baseline_recomputes_the_whole_sequence(impl):
    hf, model = models("gqa2-tied", 0)
    seen, handles = tokens_seen_by_each_layer(model)
    try:
        impl(GENERATE).generate_no_cache(model, prompt(0, 4, hf.config.vocab_size), 5)
    finally:
        for h in handles:
            h.remove()
    assert all(counts == [4, 5, 6, 7, 8] for counts in seen), (
        f"the baseline should run the full sequence every step (4, 5, ..., 8 tokens), got {seen[0]}"
    )


def test_left_pad_right_aligns_prompts(impl):
    ids, pad = impl(GENERATE).left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]], "shorter prompts get pad_id on the left"
    assert pad.tolist() == [0, 2, 1], "pad counts each row's padding slots"
    assert ids.dtype == torch.int64 and pad.dtype == torch.int64


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["gqa2-tied", "mqa-odd"])
def test_left_padded_forward_matches_each_prompt_alone(impl, name, seed):
    hf, model = models(name, seed)
    prompts = [prompt(seed + i, n, hf.config.vocab_size) for i, n in enumerate([9, 4, 6])]
    ids, pad = impl(GENERATE).left_pad(prompts)
    cache = impl("stage02_kv_cache.kv_cache").KVCache(model.config, 3, ids.shape[1] + 1)
    forward = impl("stage02_kv_cache.cached_llama").forward
    prefill = forward(model, ids, cache, pad)
    next_tokens = torch.tensor([[3], [4], [5]])
    step = forward(model, next_tokens, cache, pad)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([p + [int(next_tokens[b])]])).logits[0]
        msg = f"config={name} seed={seed} row {b} (pad {int(pad[b])})"
        torch.testing.assert_close(prefill[b, int(pad[b]) :], expected[:-1], atol=1e-5, rtol=0, msg=msg + " prefill")
        torch.testing.assert_close(step[b, 0], expected[-1], atol=1e-5, rtol=0, msg=msg + " decode step")


@pytest.mark.parametrize("name", ["gqa4-3layers", "mqa-odd"])
def test_batched_left_padded_generation_equals_per_prompt_generation(impl, name):
    hf, model = models(name, 2)
    prompts = [prompt(2 + i, n, hf.config.vocab_size) for i, n in enumerate([3, 10, 7, 1])]
    got = impl(GENERATE).generate_batched(model, prompts, 8)
    assert len(got) == len(prompts), f"config={name} seed=2: one output per prompt"
    for b, (p, g) in enumerate(zip(prompts, got, strict=True)):
        want = hf_generate(hf, p, 8)
        what = f"config={name} seed=2 row {b}: batched generation must equal generating each prompt alone"
        assert_greedy_within(g, want, lambda p=p, want=want: greedy_logits(hf, p, want), FP32_MARGIN, what)
