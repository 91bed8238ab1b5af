"""Helpers for the stage-04 tests: small random-init labkit models, prompts, the reference, a token counter.

References are labkit's contiguous-cache model (`Llama.generate`), which tests/meta checks against
Hugging Face, and plain PyTorch ops; never the stage's solution.
"""

import random

from labkit.model import Config, Llama, init_weights

# GQA ratios 1, 2, 4 and MQA, odd head counts, tied and untied embeddings.
CONFIGS = {
    "mha-untied": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=False),
    "gqa2-tied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4-3layers": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
    "mqa-odd": dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=False),
}


def make_model(seed: int = 0, vocab_size: int = 101, **overrides) -> Llama:
    """A random-init labkit Llama in float32 (std 0.08 so greedy argmax ties are rare)."""
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    kw.update(overrides)
    kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    return init_weights(Llama(Config(**kw)), seed=seed, std=0.08).float().eval()


def random_prompts(seed: int, n: int, lo: int, hi: int, vocab_size: int = 101) -> list[list[int]]:
    """n prompts of lengths in [lo, hi] with ids >= 3 (no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference(model: Llama, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each request generated alone with labkit's contiguous KV cache (greedy, stops at EOS)."""
    return [model.generate(p, n) for p, n in zip(prompts, max_tokens, strict=True)]


class TokenCounter:
    """Counts the token positions the model computes (a forward hook on the embedding)."""

    def __init__(self, model: Llama):
        self.tokens = 0
        self.calls = 0
        self.sizes: list[int] = []
        model.model.embed_tokens.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.tokens += args[0].numel()
        self.calls += 1
        self.sizes.append(args[0].numel())
