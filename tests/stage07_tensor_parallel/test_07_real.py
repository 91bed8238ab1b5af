"""§5–§7 on the real model: SmolLM2-135M's 9 query heads and 3 KV heads split over 3 gloo ranks give
Hugging Face's greedy tokens, and 2 ranks are refused because 9 heads (and 3 KV heads) do not split in two."""

import pytest
import torch.distributed as dist

from labkit.checkpoint import load_tokenizer, read_config, require_real_model
from labkit.distributed import launch
from labkit.model import Config
from labkit.testing import REAL_MARGIN, assert_greedy_within, hf_greedy_logits, real_hf

pytestmark = [pytest.mark.real, pytest.mark.dist, pytest.mark.slow]
QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 8


def tp_greedy(folder: str, prompt: list[int], n_new: int) -> list[int]:
    """Worker: this rank's shard of the real model, greedy decoding (every rank returns the same tokens)."""
    import torch

    from labkit.checkpoint import load_state_dict
    from labkit.impl import load

    tp = load("stage07_tensor_parallel.tp_model")
    config = Config.from_hf(read_config(folder))
    # TPLlama first builds the full-size Llama; its random init of 135 M parameters costs seconds per rank
    # and every weight is overwritten by the strict load below, so this process skips it.
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda self: None
    model = tp.TPLlama(config).eval()
    model.load_state_dict(tp.shard_state_dict(load_state_dict(folder), dist.get_rank(), dist.get_world_size(), config))
    return model.generate(prompt, n_new, stop_at_eos=False)


def test_tp3_gives_hf_greedy_tokens_on_the_real_model(impl):
    folder = require_real_model()
    prompt = load_tokenizer(folder).encode(QUESTION).ids
    expected, logits = hf_greedy_logits(real_hf(), prompt, NEW_TOKENS)
    per_rank = launch(tp_greedy, 3, str(folder), prompt, NEW_TOKENS, timeout=240)
    for rank, got in enumerate(per_rank):
        assert_greedy_within(got, expected, logits, REAL_MARGIN, f"TP=3 rank {rank} on {QUESTION!r}: HF generate")


def test_tp2_is_refused_on_the_real_model(impl):
    config = Config.from_hf(read_config(require_real_model()))
    with pytest.raises(ValueError, match="num_attention_heads") as refused:
        impl("stage07_tensor_parallel.tp_model").local_head_counts(config, 2)
    assert "9" in str(refused.value), f"the refusal should say how many heads do not divide by 2: {refused.value}"
