"""Stage 02 part 2 learner bugs (MLA, attention sinks, H2O), one edit each, planted in
solutions/stage02_kv_cache (see labkit/grading/mutants.py)."""

MUTANTS = [
    # mla.py: project_q
    dict(
        file="mla.py",
        find="return q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]",
        replace="return q[..., c.qk_rope_head_dim :], q[..., : c.qk_rope_head_dim]",
        bug="project_q reads each head as [rope | nope] instead of [nope | rope]",
    ),
    dict(
        file="mla.py",
        find="attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))",
        replace="attn.q_b_proj(attn.q_a_proj(x))",
        bug="project_q skips q_a_layernorm on the low-rank query",
    ),
    dict(
        file="mla.py",
        find="q = q.view(B, T, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim).transpose(1, 2)",
        replace="q = q.view(B, c.num_attention_heads, T, c.qk_nope_head_dim + c.qk_rope_head_dim)",
        bug="project_q views (B, T, H·d) straight as (B, H, T, d) instead of splitting heads then transposing",
    ),
    # mla.py: project_kv_latent
    dict(
        file="mla.py",
        find="return attn.kv_a_layernorm(kv[..., : c.kv_lora_rank]), kv[..., c.kv_lora_rank :]",
        replace="return kv[..., : c.kv_lora_rank], kv[..., c.kv_lora_rank :]",
        bug="project_kv_latent forgets kv_a_layernorm on the latent",
    ),
    dict(
        file="mla.py",
        find="return attn.kv_a_layernorm(kv[..., : c.kv_lora_rank]), kv[..., c.kv_lora_rank :]",
        replace="return attn.kv_a_layernorm(kv[..., c.qk_rope_head_dim :]), kv[..., : c.qk_rope_head_dim]",
        bug="project_kv_latent reads kv_a_proj_with_mqa's output as [rope key | latent]",
    ),
    # mla.py: MLALayerCache.append
    dict(
        file="mla.py",
        find="if end > self.max_seq_len:",
        replace="if end >= self.max_seq_len:",
        bug="MLALayerCache.append refuses to fill the last slot (overflow check off by one)",
    ),
    dict(
        file="mla.py",
        find="return self.c_kv[:, :end], self.k_pe[:, :end]",
        replace="return self.c_kv, self.k_pe",
        bug="MLALayerCache.append returns the whole buffer, empty slots included",
    ),
    dict(
        file="mla.py",
        find="        self.length = end\n        return self.c_kv",
        replace="        self.length += 1\n        return self.c_kv",
        bug="MLALayerCache.append advances length by one whatever T is",
    ),
    # mla.py: attend_expanded
    dict(
        file="mla.py",
        find="scores = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe[:, None].transpose(-1, -2)) * attn.scaling",
        replace="scores = q_nope @ k_nope.transpose(-1, -2) * attn.scaling + q_pe @ k_pe[:, None].transpose(-1, -2)",
        bug="attend_expanded scales only the no-RoPE part of the scores",
    ),
    dict(
        file="mla.py",
        find="kv = attn.kv_b_proj(c_kv).view(B, S, c.num_attention_heads, -1).transpose(1, 2)",
        replace="kv = attn.kv_b_proj(c_kv).view(B, c.num_attention_heads, S, -1)",
        bug="attend_expanded views kv_b_proj's output as (B, H, S, n + v) without transposing",
    ),
    dict(
        file="mla.py",
        find="return y.transpose(1, 2).reshape(B, q_nope.shape[2], -1)",
        replace="return y.reshape(B, q_nope.shape[2], -1)",
        bug="attend_expanded concatenates heads without moving T before H",
    ),
    # mla.py: attend_absorbed
    dict(
        file="mla.py",
        find="masked_softmax(scores * attn.scaling, mask)",
        replace="masked_softmax(scores * attn.config.kv_lora_rank**-0.5, mask)",
        bug="attend_absorbed scales by 1/sqrt(kv_lora_rank), the latent width, not 1/sqrt(n + p)",
    ),
    dict(
        file="mla.py",
        find='scores = torch.einsum("bhtr,bsr->bhts", q_latent, c_kv) + torch.einsum("bhtp,bsp->bhts", q_pe, k_pe)',
        replace='scores = torch.einsum("bhtr,bsr->bhts", q_latent, c_kv)',
        bug="attend_absorbed drops the RoPE part of the scores",
    ),
    dict(
        file="mla.py",
        find='q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, W_UK)',
        replace='q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, W_UK.flip(0))',
        bug="attend_absorbed pairs each query head with another head's W_UK",
    ),
    dict(
        file="mla.py",
        find="masked_softmax(scores * attn.scaling, mask), c_kv)",
        replace="masked_softmax(scores * attn.scaling, None), c_kv)",
        bug="attend_absorbed ignores the causal mask",
    ),
    # mla.py: mla_block
    dict(
        file="mla.py",
        find="q_pe, k_pe = rope(q_pe, positions, attn.config), rope(k_pe, positions, attn.config)",
        replace="q_pe, k_pe = rope(q_pe, positions, attn.config), k_pe",
        bug="mla_block rotates the query's RoPE part but not the shared key's",
    ),
    dict(
        file="mla.py",
        find="q_pe, k_pe = rope(q_pe, positions, attn.config), rope(k_pe, positions, attn.config)",
        replace=(
            "local = torch.arange(x.shape[1])\n"
            "    q_pe, k_pe = rope(q_pe, local, attn.config), rope(k_pe, local, attn.config)"
        ),
        bug="mla_block rotates by 0..T-1 every call, ignoring the absolute positions (decode at position 0)",
    ),
    dict(
        file="mla.py",
        find="y = (attend_absorbed if absorbed else attend_expanded)",
        replace="y = (attend_expanded if absorbed else attend_absorbed)",
        bug="mla_block picks the expanded form when asked for the absorbed one",
    ),
    # mla.py: kv_bytes_per_token, expanded_bytes_per_token
    dict(
        file="mla.py",
        find="return int(L * (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes)",
        replace="return int(L * config.kv_lora_rank * dtype_bytes)",
        bug="kv_bytes_per_token counts the latent but not the shared RoPE key",
    ),
    dict(
        file="mla.py",
        find="return int(L * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes)",
        replace="return int(L * 2 * config.num_attention_heads * config.head_dim * dtype_bytes)",
        bug="kv_bytes_per_token counts query heads, not KV heads (GQA/MQA save nothing)",
    ),
    dict(
        file="mla.py",
        find="return int(L * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes)",
        replace=(
            "return int(L * 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)"
            " * dtype_bytes)"
        ),
        bug="kv_bytes_per_token assumes head_dim = hidden_size / heads (wrong for Qwen3, Gemma)",
    ),
    dict(
        file="mla.py",
        find="per_layer = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)",
        replace="per_layer = config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim)",
        bug="expanded_bytes_per_token leaves the RoPE part out of each head's key",
    ),
    dict(
        file="mla.py",
        find="per_layer = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)",
        replace="per_layer = 2 * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)",
        bug="expanded_bytes_per_token assumes the value is as wide as the key (v_head_dim = n + p)",
    ),
    # sinks.py: SinkWindow.victim
    dict(
        file="sinks.py",
        find="candidates = torch.where(pos >= self.n_sink, pos, torch.iinfo(pos.dtype).max)",
        replace="candidates = torch.where(pos > self.n_sink, pos, torch.iinfo(pos.dtype).max)",
        bug="SinkWindow.victim protects n_sink + 1 sinks (off by one)",
    ),
    dict(
        file="sinks.py",
        find="        return int(candidates.argmin())\n\n\nclass H2O",
        replace="        return int(candidates.min())\n\n\nclass H2O",
        bug="SinkWindow.victim returns the victim's position, not its slot",
    ),
    dict(
        file="sinks.py",
        find="candidates = torch.where(pos >= self.n_sink, pos, torch.iinfo(pos.dtype).max)\n        return int(candidates.argmin())",
        replace="return int(pos[self.n_sink :].argmin()) + self.n_sink",
        bug="SinkWindow.victim treats the first n_sink slots as the sinks, as if slots stayed in position order",
    ),
    # sinks.py: H2O.victim
    dict(
        file="sinks.py",
        find="pos >= pos.sort().values[-self.n_recent]",
        replace="pos >= pos.sort().values[-self.n_recent - 1]",
        bug="H2O.victim protects n_recent + 1 recent tokens (off by one)",
    ),
    dict(
        file="sinks.py",
        find="protected = pos >= pos.sort().values[-self.n_recent] if self.n_recent > 0 else torch.zeros_like(pos, dtype=bool)",
        replace="protected = pos >= pos.sort().values[-self.n_recent]",
        bug="H2O.victim with n_recent=0: values[-0] is the oldest, so every token is protected",
    ),
    dict(
        file="sinks.py",
        find="protected = pos >= pos.sort().values[-self.n_recent] if self.n_recent > 0 else torch.zeros_like(pos, dtype=bool)",
        replace="protected = torch.arange(len(pos)) >= len(pos) - self.n_recent",
        bug="H2O.victim protects the last n_recent slots, as if slots stayed in position order",
    ),
    dict(
        file="sinks.py",
        find="candidates = torch.where(protected, math.inf, score)",
        replace="candidates = torch.where(protected, 0.0, score)",
        bug="H2O.victim masks the protected tokens with 0 instead of +inf, so it evicts a recent one",
    ),
    dict(
        file="sinks.py",
        find="return int(torch.where(lowest, pos, torch.iinfo(pos.dtype).max).argmin())",
        replace="return int(candidates.argmin())",
        bug="H2O.victim breaks ties by slot, not by the oldest position",
    ),
    # sinks.py: StreamingLayerCache.kept, store
    dict(
        file="sinks.py",
        find="return order[self.pos[order] >= 0]",
        replace="return order[self.pos >= 0]",
        bug="kept() filters the sorted slots with the unsorted mask",
    ),
    dict(
        file="sinks.py",
        find="return order[self.pos[order] >= 0]",
        replace="return (self.pos >= 0).nonzero().flatten()",
        bug="kept() lists the slots in slot order, not original-position order",
    ),
    dict(
        file="sinks.py",
        find="return order[self.pos[order] >= 0]",
        replace="return order[self.pos[order] > 0]",
        bug="kept() drops position 0, the first sink (empty is -1, not 0)",
    ),
    dict(
        file="sinks.py",
        find="        self.score[slot] = score\n",
        replace="        self.score[slot] += score\n",
        bug="store() lets the new token inherit the evicted token's accumulated score",
    ),
    dict(
        file="sinks.py",
        find="slot = int(empty[0]) if len(empty) else self.policy.victim(self.pos, self.score)",
        replace="slot = self.length % self.budget",
        bug="store() overwrites slots round-robin like a ring buffer, ignoring the policy",
    ),
    dict(
        file="sinks.py",
        find="        self.pos[slot] = self.length\n",
        replace="        self.pos[slot] = self.length + 1\n",
        bug="store() records positions from 1, so one token too few is a sink",
    ),
    # sinks.py: streaming_attention
    dict(
        file="sinks.py",
        find="keys = apply_rope(keys, cos[rank], sin[rank])",
        replace="keys = apply_rope(keys, *rope_cos_sin(torch.cat([cache.pos[slots], torch.tensor([cache.length])]), c.head_dim, c.rope_theta, x.dtype))",
        bug="streaming_attention rotates by original positions, not by rank in the cache",
    ),
    dict(
        file="sinks.py",
        find="weights = (q_t @ repeat_kv(keys, n_rep).transpose(-1, -2)",
        replace="weights = (q_t @ keys.repeat(1, n_rep, 1, 1).transpose(-1, -2)",
        bug="streaming_attention tiles the KV heads (repeat) instead of interleaving them (repeat_kv) for GQA",
    ),
    dict(
        file="sinks.py",
        find="cache.score[slots] += received[:n]",
        replace="cache.score[:n] += received[:n]",
        bug="streaming_attention adds each key's weight to the slot of its rank, not to its slot",
    ),
    dict(
        file="sinks.py",
        find="received = weights.sum(dim=(0, 1, 2))",
        replace="received = weights.mean(dim=(0, 1, 2))",
        bug="streaming_attention averages the weights over heads instead of summing them",
    ),
    dict(
        file="sinks.py",
        find="cache.store(k_t, v_t, float(received[n]))",
        replace="cache.store(k_t, v_t, 0.0)",
        bug="streaming_attention stores the new token with score 0, dropping the weight it got from itself",
    ),
    dict(
        file="sinks.py",
        find="        cache.store(k_t, v_t, float(received[n]))\n    y = torch.cat(out, dim=2)",
        replace="    for t in range(T):\n        cache.store(k[:, :, t : t + 1], v[:, :, t : t + 1], 0.0)\n    y = torch.cat(out, dim=2)",
        bug="streaming_attention stores the chunk's tokens only after all of them attended: token t never sees tokens < t of its chunk",
    ),
]
