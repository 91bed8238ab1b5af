"""Grouped execution: each expert computes all of its tokens in one product (lab8.ipynb §2).

A routed batch is N tokens with k choices each: N·k (token, expert) pairs. Sorted by expert,
each expert's pairs are one contiguous block of rows, and the expert's SwiGLU runs on that block
as one (rows × D) @ (D × 2I) product and one (rows × I) @ (I × D): what a grouped GEMM (vLLM's
fused_moe, torch._grouped_mm, DeepSeek's DeepGEMM) launches for all experts at once. The given
forms beside it (block.py) are the per-token loop and the dense "every expert on every token".

Expert weights use transformers' layout: gate_up (E, 2I, D), the gate's I rows first, then
the up projection's; down (E, D, I).
"""

import torch
import torch.nn.functional as F  # noqa: F401 (the TODOs use these)


def sort_by_expert(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the N·k (token, expert) pairs by expert.

    topk_idx: (N, k) int64, expert ids in [0, num_experts)
    returns   order (N·k,) int64: positions in topk_idx.flatten(), expert 0's pairs first, and within
              an expert in increasing position (a stable sort), so order // k is each row's token;
              counts (num_experts,) int64: how many pairs each expert got (zeros included)
    """
    raise NotImplementedError("stage07: sort_by_expert — see lab8.ipynb §2")


def grouped_experts(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The routed experts' weighted sum for every token, computed expert by expert on sorted rows.

    x:            (N, D) float32 tokens
    topk_idx:     (N, k) int64 chosen experts; topk_weights (N, k) float32 their weights
    gate_up:      (E, 2I, D); down (E, D, I)
    returns       (N, D) float32: out[t] = Σ_j topk_weights[t, j] · expert_{topk_idx[t, j]}(x[t]),
                  expert_e(v) = down[e] @ (silu(gate_e v) * up_e v). Each (token, expert) pair is
                  computed once, in one matrix product per expert that has rows (no padding, no
                  expert on a token that did not choose it, no loop over tokens): the test counts
                  the products and their FLOPs.
    """
    raise NotImplementedError("stage07: grouped_experts — see lab8.ipynb §2")
