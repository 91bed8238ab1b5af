"""Stage 02 learner bugs, one edit each, planted in solutions/stage02_kv_cache (see labkit/grading/mutants.py)."""

MUTANTS = [
    # kv_cache.py
    dict(
        file="kv_cache.py",
        find="if end > self.max_seq_len:",
        replace="if end > self.max_seq_len + 1:",
        bug="LayerCache.append overflow check off by one",
    ),
    dict(
        file="kv_cache.py",
        find="self.k[:, :, self.length : end] = k\n        self.v[:, :, self.length : end] = v\n        self.length = end",
        replace="self.k[:, :, self.length : end] = k\n        self.v[:, :, self.length : end] = k\n        self.length = end",
        bug="LayerCache.append stores the keys in the value buffer",
    ),
    dict(
        file="kv_cache.py",
        find="return self.k[:, :, :end], self.v[:, :, :end]",
        replace="return self.k, self.v",
        bug="LayerCache.append returns the whole buffer, empty slots included",
    ),
    dict(
        file="kv_cache.py",
        find="return self.k[:, :, :end], self.v[:, :, :end]",
        replace="return self.k[:, :, :end].clone(), self.v[:, :, :end].clone()",
        bug="LayerCache.append copies instead of returning views",
    ),
    dict(
        file="kv_cache.py",
        find="        self.length = end\n",
        replace="        self.length += 1\n",
        bug="LayerCache.append advances length by one whatever T is",
    ),
    dict(
        file="kv_cache.py",
        find="if not 0 <= n <= self.length:",
        replace="if not 0 <= n <= self.max_seq_len:",
        bug="LayerCache.truncate lets the cache grow past what it holds",
    ),
    dict(
        file="kv_cache.py",
        find="        self.length = n\n",
        replace="        self.length = max(n - 1, 0)\n",
        bug="LayerCache.truncate keeps one token too few",
    ),
    dict(
        file="kv_cache.py",
        find="        for layer in self.layers:\n            layer.truncate(n)",
        replace="        self.layers[0].truncate(n)",
        bug="KVCache.truncate rolls back only the first layer",
    ),
    # cached_llama.py
    dict(
        file="cached_llama.py",
        find="slots = torch.arange(start, start + T)[None, :]",
        replace="slots = torch.arange(0, T)[None, :]",
        bug="token_positions ignores the cached length (decode step at position 0)",
    ),
    dict(
        file="cached_llama.py",
        find="return positions.masked_fill(positions < 0, -1)",
        replace="return positions",
        bug="token_positions leaves padding at negative positions other than -1",
    ),
    dict(
        file="cached_llama.py",
        find="positions = slots - pad[:, None]",
        replace="positions = slots",
        bug="token_positions ignores left padding",
    ),
    dict(
        file="cached_llama.py",
        find="mask = (k >= 0) & (k <= q)",
        replace="mask = k <= q",
        bug="attention_mask lets queries attend to padding",
    ),
    dict(
        file="cached_llama.py",
        find="mask = (k >= 0) & (k <= q)",
        replace="mask = (k >= 0) & (k < q)",
        bug="attention_mask hides the query's own key",
    ),
    dict(
        file="cached_llama.py",
        find="mask &= k > q - window",
        replace="mask &= k >= q - window",
        bug="sliding window one key too wide",
    ),
    dict(
        file="cached_llama.py",
        find="k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)",
        replace="k, v = k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1)",
        bug="GQA heads tiled instead of repeated (head h reads kv head h % n_kv)",
    ),
    dict(
        file="cached_llama.py",
        find="scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])",
        replace="scores = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-2])",
        bug="attention scaled by sqrt(S) instead of sqrt(head_dim)",
    ),
    dict(
        file="cached_llama.py",
        find="scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)",
        replace='scores = scores.masked_fill(~mask, float("-inf"))',
        bug="mask with -inf: an all-padding query row becomes NaN",
    ),
    dict(
        file="cached_llama.py",
        find="return scores.softmax(dim=-1) @ v",
        replace="return scores.softmax(dim=-2) @ v",
        bug="softmax over the query axis",
    ),
    dict(
        file="cached_llama.py",
        find="q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])\n    if cache is not None:\n        k, v = cache.append(k, v)",
        replace="q = apply_rope(q, cos[:, None], sin[:, None])\n    if cache is not None:\n        k, v = cache.append(k, v)\n    k = apply_rope(k, cos[:, None], sin[:, None]) if cache is None else k",
        bug="keys cached before RoPE (cached keys never rotated)",
    ),
    dict(
        file="cached_llama.py",
        find="cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)",
        replace="cos, sin = rope_cos_sin(positions, c.head_dim, 10000.0, x.dtype)",
        bug="attention_block hard-codes rope_theta = 10 000",
    ),
    dict(
        file="cached_llama.py",
        find="k = attn.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)",
        replace="k = attn.k_proj(x).view(B, c.num_key_value_heads, T, c.head_dim)",
        bug="attention_block reshapes k to heads without the transpose",
    ),
    dict(
        file="cached_llama.py",
        find="return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))",
        replace="return attn.o_proj(y.reshape(B, T, -1))",
        bug="attention_block merges heads without transposing back",
    ),
    # generate.py
    dict(
        file="generate.py",
        find="probs = torch.softmax(logits.float() / temperature, dim=-1)",
        replace="probs = torch.softmax(logits.float(), dim=-1)",
        bug="sample ignores the temperature",
    ),
    dict(
        file="generate.py",
        find="ids.append(int(sample(logits[:, -1], temperature, generator)))",
        replace="ids.append(int(sample(logits[:, 0], temperature, generator)))",
        bug="generate_no_cache samples from the first position",
    ),
    dict(
        file="generate.py",
        find="cache = KVCache(model.config, 1, len(prompt) + max_new_tokens, dtype)",
        replace="cache = KVCache(model.config, 1, len(prompt) + max_new_tokens, torch.float32)",
        bug="generate_kv_cache allocates a float32 cache whatever the model's dtype",
    ),
    dict(
        file="generate.py",
        find="            logits = forward(model, token[:, None], cache)",
        replace="            logits = forward(model, torch.tensor([prompt + out]))",
        bug="generate_kv_cache re-runs the whole sequence each step (no cache)",
    ),
    dict(
        file="generate.py",
        find="        if step + 1 < max_new_tokens:\n            logits = forward(model, token[:, None], cache)",
        replace="        logits = forward(model, token[:, None], cache)",
        bug="generate_kv_cache runs one forward too many (overflows an exact-size cache)",
        equivalent="the cache has room for prompt + max_new_tokens, so the surplus step fits and the tokens are the same; the course's contract (test_cached_generation_never_reruns_the_prefix) allows that one extra step",
    ),
    dict(
        file="generate.py",
        find="ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])",
        replace="ids = torch.tensor([list(p) + [pad_id] * (width - len(p)) for p in prompts])",
        bug="left_pad pads on the right",
    ),
    dict(
        file="generate.py",
        find="pad = torch.tensor([width - len(p) for p in prompts])",
        replace="pad = torch.tensor([0 for p in prompts])",
        bug="left_pad reports no padding",
    ),
    dict(
        file="generate.py",
        find="            logits = forward(model, tokens[:, None], cache, pad)",
        replace="            logits = forward(model, tokens[:, None], cache)",
        bug="generate_batched forgets pad on decode steps",
    ),
    dict(
        file="generate.py",
        find="ids, pad = left_pad(prompts, pad_id)",
        replace="ids, pad = left_pad(prompts, 0)",
        bug="generate_batched ignores pad_id",
        equivalent="padding slots are masked out of attention, so the id that fills them never reaches a visible token",
    ),
    # int8_cache.py
    dict(
        file="int8_cache.py",
        find="scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 127",
        replace="scale = x.abs().amax(dim=-1, keepdim=True).float() / 127",
        bug="quantize_int8 lets an all-zero vector get scale 0 (NaN codes)",
    ),
    dict(
        file="int8_cache.py",
        find="scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 127",
        replace="scale = x.abs().amax(dim=-2, keepdim=True).float().clamp(min=1e-12) / 127",
        bug="quantize_int8 takes the absmax over tokens instead of head_dim",
    ),
    dict(
        file="int8_cache.py",
        find="q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)",
        replace="q = (x.float() / scale).clamp(-127, 127).to(torch.int8)",
        bug="quantize_int8 truncates instead of rounding",
    ),
    dict(
        file="int8_cache.py",
        find="q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)",
        replace="q = torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)",
        bug="quantize_int8 clamps to [-128, 127]",
        equivalent="with scale = max|x| / 127, round(x / scale) already lies in [-127, 127]; the clamp bound is never reached",
    ),
    dict(
        file="int8_cache.py",
        find="return (q.float() * scale).to(dtype)",
        replace="return q.float() * scale",
        bug="dequantize_int8 ignores dtype",
    ),
    dict(
        file="int8_cache.py",
        find="values = dequantize_int8(self.v[:, :, :end], self.v_scale[:, :, :end], self.dtype)",
        replace="values = dequantize_int8(self.v[:, :, :end], self.k_scale[:, :, :end], self.dtype)",
        bug="Int8LayerCache.append dequantizes values with the key scales",
    ),
    dict(
        file="int8_cache.py",
        find="keys = dequantize_int8(self.k[:, :, :end], self.k_scale[:, :, :end], self.dtype)",
        replace="keys = dequantize_int8(self.k[:, :, :end], self.k_scale[:, :, :end])",
        bug="Int8LayerCache.append returns float32 whatever the cache dtype",
    ),
    dict(
        file="int8_cache.py",
        find="        if end > self.max_seq_len:",
        replace="        if end > self.max_seq_len + 1:",
        bug="Int8LayerCache.append overflow check off by one",
    ),
    # memory.py
    dict(
        file="memory.py",
        find="return math.ceil(2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes)",
        replace="return math.ceil(n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes)",
        bug="kv_cache_bytes forgets the factor 2 for K and V",
    ),
    dict(
        file="memory.py",
        find="return math.ceil(2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes)",
        replace="return int(2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes)",
        bug="kv_cache_bytes rounds int4 sizes down",
        equivalent="the factor 2 for K and V makes 2·…·dtype_bytes an integer for every real element size (4, 2, 1, 0.5 bytes)",
    ),
    dict(
        file="memory.py",
        find="return kv_cache_bytes(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 1, 1, dtype_bytes)",
        replace="return kv_cache_bytes(config.num_hidden_layers, config.num_attention_heads, config.head_dim, 1, 1, dtype_bytes)",
        bug="kv_bytes_per_token counts query heads instead of KV heads",
    ),
    dict(
        file="memory.py",
        find="free = gpu_bytes - weight_bytes",
        replace="free = gpu_bytes",
        bug="max_concurrent_requests forgets the weights",
    ),
    dict(
        file="memory.py",
        find="return max(0, free // per_request)",
        replace="return free // per_request",
        bug="max_concurrent_requests negative when the weights do not fit",
    ),
    dict(
        file="memory.py",
        find="bytes_moved = n_params * weight_bytes_per_param + batch * kv_bytes_per_request",
        replace="bytes_moved = batch * (n_params * weight_bytes_per_param + kv_bytes_per_request)",
        bug="decode_arithmetic_intensity reads the weights once per request",
    ),
    dict(
        file="memory.py",
        find="flops = 2 * n_params * batch",
        replace="flops = n_params * batch",
        bug="decode_arithmetic_intensity counts 1 FLOP per parameter",
    ),
    # sliding_window.py
    dict(
        file="sliding_window.py",
        find="keep = min(T, self.window)",
        replace="keep = T",
        bug="RingLayerCache.append writes more than window slots on a long prefill",
        equivalent="writing every position of a long prefill sends several to one slot; CPU index_put keeps the last write, which is the newest position, the one keep = min(T, window) selects",
    ),
    dict(
        file="sliding_window.py",
        find="slots = pos % self.window",
        replace="slots = (pos + 1) % self.window",
        bug="RingLayerCache.append puts position p in slot p + 1",
    ),
    dict(
        file="sliding_window.py",
        find="        self.slot_pos[slots] = pos\n",
        replace="",
        bug="RingLayerCache.append forgets to record slot positions",
    ),
    dict(
        file="sliding_window.py",
        find="        self.length += T\n",
        replace="        self.length += keep\n",
        bug="RingLayerCache.append counts only the kept tokens",
    ),
    dict(
        file="sliding_window.py",
        find="keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)",
        replace="keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.k, v], dim=2)",
        bug="RingLayerCache.append returns ring keys as values",
    ),
    dict(
        file="sliding_window.py",
        find="mask = attention_mask(q_pos, k_pos, cache.window)",
        replace="mask = attention_mask(q_pos, k_pos)",
        bug="forward_sliding forgets the window in the mask",
    ),
    dict(
        file="sliding_window.py",
        find="k_pos = torch.cat([cache.layers[0].slot_pos[None], q_pos], dim=1)",
        replace="k_pos = torch.cat([cache.layers[0].slot_pos[None].clamp(min=0), q_pos], dim=1)",
        bug="forward_sliding treats empty ring slots as position 0",
    ),
    dict(
        file="sliding_window.py",
        find=(
            "        keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)\n"
            "        keep = min(T, self.window)\n"
            "        pos = torch.arange(self.length + T - keep, self.length + T)\n"
            "        slots = pos % self.window\n"
            "        self.k[:, :, slots] = k[:, :, T - keep :]\n"
            "        self.v[:, :, slots] = v[:, :, T - keep :]\n"
        ),
        replace=(
            "        keep = min(T, self.window)\n"
            "        pos = torch.arange(self.length + T - keep, self.length + T)\n"
            "        slots = pos % self.window\n"
            "        self.k[:, :, slots] = k[:, :, T - keep :]\n"
            "        self.v[:, :, slots] = v[:, :, T - keep :]\n"
            "        keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)\n"
        ),
        bug="RingLayerCache.append writes the chunk into the ring before reading it (a chunk's early queries lose keys)",
    ),
    dict(
        file="sliding_window.py",
        find="k_pos = torch.cat([cache.layers[0].slot_pos[None], q_pos], dim=1)",
        replace="k_pos = torch.cat([torch.arange(cache.length - cache.window, cache.length)[None], q_pos], dim=1)",
        bug="forward_sliding assumes the ring holds its positions in ascending slot order",
    ),
]
