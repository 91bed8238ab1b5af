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
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


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
    scores = torch.sigmoid(router_logits.float())  # (N, E)
    biased = scores + correction_bias
    N, E = biased.shape
    group_scores = biased.view(N, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # (N, n_group)
    best_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    expert_mask = group_mask.repeat_interleave(E // n_group, dim=1)  # (N, E)
    indices = biased.masked_fill(~expert_mask, float("-inf")).topk(k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, indices
