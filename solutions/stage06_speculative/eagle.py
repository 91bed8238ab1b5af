"""EAGLE drafting (Li et al., 2024): a one-layer draft that runs on the target's features, not its tokens.

The target's feature f_t is its final normed hidden state at position t (its LM head's input). The
draft (labkit.eagle.EagleHead: fc, one decoder layer, the target's embedding and a slice of its LM
head) reads the pair (f_t, token t + 1) at position t and predicts f_{t+1}; the target's LM head,
restricted to the head's vocabulary, reads the next token off that prediction. To draft k tokens
it feeds its own predicted feature back k - 1 times.

One round:
  propose: read the target's features the draft has not seen (true ones, from the last verification),
           then draft k tokens in feature space, one small forward each, in the draft's own KV cache
  verify:  ONE target forward over the last token + the k drafts, keeping its features too; accept as
           chain speculation does (greedy: the longest agreeing prefix; sampled: accept_reject)
  hand-off: the accepted positions' TRUE features become the draft's next input; its cache forgets
           the positions it filled with its own predictions

Caches between rounds: the target's holds every token but the last (as in speculative.py); the
draft's holds positions 0 .. m - 1, each read from a true feature, and `pending` holds the true
features of positions m, m + 1, ... with the tokens after them, which the next proposal reads first.
"""

import torch

from labkit.eagle import EagleHead
from labkit.model import KVCache, Llama, causal_mask

from .sampling import accept_reject, sample, warp
from .speculative import SpecStats, run


def target_forward(target: Llama, cache: KVCache, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over `ids` after its cached prefix: (features (T, H), logits (T, V) float32); the cache grows by T."""
    x, cos, sin, mask = target.layer_inputs(torch.tensor([ids]), cache.length)
    for i, layer in enumerate(target.model.layers):
        x = layer(x, cos, sin, mask, cache, i)
    cache.length += len(ids)
    feats = target.model.norm(x)[0]
    return feats, target.lm_head(feats).float()


def draft_forward(
    head: EagleHead, cache: KVCache, feats: torch.Tensor, next_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft over T positions after its cached prefix of L: position L + i reads (feats[i], next_ids[i]).

    feats: (T, H) features (true or the draft's own); next_ids: (T,) int64, the token after each.
    x = fc(concat(feats, embed(next_ids))) then head.layer with the cache (layer 0, RoPE rows L .. L + T - 1,
    causal mask) -> predicted features (T, H), the next position's; logits = head.lm_head(predicted)
    over the head's vocabulary, scattered into the full vocabulary (-inf for tokens it cannot propose).
    returns (predicted features (T, H), logits (T, V) float32); afterwards cache.length = L + T.
    """
    L, T = cache.length, len(next_ids)
    x = head.fc(torch.cat([feats, head.embed(next_ids)], dim=-1))[None]
    cos, sin = head.target[0].rope(L, T)
    x = head.layer(x, cos, sin, causal_mask(L, T), cache, 0)[0]
    cache.length += T
    logits = torch.full((T, head.target[0].config.vocab_size), -torch.inf)
    logits[:, head.vocab] = head.lm_head(x).float()
    return x, logits


@torch.inference_mode()
def propose(
    head: EagleHead,
    cache: KVCache,
    feats: torch.Tensor,
    next_ids: list[int],
    k: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    threshold: float = 0.0,
) -> tuple[list[int], torch.Tensor]:
    """Draft up to k >= 1 tokens: one draft_forward over the pending true features (feats (T, H), next_ids,
    T >= 1), then single-position steps, each reading (the last predicted feature, the token just drafted).

    temperature 0: each draft is the argmax of its logits; otherwise it is sampled (`sample`) from
    warp(logits, temperature, top_p). EAGLE-2's confidence: the draft stops after draft i (i < k) once the
    product of softmax(logits)[drafted[j]] over j <= i falls below `threshold` (0: always k drafts); the first
    draft is always made. returns (drafted (n <= k), q (n, V) float32: row i the distribution drafted[i] came
    from, a one-hot at temperature 0); afterwards the cache holds T + n - 1 more positions.
    """
    feats, logits = draft_forward(head, cache, feats, torch.tensor(next_ids))
    feat, logits = feats[-1], logits[-1]
    drafted, q, confidence = [], [], 1.0
    for i in range(k):
        if temperature == 0:
            q.append(torch.nn.functional.one_hot(logits.argmax(), len(logits)).float())
            drafted.append(int(logits.argmax()))
        else:
            q.append(warp(logits, temperature, top_p))
            drafted.append(sample(q[-1], generator))
        confidence *= float(torch.softmax(logits, -1)[drafted[-1]])
        if i == k - 1 or confidence < threshold:
            break
        feat, logits = (t[0] for t in draft_forward(head, cache, feat[None], torch.tensor(drafted[-1:])))
    return drafted, torch.stack(q)


@torch.inference_mode()
def verify(
    target: Llama,
    cache: KVCache,
    tokens: list[int],
    drafted: list[int],
    q: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], torch.Tensor]:
    """ONE target_forward over tokens[-1] + drafted (the target's cache holds tokens[:-1]); accept like chain
    speculation: greedy (temperature 0) the longest prefix equal to the target's argmax plus its argmax after
    it, sampled accept_reject(warp(logits), q, drafted, uniforms from `generator`) plus a draw from its
    distribution. returns (new = drafted[:n] + [next], features (n + 1, H): the target's true features at
    the positions of tokens[-1] and the n accepted drafts); afterwards the cache holds tokens + drafted[:n].
    """
    k = len(drafted)
    feats, logits = target_forward(target, cache, tokens[-1:] + drafted)
    if temperature == 0:
        choice = logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and drafted[n] == choice[n]:
            n += 1
        nxt = choice[n]
    else:
        u = torch.rand(k, generator=generator)
        n, dist = accept_reject(warp(logits, temperature, top_p), q, torch.tensor(drafted, dtype=torch.long), u)
        nxt = sample(dist, generator)
    cache.truncate(len(tokens) + n)
    return drafted[:n] + [nxt], feats[: n + 1]


@torch.inference_mode()
def eagle_generate(
    target: Llama,
    head: EagleHead,
    prompt: list[int],
    max_new_tokens: int,
    k: int = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    threshold: float = 0.0,
) -> tuple[list[int], SpecStats]:
    """EAGLE decoding: the target's own greedy tokens (temperature 0), or tokens distributed exactly as
    sampling from warp(target logits, temperature, top_p), with up to k feature-space drafts per target forward
    (fewer where the draft's confidence falls below `threshold`, see propose)."""
    size = len(prompt) + max_new_tokens + k + 1
    target_cache, draft_cache = target.new_cache(1, size), head.new_cache(size)
    generator = torch.Generator().manual_seed(seed)
    feats, logits = target_forward(target, target_cache, prompt)  # the prefill
    first = int(logits[-1].argmax()) if temperature == 0 else sample(warp(logits[-1], temperature, top_p), generator)
    pending = {"feats": feats, "ids": prompt[1:] + [first]}  # true features the draft has not read

    def step(tokens, k_now):
        if k_now:
            read = draft_cache.length + len(pending["ids"])  # positions with true features after this read
            drafted, q = propose(head, draft_cache, pending["feats"], pending["ids"], k_now, temperature, top_p, generator, threshold)  # fmt: skip
            draft_cache.truncate(read)  # forget the positions read from the draft's own predictions
            pending["feats"], pending["ids"] = pending["feats"][:0], []
        else:
            drafted, q = [], torch.zeros(0, target.config.vocab_size)
        new, true_feats = verify(target, target_cache, tokens, drafted, q, temperature, top_p, generator)
        pending["feats"] = torch.cat([pending["feats"], true_feats])
        pending["ids"] += new
        return drafted, new

    if max_new_tokens > 1 and first != eos_id:
        out, stats = run(step, prompt + [first], max_new_tokens - 1, k, eos_id)
    else:
        out, stats = [], SpecStats()
    out = [first] + out
    stats.generated = len(out)
    stats.target_forwards += 1  # the prefill
    return out, stats
