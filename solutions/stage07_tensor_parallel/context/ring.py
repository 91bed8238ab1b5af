"""Ring attention: causal attention over a prompt whose positions are split across p ranks.

Rank r holds the queries, keys and values of its positions only (split_positions). Attention needs every
query to see every earlier key, so the KV blocks travel: at step i rank r holds the block of rank r - i,
computes its queries' partial attention over that block while it sends the block on to r + 1 and receives
the next from r - 1, and merges the partial result into its running one by the online-softmax rescaling.
After p steps every query has seen every block, and no rank ever held more than two blocks.
lab7.ipynb §1–§4.
"""

import math

import torch
import torch.distributed as dist

from labkit import distributed
from labkit.model import Config, repeat_kv

SCHEMES = ("contiguous", "zigzag")


def split_positions(T: int, p: int, scheme: str = "contiguous") -> list[torch.Tensor]:
    """The positions each of p ranks holds, as p ascending (T_r,) int64 tensors that together hold 0 .. T - 1 once.

    contiguous: p chunks in order, rank r the r-th. zigzag: 2p chunks in order, rank r the r-th and the
    (2p - 1 - r)-th, so under the causal mask every rank has as many (query, key) pairs to score as another.
    Either way, n chunks of T tokens: the first T mod n chunks are one token longer than the others.
    Raises ValueError for an unknown scheme, or when T is too short to give every chunk a position (T < p,
    or T < 2p for zigzag).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown split {scheme!r}: use one of {SCHEMES}")
    n = p if scheme == "contiguous" else 2 * p
    if T < n:
        raise ValueError(f"a prompt of {T} tokens cannot be split into {n} non-empty {scheme} chunks over {p} ranks")
    chunks = torch.arange(T).tensor_split(n)  # the first T % n chunks one longer
    if scheme == "contiguous":
        return list(chunks)
    return [torch.cat([chunks[r], chunks[2 * p - 1 - r]]) for r in range(p)]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """Causal softmax attention of q over one block of keys, normalised within the block, and its log-sum-exp.

    q: (B, H, Tq, D) float32 queries at positions q_pos (Tq,); k, v: (B, n_kv, Tk, D) float32 at positions
    k_pos (Tk,), query head h reading kv head h // (H / n_kv). Query i sees key j where k_pos[j] <= q_pos[i];
    scores are scaled by 1 / sqrt(D). Returns (o (B, H, Tq, D), lse (B, H, Tq)) float32, lse the log of the sum
    of exp(score) over the keys the query sees; a query that sees none gets o = 0 and lse = -inf (no NaN).
    """
    B, H, Tq, D = q.shape
    if k_pos.min() > q_pos.max():  # the whole block is in every query's future: nothing to score
        return q.new_zeros(B, H, Tq, D), q.new_full((B, H, Tq), -math.inf)
    n_rep = H // k.shape[1]
    scores = q @ repeat_kv(k, n_rep).transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row that sees nothing: exp(-inf + inf)
    return weights @ repeat_kv(v, n_rep), lse


def merge_partials(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attentions of the same queries over disjoint sets of keys (online-softmax rescaling).

    o_a, o_b: (B, H, Tq, D) float32, each normalised over its own keys; lse_a, lse_b: (B, H, Tq) their
    log-sum-exps (-inf where a query saw no key). Returns (o, lse) of the attention over both sets, as if
    computed in one softmax; a query that saw no key in either keeps o = 0, lse = -inf (no NaN).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    seen = lse > -math.inf
    w_a = torch.where(seen, torch.exp(lse_a - lse), 0.0)[..., None]
    w_b = torch.where(seen, torch.exp(lse_b - lse), 0.0)[..., None]
    return w_a * o_a + w_b * o_b, lse


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
    rank, p = dist.get_rank(), len(positions)
    B, H, Tq, D = q.shape
    o, lse = q.new_zeros(B, H, Tq, D), q.new_full((B, H, Tq), -math.inf)
    kv = torch.stack([k, v])  # (2, B, n_kv, T_src, D): one message a step
    for i in range(p):
        src = (rank - i) % p
        if i < p - 1:
            incoming = kv.new_empty(2, B, k.shape[1], len(positions[(src - 1) % p]), D)
            sent = distributed.isend(kv, (rank + 1) % p)
            received = distributed.irecv(incoming, (rank - 1) % p)
        o_i, lse_i = block_attention(q, kv[0], kv[1], positions[rank], positions[src])
        o, lse = merge_partials(o, lse, o_i, lse_i)
        if i < p - 1:
            distributed.wait(sent, timeout_s, f"ring step {i}: the KV block of rank {src} to rank {(rank + 1) % p}")
            distributed.wait(received, timeout_s, f"ring step {i}: a KV block from rank {(rank - 1) % p}")
            kv = incoming
    return o


def ring_bytes_per_rank(
    config: Config, T: int, p: int, rank: int, scheme: str = "contiguous", dtype_bytes: int = 4
) -> int:
    """Bytes rank `rank` sends in one ring-attention prefill of a T-token prompt (batch 1) over p ranks: every
    ring_attention step's K and V block, in every layer, each element dtype_bytes wide. Count it by hand
    from which blocks this rank forwards (lab7.ipynb §4): 0 when p == 1."""
    sizes = [len(pos) for pos in split_positions(T, p, scheme)]
    forwarded = T - sizes[(rank + 1) % p]  # every block but the one that arrives last, from rank + 1
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * forwarded * dtype_bytes
