"""Stage 01: greedy decoding and seeded temperature / top-k sampling, against exact probabilities."""

import numpy as np
import pytest

MODULE = "stage01_forward_numpy.sampling"
SEEDS = [0, 1, 2]
DRAWS = 10_000


def exact_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - z.max())
    return e / e.sum()


def frequencies(sample, V: int) -> np.ndarray:
    counts = np.bincount([sample() for _ in range(DRAWS)], minlength=V)
    return counts / DRAWS


@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_is_the_argmax(impl, seed):
    logits = np.random.default_rng(seed).normal(size=(50,)).astype(np.float32)
    got = impl(MODULE).sample_next(logits, temperature=0.0)
    assert got == int(np.argmax(logits)), (
        f"temperature 0 must pick the argmax {np.argmax(logits)}, got {got} (seed={seed})"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_breaks_exact_ties_toward_the_lowest_id(impl, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(40,)).astype(np.float32)
    tied = np.sort(rng.choice(40, size=3, replace=False))
    logits[tied] = logits.max() + 1.0  # three ids share the maximum exactly
    got = impl(MODULE).sample_next(logits, temperature=0.0)
    assert got == tied[0], f"seed={seed}: ids {tied.tolist()} tie for the max; greedy takes the lowest, got {got}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_temperature_sampling_follows_the_softmax(impl, seed, temperature):
    logits = np.random.default_rng(seed).normal(0, 1.5, size=(8,)).astype(np.float32)
    rng = np.random.default_rng(100 + seed)
    sample_next = impl(MODULE).sample_next
    freq = frequencies(lambda: sample_next(logits, temperature=temperature, rng=rng), 8)
    # 10k draws: the standard error of each frequency is at most 0.005, so 0.025 is 5 sigma.
    np.testing.assert_allclose(
        freq, exact_softmax(logits / temperature), atol=0.025, err_msg=f"T={temperature}, seed={seed}"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_top_k_never_leaves_the_top_k(impl, seed):
    V, k = 12, 3
    logits = np.random.default_rng(seed).normal(0, 1.0, size=(V,)).astype(np.float32)
    top = np.argsort(logits)[-k:]
    rng = np.random.default_rng(200 + seed)
    sample_next = impl(MODULE).sample_next
    freq = frequencies(lambda: sample_next(logits, temperature=1.0, top_k=k, rng=rng), V)
    outside = np.setdiff1d(np.flatnonzero(freq), top)
    assert outside.size == 0, (
        f"top_k={k} emitted tokens {outside.tolist()} outside the top {top.tolist()} (seed={seed})"
    )
    expected = np.zeros(V)
    expected[top] = exact_softmax(logits[top])  # renormalised over the k survivors
    np.testing.assert_allclose(freq, expected, atol=0.025, err_msg=f"top-k renormalisation, seed={seed}")


def counting_forward(V: int = 16):
    """A stand-in model: the next token is (last token + 1) mod V, with a little spread for sampling."""
    calls = []

    def forward(params, token_ids):
        calls.append(np.asarray(token_ids).tolist())
        logits = np.zeros((len(token_ids), V), dtype=np.float32)
        logits[np.arange(len(token_ids)), (np.asarray(token_ids) + 1) % V] = params["confidence"]
        return logits

    return forward, calls


def test_generate_feeds_each_token_back(impl):
    forward, calls = counting_forward()
    got = impl(MODULE).generate(forward, {"confidence": 5.0}, [3, 4], max_new_tokens=5)
    assert got == [5, 6, 7, 8, 9], f"greedy on a 'next = last + 1' model should give [5..9], got {got}"
    assert calls[-1] == [3, 4, 5, 6, 7, 8], f"the last forward should see prompt + 4 new tokens, saw {calls[-1]}"


def test_generate_stops_after_eos(impl):
    forward, _ = counting_forward()
    got = impl(MODULE).generate(forward, {"confidence": 5.0}, [1], max_new_tokens=10, eos_id=4)
    assert got == [2, 3, 4], f"generation should stop right after emitting eos_id=4, got {got}"


@pytest.mark.parametrize("seed", SEEDS)
def test_sampling_is_reproducible_from_the_seed(impl, seed):
    forward, _ = counting_forward()
    generate = impl(MODULE).generate

    def run(s):
        return generate(forward, {"confidence": 1.0}, [0], 30, temperature=1.2, top_k=8, rng=np.random.default_rng(s))

    first, again, other = run(seed), run(seed), run(seed + 1000)
    assert first == again, f"the same seed gave different tokens (seed={seed}): draw only from the rng passed in"
    assert first != other, f"seeds {seed} and {seed + 1000} gave identical samples: is the rng used at all?"


@pytest.mark.parametrize("seed,extra", [(0, 0), (1, 7)])
def test_top_k_at_or_above_the_vocabulary_keeps_every_token(impl, seed, extra):
    """Clients send top_k=50 to models of any vocabulary: a k of V or more restricts nothing."""
    V = 9
    logits = np.random.default_rng(seed).normal(0, 0.3, size=(V,)).astype(np.float32)  # no token is rare
    rng = np.random.default_rng(300 + seed)
    sample_next = impl(MODULE).sample_next
    freq = frequencies(lambda: sample_next(logits, temperature=0.8, top_k=V + extra, rng=rng), V)
    np.testing.assert_allclose(
        freq, exact_softmax(logits / 0.8), atol=0.025, err_msg=f"top_k={V + extra} over V={V} tokens, seed={seed}"
    )


@pytest.mark.parametrize("seed,temperature", [(0, 0.5), (1, 2.0)])
def test_top_k_combined_with_temperature(impl, seed, temperature):
    """Both knobs at once: the k largest logits survive, then softmax(logit / T) over them alone."""
    V, k = 10, 4
    logits = np.random.default_rng(seed).normal(0, 1.0, size=(V,)).astype(np.float32)
    top = np.argsort(logits)[-k:]
    rng = np.random.default_rng(400 + seed)
    sample_next = impl(MODULE).sample_next
    freq = frequencies(lambda: sample_next(logits, temperature=temperature, top_k=k, rng=rng), V)
    expected = np.zeros(V)
    expected[top] = exact_softmax(logits[top] / temperature)
    np.testing.assert_allclose(freq, expected, atol=0.025, err_msg=f"top_k={k}, T={temperature}, seed={seed}")
