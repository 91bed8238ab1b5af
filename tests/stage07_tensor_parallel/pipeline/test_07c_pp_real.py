"""§3 of lab6.ipynb on the real model: SmolLM2-135M's 30 layers split over 2 and 3 gloo ranks, by a partition
balanced on each unit's weights, decode Hugging Face's greedy tokens, on prompts of two lengths."""

import pytest
import torch.distributed as dist
from pipeline_helpers import weight_costs

from labkit.checkpoint import load_tokenizer, read_config, require_real_model
from labkit.distributed import launch
from labkit.model import Config
from labkit.testing import REAL_MARGIN, REAL_TEXT, assert_greedy_within, hf_greedy_logits, real_hf

pytestmark = [pytest.mark.real, pytest.mark.dist, pytest.mark.slow]
NEW_TOKENS = 6


def pp_greedy(folder: str, prompt: list[int]) -> dict:
    """Worker: this rank's stage of the real model, greedy decoding."""
    import torch

    from labkit.impl import load
    from labkit.model import from_pretrained

    partition = load("stage07_tensor_parallel.pipeline.partition")
    stage_mod = load("stage07_tensor_parallel.pipeline.stage")
    generate = load("stage07_tensor_parallel.pipeline.generate")
    # from_pretrained first builds a random Llama whose every weight the strict load overwrites: at 135 M
    # parameters that init costs seconds per rank, so this process skips it.
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda self: None
    model = from_pretrained(folder)
    bounds = partition.balanced_partition(weight_costs(model.config), dist.get_world_size())
    stage = stage_mod.PipelineStage(model, bounds, dist.get_rank())
    del model  # the stage keeps its own units only
    return {"bounds": bounds, "tokens": generate.pipeline_generate(stage, prompt, NEW_TOKENS, timeout_s=60)}


@pytest.mark.parametrize("p,chars", [(2, 120), (3, 331)])
def test_pp_gives_hf_greedy_tokens_on_the_real_model(impl, p, chars):
    folder = require_real_model()
    prompt = load_tokenizer(folder).encode(REAL_TEXT[-chars:]).ids
    expected, logits = hf_greedy_logits(real_hf(), prompt, NEW_TOKENS)
    per_rank = launch(pp_greedy, p, str(folder), prompt, timeout=240)
    units = Config.from_hf(read_config(folder)).num_hidden_layers + 2
    bounds = per_rank[0]["bounds"]
    assert bounds[-1][1] == units, f"PP={p}: the partition {bounds} does not end at the LM head (unit {units - 1})"
    for rank in (0, p - 1):
        assert_greedy_within(
            per_rank[rank]["tokens"], expected, logits, REAL_MARGIN,
            f"PP={p} rank {rank} ({bounds}), a {len(prompt)}-token prompt: HF generate",
        )  # fmt: skip
