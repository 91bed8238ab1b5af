"""Prompt-lookup (n-gram) drafting: no draft model. If the text's last few tokens occurred before,
guess that what followed them then follows them again. Pays off when the output copies its
input: summaries, quotes, code edits, repeated passages.
"""

from labkit.model import Llama

from .speculative import SpecStats, run, verify_greedy


def lookup_candidates(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to k tokens copied from earlier in `tokens`.

    For n = max_ngram down to 1: find the most recent earlier occurrence of the last n tokens
    (starting before len(tokens) - n) that has at least one token after it, and return the up to
    k tokens that follow it. [] when no suffix of length 1..max_ngram occurred before.
    """
    raise NotImplementedError("stage06: lookup_candidates — see lab.ipynb §8")


def lookup_decode(
    target: Llama, prompt: list[int], max_new_tokens: int, k: int = 4, max_ngram: int = 3, eos_id: int | None = None
) -> tuple[list[int], SpecStats]:
    """Greedy decoding with n-gram drafts verified by the target: the target's own greedy tokens."""
    cache = target.new_cache(1, len(prompt) + max_new_tokens + 1)

    def step(tokens, k_now):
        drafted = lookup_candidates(tokens, k_now, max_ngram) if k_now else []
        return drafted, verify_greedy(target, cache, tokens, drafted)

    return run(step, prompt, max_new_tokens, k, eos_id)
