"""Fixtures of the stage-04 tests (helpers live in stage04_helpers.py, a name no other stage uses)."""

import pytest
import torch

from labkit.device import pin_threads


@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level BPE (vocab 400) trained on a few course stories plus some multi-byte text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from labkit import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus.train_texts(300) + ["héllo wörld, ünïcode ✓ 日本語 ok"], trainer)
    return tok


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread is faster than two fighting over small matrices."""
    with pin_threads(1):
        torch.manual_seed(0)
        yield
