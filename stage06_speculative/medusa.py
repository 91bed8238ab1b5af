"""Medusa decoding (Cai et al., 2024): no draft model; K heads on the target's last hidden state guess the
K tokens after the target's own next one, their top-k guesses form a tree of candidates, and the
target verifies the whole tree in ONE forward pass with a tree attention mask.

One round, greedy:
  root  = the target's own next token (its argmax at the last accepted position), not yet in the cache
  tree  = root + head k's top choices at depth k, in the shape `paths` gives (Medusa's `medusa_choices`)
  verify: one forward over the N tree nodes after the cached prefix; node i sits at position
          prefix + depth(i) and sees the prefix and its own ancestors only
  accept: the longest root-to-node path whose every token is the target's argmax after its parent
  commit: move the accepted nodes' K/V to consecutive cache slots, forget the rest

Cache invariant between rounds: the cache holds the prompt and every generated token except the
root, which the next verification reads first.
"""

import time
from collections.abc import Callable

import torch

from labkit.model import KVCache, Llama, causal_mask, refuse_extras, rope_cos_sin

from .speculative import SpecStats

# The tree shape: every root-to-node path as the top-k rank chosen at each depth, e.g. (0, 1) is
# "head 1's best guess, then head 2's second best". Every prefix of a path must be a path too.
# 19 paths + the root = 20 nodes, 4 deep: most nodes follow each head's first choice, where it is most often right.
MEDUSA_CHOICES = [
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
]  # fmt: skip
Heads = Callable[[torch.Tensor], torch.Tensor]  # hidden (D,) -> logits (K, V), head k guessing k + 1 tokens ahead


def sort_paths(paths: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The tree's paths in node order (node i + 1 is path i): shorter first, so a parent always
    precedes its children. Refuses a path whose prefix is missing or a rank below 0."""
    paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"tree path {p!r}: a path is a non-empty tuple of top-k ranks >= 0")
        if len(p) > 1 and p[:-1] not in paths:
            raise ValueError(f"tree path {p!r} has no parent {p[:-1]!r}: add every prefix of a path to the tree")
    return paths


def candidate_tree(
    root: int, head_logits: torch.Tensor, paths: list[tuple[int, ...]]
) -> tuple[torch.Tensor, list[int], list[int]]:
    """The tree of candidate continuations, node 0 being `root`.

    head_logits: (K, V) float32, row k - 1 from head k (its guess for the token k + 1 after the last
                 accepted one, so at depth k of the tree)
    paths:       sort_paths' output; node i + 1 is paths[i], whose token is the paths[i][-1]-th best
                 (0 = argmax) of head len(paths[i])
    returns (tokens (N,) int64, parents: parents[0] = -1 and parents[i] < i, depths: depths[0] = 0),
    N = len(paths) + 1.
    """
    raise NotImplementedError("stage06: candidate_tree — see lab3.ipynb §2")


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """(N, N) bool, True = attend: node i sees node j iff j is i itself or one of its ancestors.

    parents: parents[0] = -1 (the root), parents[i] < i otherwise.
    """
    raise NotImplementedError("stage06: tree_attention_mask — see lab3.ipynb §3")


def forward_hidden(model: Llama, ids: torch.Tensor, cache: KVCache, positions: torch.Tensor, mask) -> torch.Tensor:
    """Llama.forward for batch 1 with explicit position ids and attention mask, returning the final
    normed hidden states instead of logits. Writes the T new keys after the cache's prefix.

    ids, positions: (T,) int64; mask: (T, cache.length + T) bool (True = attend) or None
    returns (T, D) in the model's dtype; afterwards cache.length has grown by T.
    """
    c = model.config
    supported = ("attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "rope_scaling")
    refuse_extras(c, "stage06 medusa", supported, max_len=cache.max_seq_len)
    x = model.model.embed_tokens(ids[None])
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    for i, layer in enumerate(model.model.layers):
        x = layer(x, cos, sin, mask, cache, i)
    cache.length += len(ids)
    return model.model.norm(x)[0]


def verify_tree(
    model: Llama, cache: KVCache, tokens: torch.Tensor, parents: list[int], depths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """ONE forward of the target over the N tree nodes after the L cached positions.

    Node i sits at position L + depths[i] and attends to the whole prefix and to its ancestors
    (tree_attention_mask). Its keys/values land in cache slots L + i (tree order, not position order).
    returns (logits (N, V) float32: row i = the target's next-token logits after the path to node i,
             hidden (N, D): the final normed hidden states); afterwards cache.length = L + N.
    """
    raise NotImplementedError("stage06: verify_tree — see lab3.ipynb §4")


def accept_path(tokens: torch.Tensor, parents: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance: the longest path from the root whose every node is the target's argmax
    after its parent. The root is always accepted (it is the target's own token).

    tokens: (N,) int64; logits: (N, V) from verify_tree
    returns (accepted node indices from the root down, e.g. [0, 2, 7]; the bonus token: the target's
    argmax after the last accepted node, the next round's root).
    """
    raise NotImplementedError("stage06: accept_path — see lab3.ipynb §5")


def commit_path(cache: KVCache, start: int, path: list[int]) -> None:
    """Keep only the accepted nodes in the cache: node path[j]'s keys and values (at slot start + path[j]
    after verify_tree) move to slot start + j in every layer; afterwards cache.length = start + len(path).

    start: the cache length before verify_tree; path: accept_path's node indices (increasing).
    """
    raise NotImplementedError("stage06: commit_path — see lab3.ipynb §6")


@torch.inference_mode()
def medusa_generate(
    target: Llama,
    heads: Heads,
    prompt: list[int],
    max_new_tokens: int,
    paths: list[tuple[int, ...]] = MEDUSA_CHOICES,
    eos_id: int | None = None,
) -> tuple[list[int], SpecStats]:
    """Greedy Medusa decoding: the target's own greedy tokens, several per target forward.

    heads: hidden (D,) -> (K, V) logits (labkit.medusa.MedusaHeads or any callable); paths deeper
    than K are cut to K. Stops after eos_id if given. returns (new token ids, SpecStats) where a
    target forward is the prefill or one tree verification, and proposed / accepted count tree
    nodes below the root offered / kept.
    """
    stats, start_time = SpecStats(), time.perf_counter()
    cache = target.new_cache(1, len(prompt) + max_new_tokens + len(paths) + 1)
    n = len(prompt)
    hidden = forward_hidden(target, torch.tensor(prompt), cache, torch.arange(n), causal_mask(0, n))[-1]
    root = int(target.lm_head(hidden).argmax())
    head_logits = heads(hidden).float()
    paths = sort_paths([p for p in paths if len(p) <= len(head_logits)])
    stats.target_forwards += 1
    out = [root]
    while len(out) < max_new_tokens and not (eos_id is not None and eos_id in out):
        tokens, parents, depths = candidate_tree(root, head_logits, paths)
        start = cache.length
        logits, tree_hidden = verify_tree(target, cache, tokens, parents, depths)
        path, root = accept_path(tokens, parents, logits)
        commit_path(cache, start, path)
        out += tokens[path[1:]].tolist() + [root]
        head_logits = heads(tree_hidden[path[-1]]).float()
        stats.target_forwards += 1
        stats.proposed += len(paths)
        stats.accepted += len(path) - 1
        stats.rejected += path[-1] in parents  # the path stopped at a node whose children were all wrong
    if eos_id is not None and eos_id in out:
        out = out[: out.index(eos_id) + 1]
    out = out[:max_new_tokens]
    stats.generated, stats.seconds = len(out), time.perf_counter() - start_time
    return out, stats
