"""Stage 07 part 4 learner bugs, one edit each, planted in solutions/stage07_tensor_parallel/moe (see labkit/grading/mutants.py)."""

MUTANTS = [
    # --- routing.py (lab8 §1) ---
    dict(
        file="moe/routing.py",
        find="    probs = torch.softmax(router_logits.float(), dim=-1)\n",
        replace="    probs = router_logits.float()\n",
        bug="softmax_topk weights are the raw logits (no softmax)",
    ),
    dict(
        file="moe/routing.py",
        find="    weights, indices = torch.topk(probs, k, dim=-1)\n",
        replace="    weights, indices = torch.topk(router_logits.float(), k, dim=-1)\n    weights = torch.softmax(weights, dim=-1)\n",
        bug="softmax_topk takes the softmax over the k chosen logits only (Mixtral's order), wrong without norm_topk_prob",
    ),
    dict(
        file="moe/routing.py",
        find="    if norm_topk_prob:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        replace="    weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        bug="softmax_topk always renormalises (ignores norm_topk_prob=False)",
    ),
    dict(
        file="moe/routing.py",
        find="    biased = scores + correction_bias\n",
        replace="    biased = scores\n",
        bug="group_limited_topk ignores the correction bias when choosing",
    ),
    dict(
        file="moe/routing.py",
        find="    weights = scores.gather(1, indices)\n",
        replace="    weights = biased.gather(1, indices)\n",
        bug="group_limited_topk weights include the correction bias (it is for choosing only)",
    ),
    dict(
        file="moe/routing.py",
        find=".topk(2, dim=-1).values.sum(-1)",
        replace=".max(dim=-1).values",
        bug="group_limited_topk ranks a group by its best score, not the sum of its two best",
    ),
    dict(
        file="moe/routing.py",
        find="    expert_mask = group_mask.repeat_interleave(E // n_group, dim=1)  # (N, E)\n",
        replace="    expert_mask = group_mask.repeat(1, E // n_group)  # (N, E)\n",
        bug="group_limited_topk treats groups as interleaved experts (e % n_group), not consecutive ones",
    ),
    dict(
        file="moe/routing.py",
        find="    return weights * routed_scaling_factor, indices\n",
        replace="    return weights, indices\n",
        bug="group_limited_topk forgets routed_scaling_factor",
    ),
    # --- experts.py (lab8 §2) ---
    dict(
        file="moe/experts.py",
        find="    counts = torch.bincount(flat, minlength=num_experts)\n",
        replace="    counts = torch.bincount(flat)\n",
        bug="sort_by_expert's counts stop at the last expert used (no minlength)",
    ),
    dict(
        file="moe/experts.py",
        find="    order = torch.argsort(flat, stable=True)\n",
        replace="    order = torch.argsort(flat, stable=True, descending=True)\n",
        bug="sort_by_expert orders experts from the last",
    ),
    dict(
        file="moe/experts.py",
        find="    rows = x[order // k]  # (N·k, D), grouped by expert\n",
        replace="    rows = x[order % x.shape[0]]  # (N·k, D), grouped by expert\n",
        bug="grouped_experts maps a pair to its token with % N instead of // k",
    ),
    dict(
        file="moe/experts.py",
        find="    out_rows *= topk_weights.flatten()[order, None]\n",
        replace="    out_rows *= topk_weights.flatten()[:, None]\n",
        bug="grouped_experts weights the sorted rows with the unsorted weights",
    ),
    dict(
        file="moe/experts.py",
        find="        start += n\n",
        replace="        start = n\n",
        bug="grouped_experts' running offset is the last count, not the sum of counts",
    ),
    dict(
        file="moe/experts.py",
        find="        gate, up = (rows[start : start + n] @ gate_up[e].T).chunk(2, dim=-1)\n",
        replace="        up, gate = (rows[start : start + n] @ gate_up[e].T).chunk(2, dim=-1)\n",
        bug="grouped_experts swaps the gate and up halves of gate_up",
    ),
    # --- expert_parallel.py (lab8 §3) ---
    dict(
        file="moe/expert_parallel.py",
        find="    by_priority = topk_idx.T.flatten()  # column 0's tokens, then column 1's, ...\n",
        replace="    by_priority = topk_idx.flatten()\n    topk_idx = topk_idx.T\n",
        bug="capacity_keep serves each token's choices together (token order), not all first choices first",
    ),
    dict(
        file="moe/expert_parallel.py",
        find="    return (position < capacity).view(k, N).T\n",
        replace="    return (position <= capacity).view(k, N).T\n",
        bug="capacity_keep keeps capacity + 1 pairs an expert",
    ),
    dict(
        file="moe/expert_parallel.py",
        find="    order = order[keep.flatten()[order]]  # kept pairs, by expert, so by owning rank\n",
        replace="",
        bug="dispatch sends the dropped pairs too",
    ),
    dict(
        file="moe/expert_parallel.py",
        find="(experts - firsts[owner]).to(x.dtype)",
        replace="experts.to(x.dtype)",
        bug="dispatch sends the global expert id where the owner needs its local index",
    ),
    dict(
        file="moe/expert_parallel.py",
        find="    owner = torch.bucketize(experts, firsts, right=True) - 1\n",
        replace="    owner = torch.bucketize(experts, firsts)\n",
        bug="dispatch sends an expert's first pairs to the rank after its owner (off by one at the boundaries)",
    ),
    dict(
        file="moe/expert_parallel.py",
        find="    rows *= topk_weights.flatten()[plan.order, None]\n",
        replace="",
        bug="combine sums the experts' outputs without the routing weights",
    ),
    dict(
        file="moe/expert_parallel.py",
        find="    return out.index_add_(0, plan.order // k, rows)\n",
        replace="    return out.index_add_(0, plan.order % len(out), rows)\n",
        bug="combine adds each answer into the wrong token (% N for // k)",
    ),
    # --- moefy.py (lab8 §4) ---
    dict(
        file="moe/moefy.py",
        find="    v = torch.nn.functional.normalize(w.float(), dim=1)\n",
        replace="    v = w.float()\n",
        bug="balanced_clusters clusters raw rows (scale dominates direction)",
    ),
    dict(
        file="moe/moefy.py",
        find="        centroids = torch.stack([v[labels == e].mean(0) for e in range(num_experts)])\n",
        replace="",
        bug="balanced_clusters never moves its centroids (one assignment to random rows)",
    ),
    dict(
        file="moe/moefy.py",
        find="                accepted = proposers[dist[proposers, e].argsort()[: int(room[e])]]\n",
        replace="                accepted = proposers[: int(room[e])]\n",
        bug="balanced_clusters fills a full centroid with the first proposers, not the closest",
    ),
    dict(
        file="moe/moefy.py",
        find="ridge * len(x) * torch.eye",
        replace="ridge * torch.eye",
        bug="fit_router's penalty is not scaled by the number of calibration tokens",
    ),
    dict(
        file="moe/moefy.py",
        find="    return torch.linalg.solve(gram, x64.T @ t64).T.float()\n",
        replace="    return torch.linalg.lstsq(x64, t64).solution.T.float()\n",
        bug="fit_router solves plain least squares (no ridge)",
    ),
]
