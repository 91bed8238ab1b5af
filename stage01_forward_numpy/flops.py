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
    raise NotImplementedError("stage01: param_count — see lab.ipynb §11")


def forward_flops(config: dict, seq_len: int) -> int:
    """Matmul FLOPs of one forward pass over seq_len tokens (a prefill), lm_head at every position.

    = 2 · seq_len · (number of weights used in matmuls)       the ≈ 2·N·L rule
    + per layer and head 2 · 2 · seq_len² · head_dim          q·kᵀ and probabilities·v, full T×T,
                                                              as a plain implementation computes it
    Embedding lookups, norms, activations, softmax and biases are left out: they are O(T·D), not
    O(T·D²). This is what torch.utils.flop_counter.FlopCounterMode reports for the HF model.
    """
    raise NotImplementedError("stage01: forward_flops — see lab.ipynb §11")
