"""labkit.testing's margin rule: the helpers graded tests use to compare two paths that round differently."""

import pytest
import torch

from labkit.testing import assert_decisive


def test_assert_decisive_checks_that_each_token_is_the_argmax_not_only_the_gap():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert_decisive([1, 0], logits, 1.0, "right")
    with pytest.raises(AssertionError, match=r"token 0 is 2, but its logits' maximum is token 1, 4 higher"):
        assert_decisive([2, 0], logits, 1.0, "swapped")  # the gap is 4 either way: only the argmax tells
    with pytest.raises(AssertionError, match=r"token 1 \(0\) leads by 3 only"):
        assert_decisive([1, 0], logits, 3.0, "near-tie")
