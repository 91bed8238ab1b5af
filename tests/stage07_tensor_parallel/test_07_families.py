"""TP=2 on real checkpoints' architectures (issue 13): greedy equal to HF generate.

TPLlama runs labkit's forward, so scaled RoPE and Mistral's window reach your TPAttention through
cos/sin and the mask. Its sharded layers have no biases and no qk-norm: checkpoints that need them
are refused (tests/meta/test_stage_refusals.py).
"""

import traceback

import pytest

from labkit.distributed import launch
from labkit.model import Config
from labkit.testing import FP32_MARGIN, assert_greedy_within, hf_greedy_logits, random_family, random_tokens

pytestmark = [pytest.mark.dist, pytest.mark.slow]
SEED = 51
FAMILIES = ["llama3.1-4x-layout", "llama3.2-tied", "mistral-window", "smollm2"]


def greedy_on_ranks(cases):
    """Worker: each family's TP greedy tokens on this rank (or the traceback)."""
    import torch.distributed as dist

    from labkit.impl import load

    tp = load("stage07_tensor_parallel.tp_model")
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (config, state, prompt) in cases.items():
        try:
            model = tp.TPLlama(config).eval()
            model.load_state_dict(tp.shard_state_dict(state, rank, p, config))
            out[name] = model.generate(prompt, 12, stop_at_eos=False)
        except Exception:
            out[name] = traceback.format_exc()
    return out


def test_tp2_greedy_equals_hf_on_each_family():
    cases, want = {}, {}
    for i, name in enumerate(FAMILIES):
        hf, _ = random_family(name, seed=SEED + i, vocab_size=104)  # divisible by 2 ranks
        config = Config.from_hf(hf.config.to_dict())
        prompt = random_tokens(SEED + i, 9, config.vocab_size).tolist()
        cases[name] = (config, {k: v.clone() for k, v in hf.state_dict().items()}, prompt)
        want[name] = hf_greedy_logits(hf, prompt, 12)
    results = launch(greedy_on_ranks, 2, cases, timeout=120)
    for rank, got in enumerate(results):
        for name in FAMILIES:
            what = f"{name}, rank {rank}: TP=2 greedy against HF (seed={SEED})"
            assert_greedy_within(got[name], *want[name], FP32_MARGIN, what)
