"""Helpers several stage-07 fleet tests share: the reference every fleet's output is checked against.

The reference is labkit's own cached greedy decoding (`Llama.generate`, which tests/meta checks against
Hugging Face), never the stage's solution.
"""

from labkit.device import pin_threads
from labkit.testing import FP32_MARGIN, assert_decisive, greedy_logits


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The n tokens greedy decoding appends to `prompt` (EOS does not stop it, as max_tokens does not),
    on one thread: the replicas use the other core. The fleet tests compare text, and replicas batch, so
    each token must lead the runner-up by more than FP32_MARGIN for an exact comparison to be sound."""
    with pin_threads(1):
        tokens = model.generate(list(prompt), n, stop_at_eos=False)
        assert_decisive(tokens, greedy_logits(model, prompt, tokens), FP32_MARGIN, f"greedy reference of {prompt}")
    return tokens
