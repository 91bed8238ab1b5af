"""Helpers several stage-07 fleet tests share: the reference every fleet's output is checked against.

The reference is labkit's own cached greedy decoding (`Llama.generate`, which tests/meta checks against
Hugging Face), never the stage's solution.
"""

from labkit.device import pin_threads


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The n tokens greedy decoding appends to `prompt` (EOS does not stop it, as max_tokens does not),
    on one thread: the replicas use the other core."""
    with pin_threads(1):
        return model.generate(list(prompt), n, stop_at_eos=False)
