"""Measure a quantized model against its float baseline, and decide whether it may ship.

Perplexity and decode speed come from labkit.quality; what this module adds is the comparison
with the baseline (KL divergence and top-1 agreement of the next-token distributions) and the
deploy gate of the serving guide: a candidate passes only if every check is within its bound.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from labkit.quality import decode_step_seconds, perplexity


@dataclass
class Report:
    perplexity: float
    weight_bytes: int
    tokens_per_s: float
    kl: float = 0.0  # mean KL(baseline || model) per position, nats
    top1_agreement: float = 1.0  # fraction of positions where the argmax next token matches the baseline


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the state dict (parameters and persistent buffers such as quantized codes and scales),
    a tied embedding/lm_head counted once. Caches such as the RoPE tables are not weights."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(p_ref || p) over positions and the top-1 agreement, from logits (..., V).

    KL = Σ_v p_ref(v) (log p_ref(v) - log p(v)), computed in float32 from log-softmaxes.
    """
    ref = F.log_softmax(reference_logits.float(), -1)
    cand = F.log_softmax(logits.float(), -1)
    kl = (ref.exp() * (ref - cand)).sum(-1).mean().item()
    agreement = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
    return kl, agreement


@torch.no_grad()
def evaluate(
    model: nn.Module, windows: torch.Tensor, reference: nn.Module | None = None, decode_repeats: int = 10
) -> Report:
    """Perplexity on `windows` (N, T), weight bytes, decode tokens/s (batch 1, 64-token context),
    and, given the float `reference`, KL and top-1 agreement against it on the same windows.
    decode_repeats=0 skips the speed measurement (tokens_per_s = nan)."""
    ppl = perplexity(model, windows)
    speed = 1 / decode_step_seconds(model, context=64, repeats=decode_repeats) if decode_repeats else float("nan")
    report = Report(ppl, weight_bytes(model), speed)
    if reference is not None:
        batches = windows.split(4)
        stats = [divergence(reference(w), model(w)) for w in batches]
        report.kl = sum(len(w) * kl for w, (kl, _) in zip(batches, stats, strict=True)) / len(windows)
        report.top1_agreement = sum(len(w) * a for w, (_, a) in zip(batches, stats, strict=True)) / len(windows)
    return report


def quality_gate(
    baseline: Report, candidate: Report, max_ppl_increase_pct: float = 1.0, max_top1_disagreement: float = 0.05
) -> Verdict:
    """Pass iff the candidate's perplexity is at most max_ppl_increase_pct % above the baseline's and
    its top-1 disagreement with the baseline (1 - top1_agreement) is at most max_top1_disagreement.
    Each of the two checks adds one reason naming the measured value and the bound, starting with
    "ok: " if it passed and "BLOCK: " if it failed."""
    increase = 100 * (candidate.perplexity / baseline.perplexity - 1)
    disagreement = 1 - candidate.top1_agreement
    checks = [
        (increase <= max_ppl_increase_pct, f"perplexity {baseline.perplexity:.3f} -> {candidate.perplexity:.3f} "
         f"({increase:+.2f} %, bound +{max_ppl_increase_pct} %)"),
        (disagreement <= max_top1_disagreement, f"top-1 disagreement {disagreement:.2%} "
         f"(bound {max_top1_disagreement:.2%})"),
    ]  # fmt: skip
    reasons = [("ok: " if ok else "BLOCK: ") + text for ok, text in checks]
    return Verdict(all(ok for ok, _ in checks), reasons)
