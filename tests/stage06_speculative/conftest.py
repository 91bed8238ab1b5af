"""Draft/target pairs for the stage-06 tests: random-init HF models sharing one vocabulary."""

import pytest
import torch

from labkit.device import pin_threads
from labkit.testing import LLAMA_CONFIGS, labkit_from_hf, random_llama

# HF's min_new_tokens hides EOS from the argmax, which a speculative run that ignores EOS does not
# do; an EOS id outside the vocabulary makes HF's references plain greedy decoding.
NO_EOS = 10**6


def make_pair(config: str, seed: int, **overrides):
    """(hf_target, hf_draft, target, draft): a target and a 1-layer draft of the same shape and vocabulary."""
    cfg = {**LLAMA_CONFIGS[config], "eos_token_id": NO_EOS, **overrides}
    hf_target = random_llama(seed, **cfg)
    hf_draft = random_llama(seed + 1000, **{**cfg, "num_hidden_layers": 1})
    return hf_target, hf_draft, labkit_from_hf(hf_target), labkit_from_hf(hf_draft)


class ForwardCounter:
    """Counts forward calls of a module (a structural check: one target forward per round)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


@pytest.fixture
def pair():
    """pair(config, seed) -> (hf_target, hf_draft, target, draft)."""
    return make_pair


@pytest.fixture
def count_forwards():
    counters = []

    def attach(module):
        counters.append(ForwardCounter(module))
        return counters[-1]

    yield attach
    for c in counters:
        c.handle.remove()


@pytest.fixture(autouse=True)
def one_thread():
    """Batch-1 decoding of tiny models gains nothing from intra-op threads, and on a shared 2-core
    machine their spin-waiting makes each small forward orders of magnitude slower."""
    with pin_threads(1):
        yield
