"""Back-of-the-envelope arithmetic, made exact: how many parameters, how many FLOPs per prefill.

Both functions read an HF config dict (config.json, or `model.config.to_dict()`) of the GPT-2 or
the Llama family, told apart by config["model_type"]. One multiply-add counts as 2 FLOPs.
"""


def param_count(config: dict) -> int:
    """Number of parameters, exactly as `sum(p.numel() for p in hf_model.parameters())`.

    GPT-2: embeddings wte (V·D) and wpe (n_positions·D); per layer two LayerNorms (weight and bias),
    c_attn, c_proj, c_fc, c_proj (weights and biases); ln_f. MLP width is n_inner or 4·D.
    Llama: embed_tokens; per layer q/k/v/o and gate/up/down (no biases) and two RMSNorm weights; norm.
    Both: lm_head (V·D) counts only when untied (tie_word_embeddings False; the default is True
    for GPT-2, False for Llama).
    """
    c = config
    if c["model_type"] == "gpt2":
        D, V, L = c["n_embd"], c["vocab_size"], c["n_layer"]
        F = c.get("n_inner") or 4 * D
        per_layer = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * F + F) + (F * D + D)
        total = V * D + c["n_positions"] * D + L * per_layer + 2 * D
        tied = c.get("tie_word_embeddings", True)
    else:
        D, V, L, F = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["intermediate_size"]
        H = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or H
        hd = c.get("head_dim") or D // H
        per_layer = D * H * hd + 2 * D * kv * hd + H * hd * D + 3 * D * F + 2 * D
        total = V * D + L * per_layer + D
        tied = c.get("tie_word_embeddings", False)
    return total if tied else total + V * D


def forward_flops(config: dict, seq_len: int) -> int:
    """Matmul FLOPs of one forward pass over seq_len tokens (a prefill), lm_head at every position.

    = 2 · seq_len · (number of weights used in matmuls)       the ≈ 2·N·L rule
    + per layer and head 2 · 2 · seq_len² · head_dim          q·kᵀ and probabilities·v, full T×T,
                                                              as a plain implementation computes it
    Embedding lookups, norms, activations, softmax and biases are left out: they are O(T·D), not
    O(T·D²). This is what torch.utils.flop_counter.FlopCounterMode reports for the HF model.
    """
    c, T = config, seq_len
    if c["model_type"] == "gpt2":
        D, V, L = c["n_embd"], c["vocab_size"], c["n_layer"]
        F = c.get("n_inner") or 4 * D
        H, hd = c["n_head"], D // c["n_head"]
        weights_per_layer = D * 3 * D + D * D + 2 * D * F
    else:
        D, V, L, F = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["intermediate_size"]
        H = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or H
        hd = c.get("head_dim") or D // H
        weights_per_layer = D * H * hd + 2 * D * kv * hd + H * hd * D + 3 * D * F
    matmul_weights = L * weights_per_layer + V * D  # + lm_head
    return 2 * T * matmul_weights + L * H * 4 * T * T * hd
