"""Sampling (temperature, top-k, top-p, per-request seeds), stopping (EOS, max_tokens, stop strings),
penalties and logit_bias, and logprobs."""

import math
import random

import pytest
import torch
from stage04_helpers import log_softmax64, make_model, random_prompts


def _params(impl, **kw):
    return impl("stage04_batching.sequence").SamplingParams(**kw)


@pytest.mark.parametrize("seed", [0, 1])
def test_temperature_sampling_follows_the_softmax(impl, seed):
    sample = impl("stage04_batching.sampling").sample
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, generator=gen) * 2
    params = _params(impl, temperature=0.7)
    counts = torch.bincount(torch.tensor([sample(logits, params, gen) for _ in range(3000)]), minlength=6)
    expected = torch.softmax(logits / 0.7, -1)
    assert (counts / 3000 - expected).abs().max() < 0.035, (
        f"seed={seed}: frequencies {counts / 3000} should match softmax(logits / T) = {expected}"
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_and_top_p_keep_exactly_their_support(impl, seed):
    sample = impl("stage04_batching.sampling").sample
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(20, generator=gen) * 2
    order = logits.argsort(descending=True).tolist()
    got = {sample(logits, _params(impl, temperature=1.0, top_k=3), gen) for _ in range(400)}
    assert got == set(order[:3]), f"seed={seed}: top_k=3 should sample exactly the 3 largest {order[:3]}, got {got}"
    probs = torch.softmax(logits, -1)[order]
    nucleus = int((torch.cumsum(probs, -1) < 0.6).sum()) + 1  # smallest set reaching 0.6
    got = {sample(logits, _params(impl, temperature=1.0, top_p=0.6), gen) for _ in range(600)}
    assert got == set(order[:nucleus]), f"seed={seed}: top_p=0.6 support should be {order[:nucleus]}, got {got}"
    assert sample(logits, _params(impl, temperature=0.0), gen) == order[0], f"seed={seed}: temperature 0 is argmax"


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 1), (0.75, 2), (0.8, 3), (0.875, 3)])
def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly_at_the_boundary(impl, top_p, kept):
    """Probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (exact in float32 and float64, in a shuffled order): at top_p 0.75
    the two most likely tokens already reach it, so the third, whose preceding mass equals top_p, is out (vLLM
    keeps the smallest set whose mass reaches top_p); a `>` where `>=` belongs keeps it."""
    sample = impl("stage04_batching.sampling").sample
    probs = torch.tensor([0.0625, 0.25, 0.0625, 0.5, 0.125])
    order = [3, 1, 4, 0, 2]  # most likely first
    gen = torch.Generator().manual_seed(kept)
    got = {sample(torch.log(probs), _params(impl, temperature=1.0, top_p=top_p), gen) for _ in range(300)}
    assert got == set(order[:kept]), (
        f"top_p={top_p} over probabilities {probs.tolist()}: the smallest set reaching it is tokens "
        f"{order[:kept]} (mass {probs[order[:kept]].sum():.4g}); sampled {sorted(got)}"
        + (": a token whose preceding mass already equals top_p is out" if len(got) > kept else "")
    )


@pytest.mark.parametrize("vocab", [6, 20])
def test_each_knob_at_and_past_its_bounds_alone_and_combined(impl, vocab):
    """Clients send their own defaults whatever the model (top_k 40, 50, 100 or 1,000 against a small
    vocabulary; top_p 1.0; a tiny or a large temperature): a top_k at or past the vocabulary keeps every
    token, top_p 1 keeps every token, a tiny top_p keeps the most likely one, and the knobs combine."""
    sample = impl("stage04_batching.sampling").sample
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * 0.5  # every token at least ~2 % likely: 600 draws see each
    order = logits.argsort(descending=True).tolist()
    probs = torch.softmax(logits, -1)[order]
    nucleus = set(order[: int((torch.cumsum(probs, -1) < 0.6).sum()) + 1])
    every, top = set(range(vocab)), {order[0]}
    cases = [
        (dict(top_k=vocab), every),
        (dict(top_k=vocab + 1), every),
        (dict(top_k=100), every),
        (dict(top_k=1000), every),
        (dict(top_p=1.0), every),
        (dict(top_p=1e-6), top),
        (dict(top_k=1000, top_p=1.0), every),
        (dict(top_k=1000, top_p=0.6), nucleus),
        (dict(top_k=3, top_p=1.0), set(order[:3])),
        (dict(top_k=1, top_p=0.99), top),
        (dict(temperature=100.0, top_k=1000), every),
        (dict(temperature=1e-4, top_k=1000, top_p=1.0), top),
    ]
    for kw, want in cases:
        params = _params(impl, **{"temperature": 1.0, **kw})
        got = {sample(logits, params, gen) for _ in range(600)}
        assert got == want, f"seed={vocab}: vocabulary {vocab}, {kw}: sampled {sorted(got)}, support {sorted(want)}"
    for bad in (dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-0.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            _params(impl, **bad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_ties_and_top_k_of_one(impl, seed):
    sample = impl("stage04_batching.sampling").sample
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(30, generator=gen)
    tied = sorted(torch.randperm(30, generator=gen)[:3].tolist())
    logits[tied] = logits.max() + 1.0  # three ids share the maximum exactly
    assert sample(logits, _params(impl, temperature=0.0), gen) == tied[0], f"seed={seed}: a tie goes to the lowest id"
    draws = {sample(logits + torch.arange(30) * 1e-3, _params(impl, temperature=1.5, top_k=1), gen) for _ in range(50)}
    assert draws == {tied[-1]}, f"seed={seed}: top_k=1 keeps only the single largest logit, drew {draws}"


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_request_samples_the_same_alone_or_batched(impl, seed):
    model = make_model(seed)
    engine_mod = impl("stage04_batching.engine")
    prompt, *others = random_prompts(seed, 5, 4, 30)
    params = _params(impl, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234 + seed, ignore_eos=True)
    alone = engine_mod.LLMEngine(model, num_blocks=32).generate([prompt], params)[0]
    noisy = [_params(impl, max_tokens=9, temperature=1.0, seed=i) for i in range(4)]
    batched = engine_mod.LLMEngine(model, num_blocks=64).generate(
        [*others[:2], prompt, *others[2:]], [*noisy[:2], params, *noisy[2:]]
    )
    assert batched[2].token_ids == alone.token_ids, (
        f"seed={seed}: a request with its own seed must sample the same tokens whatever else is in the batch"
    )
    greedy = engine_mod.LLMEngine(model, num_blocks=32).generate(
        [prompt], _params(impl, max_tokens=12, ignore_eos=True)
    )
    assert alone.token_ids != greedy[0].token_ids, f"seed={seed}: temperature 1.0 should not just be greedy"


@pytest.mark.parametrize("seed", [0, 1])
def test_stop_string_ends_the_text_even_across_token_boundaries(impl, tokenizer, seed):
    model = make_model(seed, vocab_size=tokenizer.get_vocab_size())
    engine_mod = impl("stage04_batching.engine")
    prompt = tokenizer.encode("Once upon a time").ids
    free = engine_mod.LLMEngine(model, tokenizer, num_blocks=32).generate(
        [prompt], _params(impl, max_tokens=40, ignore_eos=True)
    )[0]
    full = free.text
    assert len(full) > 12, f"seed={seed}: need some text to cut, got {full!r}"
    stop = full[5:8]  # three characters that may straddle tokens
    cut = full.find(stop)
    out = engine_mod.LLMEngine(model, tokenizer, num_blocks=32).generate(
        [prompt], _params(impl, max_tokens=40, ignore_eos=True, stop=[stop])
    )[0]
    assert out.text == full[:cut], f"seed={seed}: stop={stop!r}: text should be {full[:cut]!r}, got {out.text!r}"
    assert out.finish_reason == "stop", f"seed={seed}: a stop string finishes with reason 'stop'"
    assert len(out.token_ids) < len(free.token_ids), f"seed={seed}: generation must halt at the stop string"


@pytest.mark.parametrize("seed", [0, 1])
def test_eos_and_max_tokens_finish_with_their_reasons(impl, seed):
    model = make_model(seed, vocab_size=11)  # a tiny vocabulary makes EOS (id 2) likely
    engine_mod = impl("stage04_batching.engine")
    outs = engine_mod.LLMEngine(model, num_blocks=64).generate(
        random_prompts(seed, 8, 2, 10, vocab_size=11), _params(impl, max_tokens=30)
    )
    for o in outs:
        if o.token_ids[-1] == 2:
            assert o.finish_reason == "stop", f"seed={seed}: EOS should finish with 'stop'"
            assert 2 not in o.token_ids[:-1], f"seed={seed}: generation must halt at the first EOS"
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 30, f"seed={seed}: max_tokens=30 ends it"


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_deltas_concatenate_to_the_text_and_never_break_utf8(impl, tokenizer, seed):
    model = make_model(seed, vocab_size=tokenizer.get_vocab_size())
    # bias the model towards the byte tokens of multi-byte characters, before the engine packs its weights
    multibyte = tokenizer.encode("ünïcode ✓ 日本語").ids
    with torch.no_grad():
        model.lm_head.weight[multibyte] += 0.3 * model.lm_head.weight[multibyte].sign()
    engine = impl("stage04_batching.engine").LLMEngine(model, tokenizer, num_blocks=32)
    rid = engine.add_request("héllo", _params(impl, max_tokens=40, ignore_eos=True, temperature=1.0, seed=seed))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.delta_text)
            final = out
    assert not any("\ufffd" in d for d in deltas[:-1]), f"seed={seed}: a delta carried a broken UTF-8 sequence"
    assert "".join(deltas) == final.text, f"seed={seed}: the deltas must add up to the final text"
    assert final.text == tokenizer.decode(final.token_ids), f"seed={seed}: text must be the decoded output"


@pytest.mark.parametrize("seed", range(4))
def test_find_stop_and_safe_length_against_brute_force(impl, seed):
    eng = impl("stage04_batching.sampling")
    rng = random.Random(seed)
    for _ in range(300):
        text = "".join(rng.choice("abc\ufffd") for _ in range(rng.randint(0, 9)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        starts = [i for i in range(len(text)) for s in stops if text.startswith(s, i)]
        assert eng.find_stop(text, stops) == (min(starts) if starts else None), f"seed={seed} {text!r} {stops}"
        if not starts:
            got = eng.safe_length(text, stops)
            held = max((k for s in stops for k in range(1, len(s)) if text.rstrip("\ufffd").endswith(s[:k])), default=0)
            assert got == len(text.rstrip("\ufffd")) - held, (
                f"seed={seed}: safe_length({text!r}, {stops}) = {got}: hold back a trailing U+FFFD run and the "
                "longest tail that is the start of a stop string, nothing more"
            )


@pytest.mark.parametrize("seed", [0, 1])
def test_no_streamed_delta_carries_part_of_a_stop_string(impl, tokenizer, seed):
    model = make_model(seed, vocab_size=tokenizer.get_vocab_size())
    engine_mod = impl("stage04_batching.engine")
    prompt = tokenizer.encode("Once upon a time").ids
    full = (
        engine_mod.LLMEngine(model, tokenizer, num_blocks=32)
        .generate([prompt], _params(impl, max_tokens=40, ignore_eos=True))[0]
        .text
    )
    stop = full[9:13]
    expected = full[: full.find(stop)]
    engine = engine_mod.LLMEngine(model, tokenizer, num_blocks=32)
    engine.add_request(prompt, _params(impl, max_tokens=40, ignore_eos=True, stop=[stop]))
    sent = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            sent += out.delta_text
            assert expected.startswith(sent), (
                f"seed={seed}: streamed {sent!r}, but the text ends at {expected!r} (stop {stop!r}): a client must "
                "never receive characters that turn out to start the stop string"
            )
    assert sent == expected, f"seed={seed}: the client must receive exactly the text before the stop"


@pytest.mark.parametrize("seed", [0, 1])
def test_logprobs_of_is_the_exact_log_softmax_even_far_in_the_tail(impl, seed):
    logprobs_of = impl("stage04_batching.sampling").logprobs_of
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, 50, generator=gen) * 40  # a float32 softmax underflows to 0 for most of each row
    ids = torch.randint(0, 50, (7,), generator=gen)
    chosen, top_ids, top_lps = logprobs_of(logits, ids, 4)
    ref = log_softmax64(logits)
    assert torch.isfinite(chosen).all(), f"seed={seed}: every logprob must be finite, got {chosen}"
    assert torch.allclose(chosen.double(), ref.gather(1, ids[:, None])[:, 0], rtol=1e-5, atol=1e-4), (
        f"seed={seed}: chosen {chosen} != log_softmax {ref.gather(1, ids[:, None])[:, 0]}"
    )
    assert top_ids.tolist() == ref.argsort(-1, descending=True)[:, :4].tolist(), (
        f"seed={seed}: top ids, most likely first"
    )
    assert torch.allclose(top_lps.double(), ref.sort(-1, descending=True).values[:, :4], rtol=1e-5, atol=1e-4), (
        f"seed={seed}: the top logprobs must be the log-softmax of those tokens"
    )


@pytest.mark.parametrize("seed", range(3))
def test_apply_penalties_against_a_loop_over_the_vocabulary(impl, seed):
    apply_penalties = impl("stage04_batching.sampling").apply_penalties
    rng = random.Random(seed)
    vocab = 30
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    logits[rng.randrange(vocab)] = float("-inf")  # a token a constraint masked
    before = logits.clone()
    output = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
    bias = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)}
    params = _params(impl, presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2), logit_bias=bias)
    got = apply_penalties(logits, output, params)
    want = []
    for t in range(vocab):
        c = output.count(t)
        want.append(
            before[t].item() - params.frequency_penalty * c - params.presence_penalty * (c > 0) + bias.get(t, 0)
        )
    assert torch.equal(logits, before), f"seed={seed}: apply_penalties must not change its input (logprobs read it)"
    assert all(g == w if math.isinf(w) else abs(g - w) < 1e-4 for g, w in zip(got.tolist(), want, strict=True)), (
        f"seed={seed} output={output} {params}: got {got.tolist()}, want {want}"
    )
