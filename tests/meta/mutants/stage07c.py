"""Stage 07 part 3 learner bugs (pipeline and context parallelism), one edit each, planted in
solutions/stage07_tensor_parallel/pipeline and .../context (see labkit/grading/mutants.py)."""

MUTANTS = [
    # --- pipeline/partition.py (lab6 §1) ---
    dict(
        file="pipeline/partition.py",
        find="        if end <= start:",
        replace="        if end < start:",
        bug="check_partition lets an empty stage through",
    ),
    dict(
        file="pipeline/partition.py",
        find="    if expected_start != num_units:",
        replace="    if expected_start > num_units:",
        bug="check_partition accepts a partition that stops short of the LM head",
    ),
    dict(
        file="pipeline/partition.py",
        find="    if len(bounds) != num_stages:\n",
        replace="    if len(bounds) > num_stages:\n",
        bug="check_partition accepts fewer ranges than stages",
    ),
    dict(
        file="pipeline/partition.py",
        find="                worst = max(best[k - 1][j], prefix[i] - prefix[j])",
        replace="                worst = best[k - 1][j] + prefix[i] - prefix[j]",
        bug="balanced_partition minimises the total cost (every split's) instead of the slowest stage",
    ),
    dict(
        file="pipeline/partition.py",
        find="            for j in range(k - 1, i):",
        replace="            for j in range(k - 1, min(i, k + 1)):",
        bug="balanced_partition only tries cuts near the start (a greedy, not an exhaustive, search)",
    ),
    dict(
        file="pipeline/partition.py",
        find="    if not 1 <= num_stages <= n:",
        replace="    if num_stages < 1:",
        bug="balanced_partition does not refuse more stages than units",
    ),
    # --- pipeline/stage.py (lab6 §2) ---
    dict(
        file="pipeline/stage.py",
        find="        if cache is not None:\n            cache.length += T",
        replace="        if cache is not None and self.is_last:\n            cache.length += T",
        bug="PipelineStage.forward advances the cache only on the last stage (the others overwrite position 0)",
    ),
    dict(
        file="pipeline/stage.py",
        find="            x = layer(x, cos, sin, mask, cache, i)",
        replace="            x = layer(x, cos, sin, mask, cache, 0)",
        bug="PipelineStage.forward writes every layer into the cache's layer 0",
    ),
    dict(
        file="pipeline/stage.py",
        find="            x = self.lm_head(self.norm(x[:, -logits_to_keep:] if logits_to_keep else x))",
        replace="            x = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)",
        bug="PipelineStage.forward skips the final norm before the LM head",
    ),
    dict(
        file="pipeline/stage.py",
        find="        cos, sin, mask = self.layer_inputs(start, T)\n        if self.is_first:",
        replace="        cos, sin, mask = self.layer_inputs(0, T)\n        if self.is_first:",
        bug="PipelineStage.forward rotates every step as if it started at position 0",
    ),
    # --- pipeline/generate.py (lab6 §3) ---
    dict(
        file="pipeline/generate.py",
        find="        T = len(prompt) if step == 0 else 1\n",
        replace="        T = x.shape[1]\n",
        bug="pipeline_generate takes T from the last activation, so a middle stage receives the prompt's length forever",
    ),
    dict(
        file="pipeline/generate.py",
        find="        start += T\n",
        replace="        start += 1\n",
        bug="pipeline_generate advances the position by one after the prompt",
    ),
    dict(
        file="pipeline/generate.py",
        find="        out = stage(x, start, cache, logits_to_keep=1)",
        replace="        out = stage(x, start, None, logits_to_keep=1)",
        bug="pipeline_generate runs the stages without their KV caches (each decode step sees only itself)",
    ),
    dict(
        file="pipeline/generate.py",
        find="                pending.append(distributed.isend(token, 0))",
        replace="                pending.append(distributed.isend(token.float(), 0))",
        bug="pipeline_generate sends the token back to rank 0 as float32 (rank 0 reads int64 bytes)",
    ),
    # --- pipeline/schedule.py (lab6 §4–§5) ---
    dict(
        file="pipeline/schedule.py",
        find="    return [[t - s if 0 <= t - s < m else None for s in range(p)] for t in range(m + p - 1)]",
        replace="    return [[t - s if 0 <= t - s < m else None for s in range(p)] for t in range(m + p)]",
        bug="fill_drain_schedule has one tick too many (an idle row after the drain)",
    ),
    dict(
        file="pipeline/schedule.py",
        find="    return [[t - s if 0 <= t - s < m else None for s in range(p)] for t in range(m + p - 1)]",
        replace="    return [[t if t < m else None for s in range(p)] for t in range(m + p - 1)]",
        bug="fill_drain_schedule runs micro-batch t on every stage at tick t (no stage lag)",
    ),
    dict(
        file="pipeline/schedule.py",
        find="    return sum(j is None for row in table for j in row) / slots",
        replace="    return sum(j is None for row in table for j in row) / (slots - len(table))",
        bug="bubble_fraction divides by one stage fewer",
    ),
    dict(
        file="pipeline/schedule.py",
        find="        T = len(prompts[j])\n",
        replace="        T = len(prompts[0])\n",
        bug="run_microbatches expects every micro-batch to be as long as the first",
    ),
    dict(
        file="pipeline/schedule.py",
        find="            x = torch.tensor([prompts[j]])",
        replace="            x = torch.tensor([prompts[0]])",
        bug="run_microbatches feeds micro-batch 0's prompt every tick",
    ),
    # --- pipeline/layouts.py (lab6 §6) ---
    dict(
        file="pipeline/layouts.py",
        find="    step = (microbatches + pp - 1) * (max(compute, memory) + tp_comm + pp_comm)",
        replace="    step = microbatches * (max(compute, memory) + tp_comm + pp_comm)",
        bug="layout_cost leaves out the fill and drain (no bubble)",
    ),
    dict(
        file="pipeline/layouts.py",
        find='    ring_step = tp_link["link_latency"] + message / tp / tp_link["link_bandwidth"]',
        replace='    ring_step = tp_link["link_latency"] + message / tp_link["link_bandwidth"]',
        bug="layout_cost sends the whole message at every ring step (not 1/tp of it)",
    ),
    dict(
        file="pipeline/layouts.py",
        find="    kv_total = batch * context * config.num_hidden_layers * kv_per_token_layer / pp",
        replace="    kv_total = batch * context * config.num_hidden_layers * kv_per_token_layer",
        bug="layout_cost keeps every layer's KV on every stage",
    ),
    dict(
        file="pipeline/layouts.py",
        find="max(config.num_key_value_heads / tp, 1)",
        replace="config.num_key_value_heads / tp",
        bug="layout_cost splits KV heads below one per GPU when tp exceeds them (no replication)",
    ),
    # --- context/ring.py (lab7 §1–§4) ---
    dict(
        file="context/ring.py",
        find="    return [torch.cat([chunks[r], chunks[2 * p - 1 - r]]) for r in range(p)]",
        replace="    return [torch.cat([chunks[2 * r], chunks[2 * r + 1]]) for r in range(p)]",
        bug="split_positions' zig-zag gives each rank two neighbouring chunks (contiguous again)",
    ),
    dict(
        file="context/ring.py",
        find="    if T < n:\n",
        replace="    if T < p:\n",
        bug="split_positions lets a zig-zag split leave a chunk empty",
    ),
    dict(
        file="context/ring.py",
        find="    chunks = torch.arange(T).tensor_split(n)  # the first T % n chunks one longer",
        replace="    chunks = torch.arange(T).flip(0).tensor_split(n)[::-1]",
        bug="split_positions makes the last chunks the longer ones",
    ),
    dict(
        file="context/ring.py",
        find="    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)",
        replace="    scores = scores.masked_fill(k_pos[None, :] >= q_pos[:, None], -math.inf)",
        bug="block_attention hides each query's own key",
    ),
    dict(
        file="context/ring.py",
        find="    scores = q @ repeat_kv(k, n_rep).transpose(-1, -2) / math.sqrt(D)",
        replace="    scores = q @ repeat_kv(k, n_rep).transpose(-1, -2) / D",
        bug="block_attention scales the scores by 1/D instead of 1/sqrt(D)",
    ),
    dict(
        file="context/ring.py",
        find="    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)",
        replace="    weights = torch.exp(scores - lse[..., None])",
        bug="block_attention gives NaN for a query that sees no key of the block",
    ),
    dict(
        file="context/ring.py",
        find="    return w_a * o_a + w_b * o_b, lse",
        replace="    return (o_a + o_b) / 2, lse",
        bug="merge_partials averages the partial outputs instead of weighting them by their softmax mass",
    ),
    dict(
        file="context/ring.py",
        find="    lse = torch.logaddexp(lse_a, lse_b)",
        replace="    lse = torch.maximum(lse_a, lse_b)",
        bug="merge_partials keeps the larger log-sum-exp instead of adding the masses",
    ),
    dict(
        file="context/ring.py",
        find="        o_i, lse_i = block_attention(q, kv[0], kv[1], positions[rank], positions[src])",
        replace="        o_i, lse_i = block_attention(q, kv[0], kv[1], positions[rank], positions[rank])",
        bug="ring_attention masks every block by this rank's own positions",
    ),
    dict(
        file="context/ring.py",
        find="            incoming = kv.new_empty(2, B, k.shape[1], len(positions[(src - 1) % p]), D)",
        replace="            incoming = kv.new_empty(2, B, k.shape[1], len(positions[src]), D)",
        bug="ring_attention sizes the incoming block as the one it holds (wrong when chunks differ)",
    ),
    dict(
        file="context/ring.py",
        find="    for i in range(p):\n        src = (rank - i) % p",
        replace="    for i in range(p - 1):\n        src = (rank - i) % p",
        bug="ring_attention stops one step early (the last block is never scored)",
    ),
    dict(
        file="context/ring.py",
        find="    forwarded = T - sizes[(rank + 1) % p]  # every block but the one that arrives last, from rank + 1",
        replace="    forwarded = T - sizes[rank]",
        bug="ring_bytes_per_rank leaves out the wrong block (its own, not the last one to arrive)",
    ),
    dict(
        file="context/ring.py",
        find="    return config.num_hidden_layers * 2 * config.num_key_value_heads",
        replace="    return config.num_hidden_layers * config.num_key_value_heads",
        bug="ring_bytes_per_rank counts K but not V",
    ),
]
