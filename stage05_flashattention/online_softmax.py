"""Online softmax: the softmax normalizer computed in one streaming pass over blocks.

softmax(x)_i = exp(x_i - m) / l  with  m = max(x),  l = sum_j exp(x_j - m).
Reading x block by block, keep the running pair (m, l). When a block raises the max from m to m',
every term already summed into l was exp(x_j - m) and must become exp(x_j - m'): multiply l by
exp(m - m'). That one rescale is the whole trick behind FlashAttention and FlashDecoding.
"""

import torch


def online_update(m: torch.Tensor, l: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block of scores into the running (max, sum).

    m: (...,) float32 — max of everything seen so far (-inf before the first block)
    l: (...,) float32 — sum of exp(x - m) over everything seen so far (0 before the first block)
    s: (..., n) float32 — the next block of scores
    returns (m', l') such that l' = sum exp(x - m') over everything seen, this block included
    """
    raise NotImplementedError("stage05: online_update — see lab.ipynb §1")


def merge_states(
    m_a: torch.Tensor, l_a: torch.Tensor, m_b: torch.Tensor, l_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine the (max, sum) of two disjoint parts of a row into the state of their union.

    m_a, l_a, m_b, l_b: (...,) float32 states of parts A and B (as returned by online_update)
    returns (m, l) equal to the state of A ∪ B, whichever order the parts come in
    """
    raise NotImplementedError("stage05: merge_states — see lab.ipynb §2")


def online_softmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Softmax over the last dim, with (max, sum) gathered by online_update one block at a time.

    x: (..., N) float32, N need not be a multiple of block_size
    returns (..., N) float32, equal to torch.softmax(x, -1); calls online_update ceil(N / block_size) times
    """
    raise NotImplementedError("stage05: online_softmax — see lab.ipynb §1")
