"""§7 Medusa decoding end to end: the target's own greedy tokens (HF generate), several per target forward.

Heads: random ones (mostly wrong guesses), oracle heads that know the greedy continuation (so whole
paths are accepted and the cache must be compacted right), and the course's trained heads on the tiny target.
"""

import math

import pytest
import torch
from stage06_medusa_helpers import OracleHeads

import labkit
from labkit import medusa
from labkit.testing import (
    FP32_MARGIN,
    LLAMA_CONFIGS,
    assert_decisive,
    assert_greedy_within,
    assert_hf_greedy,
    greedy_logits,
    hf_from_labkit,
    hf_greedy,
    labkit_from_hf,
    random_family,
    random_llama,
    random_tokens,
)

pytestmark = pytest.mark.in_process("the learner's code changes the test's KV cache in place")

MEDUSA = "stage06_speculative.medusa"
NO_EOS = 10**6
CASES = [(name, seed) for seed, name in enumerate(LLAMA_CONFIGS)]


def random_heads(target, num_heads: int, seed: int) -> medusa.MedusaHeads:
    heads = medusa.attach(target, num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads.eval()


def count_layer0(model):
    calls = []
    return calls, model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))


@pytest.mark.parametrize(("name", "seed"), CASES)
def test_medusa_generate_equals_hf_greedy_with_random_heads(impl, name, seed):
    m = impl(MEDUSA)
    hf = random_llama(seed, **LLAMA_CONFIGS[name], eos_token_id=NO_EOS)
    target = labkit_from_hf(hf)
    prompt = random_tokens(seed, 7 + 2 * seed, 97).tolist()
    calls, hook = count_layer0(target)
    try:
        got, stats = m.medusa_generate(target, random_heads(target, 3 + seed % 2, seed), prompt, 33)
    finally:
        hook.remove()
    # the tree verifies many tokens in one forward, summing in other shapes than HF's one token at a time
    assert_hf_greedy(got, hf, prompt, 33, FP32_MARGIN, f"{name} seed={seed}: Medusa output")
    assert stats.generated == 33, f"{name} seed={seed}: stats.generated={stats.generated}, expected 33"
    assert len(calls) == stats.target_forwards, (
        f"{name} seed={seed}: {len(calls)} target forwards but stats count {stats.target_forwards}: one per round"
    )


@pytest.mark.parametrize("family", ["llama3.2-tied", "qwen2-tied", "qwen3-bias-untied"])
def test_medusa_generate_equals_hf_greedy_on_other_families(impl, family):
    """Scaled RoPE, q/k/v biases, q/k norms: the tree's positions and masks must survive each."""
    seed = 50 + len(family)
    hf, _ = random_family(family, seed=seed, eos_token_id=NO_EOS)
    target, V = labkit_from_hf(hf), hf.config.vocab_size
    prompt = random_tokens(seed, 9, V).tolist()
    got, _ = impl(MEDUSA).medusa_generate(target, medusa.attach(target, 3), prompt, 25)  # untrained: lm_head's guess
    assert_hf_greedy(got, hf, prompt, 25, FP32_MARGIN, f"{family} seed={seed}: Medusa output")


def oracle_run(impl, name: str, seed: int, n: int, rank_of, paths):
    hf = random_llama(seed, **LLAMA_CONFIGS[name], eos_token_id=NO_EOS)
    target = labkit_from_hf(hf)
    prompt = random_tokens(seed, 6 + seed, 97).tolist()
    want = hf_greedy(hf, prompt, n)
    # oracle heads follow HF's tokens, and the tests count forwards: exact only where HF's choices are decisive
    assert_decisive(want, greedy_logits(hf, prompt, want), FP32_MARGIN, f"{name} seed={seed}: HF greedy")
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt + want]), output_hidden_states=True).hidden_states[-1][0]
    heads = OracleHeads(prompt + want, hidden, 97, 4, rank_of, seed)
    calls, hook = count_layer0(target)
    try:
        got, stats = impl(MEDUSA).medusa_generate(target, heads, prompt, n, paths=paths)
    finally:
        hook.remove()
    return got, want, stats, len(calls)


@pytest.mark.parametrize(("name", "seed"), CASES)
def test_perfect_heads_accept_the_whole_depth_every_round(impl, name, seed):
    """Heads always right: every round keeps all 4 guesses plus the bonus, so 1 + ceil((n - 1) / 5) forwards."""
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]
    got, want, stats, forwards = oracle_run(impl, name, seed, 31, lambda t, k: 0, paths)
    assert got == want, f"{name} seed={seed}: output differs from the target's greedy decoding"
    expected = 1 + math.ceil(30 / 5)
    assert forwards == stats.target_forwards == expected, (
        f"{name} seed={seed}: heads that are always right need {expected} target forwards (prefill + rounds of "
        f"5 tokens); ran {forwards}, stats say {stats.target_forwards}"
    )
    assert stats.accepted == 4 * (expected - 1), f"{name} seed={seed}: every round accepts 4 nodes: {stats}"


@pytest.mark.parametrize(("name", "seed"), CASES)
def test_oracle_heads_with_second_choices_and_misses(impl, name, seed):
    """Right guesses at rank 0 or 1, sometimes missing: branches other than the first are accepted."""
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0), (1, 0, 1), (0, 0, 0, 0)]
    ranks = torch.randint(0, 3, (200, 4), generator=torch.Generator().manual_seed(seed)).tolist()
    rank_of = lambda t, k: [0, 1, 40][ranks[t][k - 1]]  # noqa: E731
    got, want, stats, forwards = oracle_run(impl, name, seed, 40, rank_of, paths)
    assert got == want, f"{name} seed={seed}: output differs from the target's greedy decoding"
    assert forwards == stats.target_forwards, f"{name} seed={seed}: {forwards} forwards, stats {stats.target_forwards}"
    assert stats.target_forwards < 30, (
        f"{name} seed={seed}: oracle heads right at rank 0 or 1 two times in three should save forwards; {stats}"
    )


@pytest.mark.parametrize(("name", "seed"), [("mha-untied", 0), ("gqa4-3layers", 1), ("mqa-odd", 2)])
def test_generation_stops_right_after_eos(impl, name, seed):
    hf = random_llama(seed, **LLAMA_CONFIGS[name], eos_token_id=NO_EOS)
    target = labkit_from_hf(hf)
    prompt = random_tokens(seed + 4, 8, 97).tolist()
    free = hf_greedy(hf, prompt, 30)
    eos = next(t for t in free if free.index(t) >= 6 + seed)  # first seen mid-run, after some rounds
    want = free[: free.index(eos) + 1]
    got, stats = impl(MEDUSA).medusa_generate(target, random_heads(target, 4, seed), prompt, 30, eos_id=eos)
    what = f"{name} seed={seed} eos={eos}: the greedy tokens up to and including the first EOS"
    assert_greedy_within(got, want, lambda: greedy_logits(hf, prompt, want), FP32_MARGIN, what)
    assert stats.generated == len(got), f"{name} seed={seed}: stats.generated={stats.generated}, kept {len(got)}"


@pytest.mark.parametrize(("name", "seed"), [("mha-untied", 0), ("mqa-odd", 2)])
def test_eos_inside_an_accepted_path_ends_generation_there(impl, name, seed):
    """Perfect heads accept 5 tokens a round, so the EOS lands inside a round: the rest is dropped."""
    hf = random_llama(seed, **LLAMA_CONFIGS[name], eos_token_id=NO_EOS)
    target = labkit_from_hf(hf)
    prompt = random_tokens(seed + 4, 8, 97).tolist()
    free = hf_greedy(hf, prompt, 30)
    eos = next(t for t in free if free.index(t) >= 7 and free.index(t) % 5 != 0)  # not a round's last token
    want = free[: free.index(eos) + 1]
    assert_decisive(want, greedy_logits(hf, prompt, want), FP32_MARGIN, f"{name} seed={seed}: HF greedy")  # oracle
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt + free]), output_hidden_states=True).hidden_states[-1][0]
    heads = OracleHeads(prompt + free, hidden, 97, 4, lambda t, k: 0, seed)
    got, stats = impl(MEDUSA).medusa_generate(target, heads, prompt, 30, eos_id=eos)
    assert got == want, f"{name} seed={seed} eos={eos}: expected the greedy tokens up to and including the first EOS"
    assert stats.target_forwards == 1 + math.ceil((len(want) - 1) / 5), f"{name} seed={seed}: {stats}"


def test_tiny_target_with_trained_heads_is_greedy_and_accepts_several_tokens(impl):
    from labkit.checkpoint import load_tokenizer
    from labkit.model import from_pretrained
    from labkit.quality import heldout

    target = from_pretrained(labkit.TARGET)
    heads = medusa.load(labkit.ASSETS / "tiny-target-medusa", target)
    window = heldout(load_tokenizer(labkit.TARGET), n_tokens=1024, seq=512)[1]
    prompt = window[:48].tolist()
    got, stats = impl(MEDUSA).medusa_generate(target, heads, prompt, 64)
    hf_target = hf_from_labkit(target)
    assert_hf_greedy(got, hf_target, prompt, 64, FP32_MARGIN, "tiny target: Medusa output")
    assert stats.tokens_per_target_forward > 1.5, f"the trained heads should give > 1.5 tokens per forward: {stats}"
