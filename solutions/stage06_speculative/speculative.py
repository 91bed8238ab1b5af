"""Speculative decoding with a draft and a target model, each with its own truncatable KV cache.

A round: the draft proposes k tokens one at a time; the target reads all of them in ONE forward
pass and scores k + 1 positions; we keep the drafts it agrees with plus one token of its own
(the bonus), then roll both caches back to what was kept.

Cache invariant between rounds (both models): the cache holds a prefix of `tokens` and never the
last token, so `tokens[cache.length:]` is exactly what the model still has to read.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.model import KVCache, Llama

from .sampling import accept_reject, sample, warp


@dataclass
class SpecStats:
    """What one speculative run did. A round is one target forward."""

    proposed: int = 0  # draft tokens offered to the target
    accepted: int = 0  # drafts the target kept
    rejected: int = 0  # rounds that ended on a rejected draft (the others accepted all they were offered)
    target_forwards: int = 0
    generated: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed."""
        return self.accepted / max(self.proposed, 1)

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability for the speedup formulas: each round is a run of
        Bernoulli(alpha) acceptances stopped by the first rejection, so alpha ≈ accepted / (accepted + rejected)."""
        return self.accepted / max(self.accepted + self.rejected, 1)

    @property
    def tokens_per_target_forward(self) -> float:
        return self.generated / max(self.target_forwards, 1)

    def record(self, drafted: list[int], new: list[int]) -> None:
        n = len(new) - 1  # the last new token is the target's own
        self.proposed += len(drafted)
        self.accepted += n
        self.rejected += n < len(drafted)
        self.target_forwards += 1


def feed(model: Llama, cache: KVCache, seq: list[int]) -> torch.Tensor:
    """Run `model` on the part of `seq` its cache has not read; logits (len(seq) - cache.length, V) float32."""
    return model(torch.tensor([seq[cache.length :]]), cache)[0].float()


@torch.inference_mode()
def propose_greedy(draft: Llama, cache: KVCache, tokens: list[int], k: int) -> list[int]:
    """The draft's k greedy next tokens after `tokens` (k >= 1).

    First roll the draft's cache back to at most len(tokens) - 1 positions (it may still hold drafts
    of the last round that the target rejected), read what is missing, then decode k tokens, one
    forward each. Afterwards the cache holds tokens + drafted[:-1].
    """
    cache.truncate(min(cache.length, len(tokens) - 1))
    logits = feed(draft, cache, tokens)[-1]
    drafted = [int(logits.argmax())]
    for _ in range(k - 1):
        logits = draft(torch.tensor([[drafted[-1]]]), cache)[0, -1]
        drafted.append(int(logits.argmax()))
    return drafted


@torch.inference_mode()
def verify_greedy(target: Llama, cache: KVCache, tokens: list[int], drafted: list[int]) -> list[int]:
    """One target forward over the unread tokens + drafted; keep the longest prefix of `drafted` that
    equals the target's own argmax, plus the target's argmax after it (the bonus).

    returns drafted[:n] + [bonus] (1 to k + 1 tokens); afterwards the target's cache holds
    tokens + drafted[:n] — the rejected drafts' keys and values are forgotten.
    """
    k = len(drafted)
    choice = feed(target, cache, tokens + drafted)[-(k + 1) :].argmax(dim=-1).tolist()
    n = 0
    while n < k and drafted[n] == choice[n]:
        n += 1
    cache.truncate(len(tokens) + n)
    return drafted[:n] + [choice[n]]


@torch.inference_mode()
def propose_sampled(
    draft: Llama,
    cache: KVCache,
    tokens: list[int],
    k: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Sample k draft tokens after `tokens` (k >= 1), each from warp(draft logits, temperature, top_p).

    Same cache handling as propose_greedy. returns (drafted, q) with q: (k, V) float32, row i the
    distribution drafted[i] was drawn from — the target's verification needs it.
    """
    cache.truncate(min(cache.length, len(tokens) - 1))
    logits = feed(draft, cache, tokens)[-1]
    drafted, q = [], []
    for i in range(k):
        q.append(warp(logits, temperature, top_p))
        drafted.append(sample(q[-1], generator))
        if i < k - 1:
            logits = draft(torch.tensor([[drafted[-1]]]), cache)[0, -1]
    return drafted, torch.stack(q)


@torch.inference_mode()
def verify_sampled(
    target: Llama,
    cache: KVCache,
    tokens: list[int],
    drafted: list[int],
    q: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """One target forward; accept/reject the drafts with accept_reject, then draw one more token
    from the distribution it returns. Uniforms and the final draw both come from `generator`.

    q: (k, V) from propose_sampled (k may be 0: then this is plain sampling from the target).
    returns drafted[:n] + [next]; afterwards the target's cache holds tokens + drafted[:n].
    """
    k = len(drafted)
    p = warp(feed(target, cache, tokens + drafted)[-(k + 1) :], temperature, top_p)
    u = torch.rand(k, generator=generator)
    n, dist = accept_reject(p, q, torch.tensor(drafted, dtype=torch.long), u)
    cache.truncate(len(tokens) + n)
    return drafted[:n] + [sample(dist, generator)]


Step = Callable[[list[int], int], tuple[list[int], list[int]]]


def run(step: Step, prompt: list[int], max_new_tokens: int, k: int, eos_id: int | None = None):
    """The loop every drafter shares. step(tokens, k_now) -> (drafted, new) does one round.

    k_now shrinks near the end so a round never overshoots max_new_tokens. Stops after eos_id if given.
    returns (new token ids, SpecStats).
    """
    stats = SpecStats()
    start = time.perf_counter()
    tokens = list(prompt)
    while (done := len(tokens) - len(prompt)) < max_new_tokens:
        drafted, new = step(tokens, min(k, max_new_tokens - done - 1))
        stats.record(drafted, new)
        tokens += new
        if eos_id is not None and eos_id in new:
            del tokens[len(tokens) - len(new) + new.index(eos_id) + 1 :]
            break
    stats.seconds = time.perf_counter() - start
    out = tokens[len(prompt) :]
    stats.generated = len(out)
    return out, stats


def greedy_speculative(
    target: Llama, draft: Llama, prompt: list[int], max_new_tokens: int, k: int = 4, eos_id: int | None = None
) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding: the same tokens as the target's own greedy decoding, in fewer target forwards."""
    size = len(prompt) + max_new_tokens + 1
    target_cache, draft_cache = target.new_cache(1, size), draft.new_cache(1, size)

    def step(tokens, k_now):
        drafted = propose_greedy(draft, draft_cache, tokens, k_now) if k_now else []
        return drafted, verify_greedy(target, target_cache, tokens, drafted)

    return run(step, prompt, max_new_tokens, k, eos_id)


def speculative_sample(
    target: Llama,
    draft: Llama,
    prompt: list[int],
    max_new_tokens: int,
    k: int = 4,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> tuple[list[int], SpecStats]:
    """Speculative sampling: tokens distributed exactly as sampling from warp(target logits, temperature, top_p)."""
    size = len(prompt) + max_new_tokens + 1
    target_cache, draft_cache = target.new_cache(1, size), draft.new_cache(1, size)
    generator = torch.Generator().manual_seed(seed)
    no_drafts = torch.zeros(0, target.config.vocab_size)

    def step(tokens, k_now):
        drafted, q = (
            propose_sampled(draft, draft_cache, tokens, k_now, temperature, top_p, generator)
            if k_now
            else ([], no_drafts)
        )
        return drafted, verify_sampled(target, target_cache, tokens, drafted, q, temperature, top_p, generator)

    return run(step, prompt, max_new_tokens, k, eos_id)
