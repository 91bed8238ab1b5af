"""§3 of lab7.ipynb on the real model: SmolLM2-135M's prefill split over 2 and 3 gloo ranks by ring attention
gives Hugging Face's logits at every position of the prompt, contiguous and zig-zag, on lengths that divide
by neither p."""

import pytest
import torch
import torch.distributed as dist

from labkit.checkpoint import require_real_model
from labkit.distributed import launch
from labkit.testing import real_hf, real_ids

pytestmark = [pytest.mark.real, pytest.mark.dist, pytest.mark.slow]
# 30 float32 layers summed in another order than HF's (stage 01's real-model tolerance): a wrong mask,
# a block seen twice or a merge without rescaling is off by whole units.
TOLERANCE = 3e-4


def cp_logits(folder: str, ids: torch.Tensor, scheme: str) -> dict:
    """Worker: this rank's share of the real model's prefill."""
    from labkit.impl import load
    from labkit.model import from_pretrained

    # from_pretrained first builds a random Llama whose every weight the strict load overwrites: skip that init.
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda self: None
    out = load("stage07_tensor_parallel.context.cp_model").cp_prefill(from_pretrained(folder), ids, scheme)
    return {"positions": out["positions"], "logits": out["logits"], "rank": dist.get_rank()}


@pytest.mark.parametrize("p,T,scheme", [(2, 301, "zigzag"), (3, 262, "contiguous")])
def test_cp_gives_hf_logits_on_the_real_model(impl, p, T, scheme):
    text = real_ids()
    ids = text.repeat(T // len(text) + 1)[:T]  # the course's real text, repeated to T tokens
    with torch.no_grad():
        want = real_hf()(ids[None]).logits[0]
    per_rank = launch(cp_logits, p, str(require_real_model()), ids, scheme, timeout=240)
    held = torch.cat([r["positions"] for r in per_rank]).sort().values
    assert torch.equal(held, torch.arange(T)), (
        f"CP={p}, {scheme}: the ranks hold {held.tolist()[:20]}..., not 0 .. {T - 1}"
    )
    for r in per_rank:
        delta = (r["logits"] - want[r["positions"]]).abs().max().item()
        assert delta < TOLERANCE, f"CP={p} rank {r['rank']}, {scheme}, T={T}: logits differ from HF's by {delta:.2e}"
