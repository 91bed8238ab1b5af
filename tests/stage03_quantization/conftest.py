"""Shared fixtures for the stage-03 tests: one torch thread, small random-init labkit models."""

import pytest

from labkit.device import pin_threads
from labkit.model import Config, Llama, init_weights


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are small: a second intra-op thread only adds OpenMP synchronisation, which
    stalls badly when the CPU is shared. Restored after each test."""
    with pin_threads(1):
        yield


def _make_llama(seed: int = 0, **overrides) -> Llama:
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    kw.update(overrides)
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    return init_weights(Llama(Config(**kw)), seed=seed, std=0.08).float().eval()


@pytest.fixture
def make_llama():
    """make_llama(seed, **Config fields) -> a random-init labkit Llama in float32 (std 0.08)."""
    return _make_llama
