"""Speculation inside a batching engine: verify every running sequence's drafts in one ragged
target forward, let each sequence accept its own count, roll back the KV blocks of rejected
drafts, and decide per sequence how many tokens to draft — zero once the batch is big enough that
speculation stops paying.

The engine around these two functions (drafting, admission, preemption) is given in batch_engine.py.
"""

import torch

from labkit import paged
from labkit.model import Llama

from .sampling import accept_reject, sample, warp
from .speedup import expected_tokens_per_step


@torch.inference_mode()
def verify_batch(
    target: Llama,
    store: paged.PagedKVStore,
    seq_ids: list[int],
    tokens: list[list[int]],
    drafts: list[list[int]],
    q: list[torch.Tensor] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Verify the drafts of a whole batch with ONE call of paged.forward, then roll back.

    seq_ids[i]: sequence i's id in `store`, which caches a prefix of tokens[i] (never its last token)
    tokens[i]:  sequence i's prompt + generated tokens so far
    drafts[i]:  k_i >= 0 drafted token ids (k_i differs between sequences; 0 = plain decoding)
    q:          None for greedy; else q[i] is (k_i, V) float32, the draft distributions drafts[i]
                were sampled from (warped with the same temperature and top_p)
    returns     new[i] = drafts[i][:n_i] + [one token of the target's own] for each sequence.
                Greedy: n_i = the drafts equal to the target's argmax, the last token its argmax.
                Sampled: accept_reject on warp(target logits), then sample() from the distribution
                it returns; for each sequence in order, k_i uniforms then that one draw, all from
                `generator`.
    Afterwards store.length(seq_ids[i]) == len(tokens[i]) + n_i, and the blocks that held rejected
    drafts are back in the pool.
    """
    chunks = [t[store.length(s) :] + d for s, t, d in zip(seq_ids, tokens, drafts, strict=True)]
    logits = paged.forward(target, store, seq_ids, chunks)
    new = []
    for i, (sid, toks, drafted) in enumerate(zip(seq_ids, tokens, drafts, strict=True)):
        k = len(drafted)
        scores = logits[i][-(k + 1) :]  # (k + 1, V): row j scores the position of drafted[j]
        if q is None:
            choice = scores.argmax(dim=-1).tolist()
            n = 0
            while n < k and drafted[n] == choice[n]:
                n += 1
            new.append(drafted[:n] + [choice[n]])
        else:
            p = warp(scores, temperature, top_p)
            u = torch.rand(k, generator=generator)
            n, dist = accept_reject(p, q[i], torch.tensor(drafted, dtype=torch.long), u)
            new.append(drafted[:n] + [sample(dist, generator)])
        store.truncate(sid, len(toks) + n)
    return new


def choose_k(alpha: float, batch_size: int, costs, k_max: int) -> int:
    """How many tokens a sequence with acceptance alpha should draft this step (0 = do not speculate).

    costs.draft(B):     seconds of one draft forward over B sequences, one token each
    costs.target(B, T): seconds of one target forward over B sequences, T tokens each
    A step in which every one of the batch_size sequences drafts k tokens takes k draft forwards and
    one target forward over k + 1 tokens each, and emits expected_tokens_per_step(alpha, k) tokens
    per sequence; without speculation a step is one target forward over one token each and emits one.
    returns the smallest k in 0..k_max with the largest expected speedup (tokens per second) over
    not speculating — so 0 when no k beats plain decoding.
    """
    plain = costs.target(batch_size, 1)

    def speedup(k: int) -> float:
        step = k * costs.draft(batch_size) + costs.target(batch_size, k + 1)
        return expected_tokens_per_step(alpha, k) * plain / step

    return max(range(k_max + 1), key=lambda k: (speedup(k), -k))
