"""Which experts each token goes to, and with what weight: Mixtral/Qwen3-MoE's softmax top-k and
DeepSeek-V3's sigmoid scores with group-limited top-k (lab8.ipynb §1).

Both return (weights (N, k) float32, indices (N, k) int64); the order of a token's k choices is
free (the block sums over them), so tests compare choices as sets.
"""

import torch


def softmax_topk(router_logits: torch.Tensor, k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen3-MoE routing.

    router_logits: (N, E) any float dtype, one row per token
    k:             experts per token (num_experts_per_tok), 1 <= k <= E
    norm_topk_prob: rescale the k chosen probabilities to sum to 1 (Qwen3-MoE's flag; Mixtral always does)
    returns        weights (N, k) float32: the softmax over all E experts, in float32, read at the
                   k largest; indices (N, k) int64. Equal to transformers' Qwen3MoeTopKRouter.
    """
    raise NotImplementedError("stage07: softmax_topk — see lab8.ipynb §1")


def group_limited_topk(
    router_logits: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    correction_bias: torch.Tensor,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores, a choice limited to the best groups, a scaled weight.

    router_logits:   (N, E) float; the E experts form n_group equal groups of consecutive experts
    correction_bias: (E,) float32, added to the scores for choosing only (the load-balancing bias),
                     never to the weights
    A group's worth is the sum of its two best biased scores; each token keeps its topk_group best
    groups and picks its k best biased scores among their experts.
    returns weights (N, k) float32: the unbiased sigmoid scores of the chosen experts, divided by
            their sum (plus 1e-20) when norm_topk_prob, then times routed_scaling_factor;
            indices (N, k) int64. Equal to transformers' DeepseekV3TopkRouter.
    """
    raise NotImplementedError("stage07: group_limited_topk — see lab8.ipynb §1")
