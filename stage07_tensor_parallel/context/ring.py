"""Ring attention: causal attention over a prompt whose positions are split across p ranks.

Rank r holds the queries, keys and values of its positions only (split_positions). Attention needs every
query to see every earlier key, so the KV blocks travel: at step i rank r holds the block of rank r - i,
computes its queries' partial attention over that block while it sends the block on to r + 1 and receives
the next from r - 1, and merges the partial result into its running one by the online-softmax rescaling.
After p steps every query has seen every block, and no rank ever held more than two blocks.
lab7.ipynb §1–§4.
"""

import math  # noqa: F401 (the TODOs use it)

import torch
import torch.distributed as dist  # noqa: F401 (the TODOs use it)

from labkit import distributed  # noqa: F401 (the TODOs use it)
from labkit.model import Config, repeat_kv  # noqa: F401 (the TODOs use it)

SCHEMES = ("contiguous", "zigzag")


def split_positions(T: int, p: int, scheme: str = "contiguous") -> list[torch.Tensor]:
    """The positions each of p ranks holds, as p ascending (T_r,) int64 tensors that together hold 0 .. T - 1 once.

    contiguous: p chunks in order, rank r the r-th. zigzag: 2p chunks in order, rank r the r-th and the
    (2p - 1 - r)-th, so under the causal mask every rank has as many (query, key) pairs to score as another.
    Either way, n chunks of T tokens: the first T mod n chunks are one token longer than the others.
    Raises ValueError for an unknown scheme, or when T is too short to give every chunk a position (T < p,
    or T < 2p for zigzag).
    """
    raise NotImplementedError("stage07: split_positions — see lab7.ipynb §1")


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """Causal softmax attention of q over one block of keys, normalised within the block, and its log-sum-exp.

    q: (B, H, Tq, D) float32 queries at positions q_pos (Tq,); k, v: (B, n_kv, Tk, D) float32 at positions
    k_pos (Tk,), query head h reading kv head h // (H / n_kv). Query i sees key j where k_pos[j] <= q_pos[i];
    scores are scaled by 1 / sqrt(D). Returns (o (B, H, Tq, D), lse (B, H, Tq)) float32, lse the log of the sum
    of exp(score) over the keys the query sees; a query that sees none gets o = 0 and lse = -inf (no NaN).
    """
    raise NotImplementedError("stage07: block_attention — see lab7.ipynb §2")


def merge_partials(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attentions of the same queries over disjoint sets of keys (online-softmax rescaling).

    o_a, o_b: (B, H, Tq, D) float32, each normalised over its own keys; lse_a, lse_b: (B, H, Tq) their
    log-sum-exps (-inf where a query saw no key). Returns (o, lse) of the attention over both sets, as if
    computed in one softmax; a query that saw no key in either keeps o = 0, lse = -inf (no NaN).
    """
    raise NotImplementedError("stage07: merge_partials — see lab7.ipynb §2")


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[torch.Tensor], timeout_s: float = 60.0
):
    """Causal attention of this rank's queries over the keys of every rank, passing KV blocks around the ring.

    Called on every rank of a process group of p = len(positions) ranks; this rank's index is its rank.
    q: (B, H, T_r, D) float32, k, v: (B, n_kv, T_r, D) float32, of this rank's positions positions[rank]
    (RoPE applied). In p steps: at step i this rank holds the K and V of rank (rank - i) mod p (its own at
    step 0); before scoring them it starts sending them to rank + 1 and receiving rank - i - 1's from
    rank - 1 (labkit.distributed's isend / irecv, K and V in one tensor of the sender's block size, which
    positions tells), then merges that block's partial attention (block_attention) into its running result
    (merge_partials), and waits for both transfers with timeout_s. No all-gather: a rank holds at most its
    own block and the one in flight. Returns (B, H, T_r, D) float32, equal to causal softmax attention of q
    over the whole prompt's keys.
    """
    raise NotImplementedError("stage07: ring_attention — see lab7.ipynb §3")


def ring_bytes_per_rank(
    config: Config, T: int, p: int, rank: int, scheme: str = "contiguous", dtype_bytes: int = 4
) -> int:
    """Bytes rank `rank` sends in one ring-attention prefill of a T-token prompt (batch 1) over p ranks: every
    ring_attention step's K and V block, in every layer, each element dtype_bytes wide. Count it by hand
    from which blocks this rank forwards (lab7.ipynb §4): 0 when p == 1."""
    raise NotImplementedError("stage07: ring_bytes_per_rank — see lab7.ipynb §4")
