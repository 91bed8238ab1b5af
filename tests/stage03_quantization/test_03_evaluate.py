"""Evaluation: KL divergence and top-1 agreement against the float baseline, honest weight bytes,
and the deploy gate's verdict."""

import pytest
import torch
import torch.nn.functional as F

from labkit.testing import FP32_MARGIN, random_labkit_llama, random_tokens

MOD = "stage03_quantization.evaluate"
SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
def test_divergence_is_kl_and_top1_agreement(impl, seed):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(3, 17, 50, generator=g) * 3
    cand = ref + torch.randn(3, 17, 50, generator=g)
    kl, agreement = impl(MOD).divergence(ref, cand)
    # torch's kl_div(input=log q, target=log p, log_target) is Σ p (log p - log q)
    expected_kl = F.kl_div(cand.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    assert kl == pytest.approx(expected_kl.item(), rel=1e-4), f"seed={seed}: KL(p_ref || p) mismatch"
    assert agreement == pytest.approx((ref.argmax(-1) == cand.argmax(-1)).float().mean().item()), f"seed={seed}"
    assert impl(MOD).divergence(ref, ref) == pytest.approx((0.0, 1.0), abs=1e-6), f"seed={seed}: self-divergence"


@pytest.mark.in_process("the learner's code changes the test's model in place")
def test_weight_bytes_after_int8_counts_codes_scales_and_float_rest(impl):
    model = random_labkit_llama(0, tie_word_embeddings=True)
    impl("stage03_quantization.quant_linear").quantize_model(model, "int8")
    c = model.config
    linear_shapes = [
        (c.num_attention_heads * c.head_dim, c.hidden_size),
        (c.num_key_value_heads * c.head_dim, c.hidden_size),
    ]
    linear_shapes += [linear_shapes[1], (c.hidden_size, c.num_attention_heads * c.head_dim)]
    linear_shapes += [(c.intermediate_size, c.hidden_size)] * 2 + [(c.hidden_size, c.intermediate_size)]
    per_layer = sum(o * i + 4 * o for o, i in linear_shapes)  # int8 codes + one fp32 scale per output row
    norms = 4 * c.hidden_size * (2 * c.num_hidden_layers + 1)
    embedding = 4 * c.vocab_size * c.hidden_size  # tied: lm_head is the same tensor, counted once
    expected = c.num_hidden_layers * per_layer + norms + embedding
    assert impl(MOD).weight_bytes(model) == expected, f"expected {expected} bytes, got {impl(MOD).weight_bytes(model)}"


def test_evaluate_against_reference(impl):
    mod = impl(MOD)
    model = random_labkit_llama(1)
    windows = random_tokens(1, 40, model.config.vocab_size, batch=3)
    report = mod.evaluate(model, windows, reference=model, decode_repeats=0)
    assert report.kl == pytest.approx(0.0, abs=1e-6) and report.top1_agreement == 1.0, (
        "a model vs itself: KL 0, agree 1"
    )
    noisy = random_labkit_llama(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    report = mod.evaluate(noisy, windows, reference=model, decode_repeats=0)
    assert report.kl > 1e-4 and report.top1_agreement < 1.0, f"perturbed weights must show up: {report}"


@pytest.mark.parametrize("n", [5, 7])
def test_evaluate_weights_a_short_last_batch_by_its_windows(impl, n):
    """evaluate runs the windows in batches; with n not a multiple of the batch the last one is short, and the
    KL and agreement must still be the means over all n windows' positions, as if computed in one pass."""
    mod = impl(MOD)
    model, noisy = random_labkit_llama(2), random_labkit_llama(2)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(n)) * 0.05)
    windows = random_tokens(n, 24, model.config.vocab_size, batch=n)
    report = mod.evaluate(noisy, windows, reference=model, decode_repeats=0)
    with torch.no_grad():
        ref, cand = model(windows).float(), noisy(windows).float()
    kl = F.kl_div(cand.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    agreement = (ref.argmax(-1) == cand.argmax(-1)).float().mean()
    # Batches of another size sum in another order: a position whose top two logits lie within FP32_MARGIN may
    # pick the other token there, moving the mean by 1 / positions; a mean of per-batch means is off by more.
    top2 = torch.stack([ref.topk(2, -1).values, cand.topk(2, -1).values])
    slack = ((top2[..., 0] - top2[..., 1]) < FP32_MARGIN).any(0).float().mean().item()
    assert report.kl == pytest.approx(kl.item(), rel=1e-4), f"n={n} windows: mean KL over every position"
    assert report.top1_agreement == pytest.approx(agreement.item(), abs=slack + 1e-6), (
        f"n={n} windows: agreement over every position, not a mean of per-batch means"
    )


def report(impl, ppl: float, agreement: float):
    return impl(MOD).Report(perplexity=ppl, weight_bytes=1, tokens_per_s=1.0, kl=0.0, top1_agreement=agreement)


@pytest.mark.parametrize(
    "ppl,agreement,passes",
    [(10.05, 0.99, True), (10.09, 0.951, True), (10.2, 0.99, False), (10.05, 0.9, False), (11.0, 0.5, False)],
)
def test_quality_gate_verdict(impl, ppl, agreement, passes):
    base = report(impl, 10.0, 1.0)
    verdict = impl(MOD).quality_gate(
        base, report(impl, ppl, agreement), max_ppl_increase_pct=1.0, max_top1_disagreement=0.05
    )
    assert verdict.passed is passes, f"ppl 10 -> {ppl}, agreement {agreement}: expected passed={passes}, {verdict}"
    assert len(verdict.reasons) == 2, f"one reason per check (perplexity, top-1), got {verdict.reasons}"
    blocked = [r for r in verdict.reasons if r.startswith("BLOCK")]
    assert len(blocked) == (ppl > 10.1) + (agreement < 0.95), f"each failed check says BLOCK: {verdict.reasons}"


def test_quality_gate_bounds_are_inclusive(impl):
    """'At most' the bound passes: a candidate exactly on both bounds ships (values exact in binary)."""
    verdict = impl(MOD).quality_gate(
        report(impl, 4.0, 1.0), report(impl, 5.0, 0.75), max_ppl_increase_pct=25.0, max_top1_disagreement=0.25
    )
    assert verdict.passed, f"perplexity +25 % against a 25 % bound and 25 % disagreement against 0.25 pass: {verdict}"
    assert all(r.startswith("ok: ") for r in verdict.reasons), f"both checks are ok: {verdict.reasons}"
