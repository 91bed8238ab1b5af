"""Quality and speed of a model on the course's held-out stories.

perplexity, greedy agreement between two models, decode tokens/s, and the draft/target figures
that training records in labkit/assets/training_report.json.
"""

import math

import torch
import torch.nn.functional as F

from . import corpus
from .checkpoint import load_tokenizer
from .timing import decode_step, measure


def pack(tokenizer, texts: list[str], bos: int = 1, eos: int = 2) -> torch.Tensor:
    """One int64 stream: <s> story </s> <s> story </s> ..."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.long)


def heldout(tokenizer, n_tokens: int = 16_384, seq: int = 512) -> torch.Tensor:
    """The first n_tokens of the held-out split as (n_tokens // seq, seq) windows."""
    ids = pack(tokenizer, corpus.valid_texts())[: n_tokens // seq * seq]
    return ids.view(-1, seq)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) over windows (N, T) int64."""
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(x[:, :-1]).float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def greedy_agreement(a, b, windows: torch.Tensor, batch: int = 4) -> float:
    """Fraction of positions where both models' argmax next tokens agree (teacher-forced)."""
    same, count = 0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        same += (a(x).argmax(-1) == b(x).argmax(-1)).sum().item()
        count += x.numel()
    return same / count


def decode_step_seconds(model, context: int = 128, repeats: int = 30) -> float:
    """Median seconds of one cached decode step (batch 1) at position `context`."""
    return measure(decode_step(model, context), repeats=repeats, warmup=5).median


def report_pair(target, draft, tokenizer) -> dict:
    windows = heldout(tokenizer)
    t_step, d_step = decode_step_seconds(target), decode_step_seconds(draft)
    return {
        "valid_perplexity_target": round(perplexity(target, windows), 3),
        "valid_perplexity_draft": round(perplexity(draft, windows), 3),
        "greedy_agreement_draft_vs_target": round(greedy_agreement(target, draft, windows), 4),
        "decode_step_ms_target": round(t_step * 1e3, 3),
        "decode_step_ms_draft": round(d_step * 1e3, 3),
        "step_cost_ratio_draft_over_target": round(d_step / t_step, 3),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    """python -m labkit.quality: re-measure the tiny pair and update training_report.json."""
    import json

    from . import ASSETS, DRAFT, TARGET
    from .model import from_pretrained

    report_file = ASSETS / "training_report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    report.update(report_pair(from_pretrained(TARGET), from_pretrained(DRAFT), load_tokenizer(TARGET)))
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
