"""Stage code that re-implements part of labkit's forward refuses, by field name, the checkpoint
extras it does not implement (issue 13). The refusals are given code, the same in both trees, so
they are checked here rather than graded."""

import pytest
import torch

from labkit.checkpoint import CheckpointError
from labkit.testing import labkit_from_hf, random_family

SEED = 61


def model_of(name, **overrides):
    hf, _ = random_family(name, seed=SEED, **overrides)
    return labkit_from_hf(hf)


@pytest.mark.parametrize("name,field", [("qwen3", "qk_norm"), ("llama3.2-tied", "rope_scaling")])
def test_stage02_forward_refuses(impl, name, field):
    forward = impl("stage02_kv_cache.cached_llama").forward
    with pytest.raises(CheckpointError, match=f"stage02's cached_llama does not implement {field}"):
        forward(model_of(name), torch.zeros(1, 4, dtype=torch.long))


def test_stage04_engine_refuses_a_window_a_sequence_can_outgrow(impl):
    engine = impl("stage04_batching.engine")
    with pytest.raises(CheckpointError, match="sliding_window=5"):
        engine.LLMEngine(model_of("mistral-window"), num_blocks=16, block_size=4)
    engine.LLMEngine(model_of("mistral-window", sliding_window=64), num_blocks=16, block_size=4)  # never bites


@pytest.mark.parametrize("name,field", [("qwen2-tied", "attention_bias"), ("qwen3", "qk_norm")])
def test_stage07_tp_model_refuses(impl, name, field):
    tp = impl("stage07_tensor_parallel.tp_model")
    with pytest.raises(CheckpointError, match=f"TPLlama does not implement {field}"):
        tp.TPLlama(model_of(name).config, rank=0, world_size=2)


def test_stage06_medusa_refuses_a_window_a_sequence_can_outgrow(impl):
    medusa = impl("stage06_speculative.medusa")
    heads = lambda h: torch.zeros(2, 97)  # noqa: E731 (never reached: the prefill refuses first)
    with pytest.raises(CheckpointError, match="stage06 medusa does not implement sliding_window=5"):
        medusa.medusa_generate(model_of("mistral-window"), heads, [3, 4, 5], 8)


@pytest.mark.parametrize(
    "paths,message",
    [([(0,), (0, 1, 0)], r"no parent \(0, 1\)"), ([(0,), (-1,)], "ranks >= 0"), ([(), (0,)], "non-empty")],
)
def test_stage06_medusa_tree_paths_are_checked(impl, paths, message):
    with pytest.raises(ValueError, match=message):
        impl("stage06_speculative.medusa").sort_paths(paths)
