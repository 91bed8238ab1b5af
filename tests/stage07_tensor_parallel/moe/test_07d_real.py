"""§4 of lab8.ipynb on the real model: SmolLM2-135M's 30 MLPs MoEfied into 8 experts each (routers fitted on
the course's chat prompts) give transformers' dense logits with every expert chosen, and with 2 of 8 the
load a real router puts on its experts is uneven (the imbalance expert parallelism must absorb)."""

import pytest
import torch

from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.model import from_pretrained
from labkit.testing import REAL_MARGIN, real_hf, real_ids

pytestmark = [pytest.mark.real, pytest.mark.slow]
MODULE = "stage07_tensor_parallel.moe.moefy"
EXPERTS = 8


@pytest.fixture(scope="module")
def moefied(impl):
    mod = impl(MODULE)
    folder = require_real_model()
    calibration = mod.chat_ids(load_tokenizer(folder), 8)
    return mod, mod.moefy(from_pretrained(folder).eval(), EXPERTS, calibration)


def test_moefied_smollm2_with_every_expert_equals_hf(moefied):
    _, model = moefied
    ids = real_ids()[None]
    with torch.no_grad():
        got, want = model(ids), real_hf()(ids).logits
    delta = float((got - want).abs().max())
    assert delta <= REAL_MARGIN, (
        f"MoEfied SmolLM2, k = E = {EXPERTS}: logits differ from transformers' dense model by {delta:.2e} over "
        f"{ids.shape[1]} tokens; the experts must partition each MLP's 1536 neurons"
    )


def test_moefied_smollm2_load_is_uneven_at_k2(moefied):
    mod, model = moefied
    mod.set_k(model, 2)
    ids = mod.chat_ids(load_tokenizer(require_real_model()), 8, heldout=True)
    with torch.no_grad():
        model(ids)
    load = torch.stack([layer.mlp.load for layer in model.model.layers]).float()  # (layers, E)
    assert torch.equal(load.sum(1), torch.full((load.shape[0],), 2.0 * ids.shape[1])), "each token counts twice"
    busiest = float((load.max(1).values / load.mean(1)).max())
    mod.set_k(model, EXPERTS)
    assert busiest > 1.3, (
        f"k = 2 of {EXPERTS} on held-out chat prompts: the busiest expert of any layer got only {busiest:.2f}x its "
        "balanced share; the fitted routers should follow the real, uneven use of the neuron clusters"
    )
