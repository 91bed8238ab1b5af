"""Stage 03 part 2 learner bugs (llama.cpp's block formats and the GGUF export), one edit each, planted in
solutions/stage03_quantization (see labkit/grading/mutants.py)."""

MUTANTS = [
    # llamacpp_quants.py: Q8_0
    dict(
        file="llamacpp_quants.py",
        find="d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)",
        replace="d = blocks.max(axis=1, keepdims=True) / np.float32(127)",
        bug="quantize_q8_0 takes max(x), not max|x|, for the block scale",
    ),
    dict(
        file="llamacpp_quants.py",
        find="d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)",
        replace="d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(128)",
        bug="quantize_q8_0 divides the absmax by 128 instead of 127",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = roundf(blocks * inverse(d)).astype(np.int8)",
        replace="q = np.round(blocks * inverse(d)).astype(np.int8)",
        bug="quantize_q8_0 rounds ties to even (np.round), not away from zero like C's roundf",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = roundf(blocks * inverse(d)).astype(np.int8)",
        replace="q = roundf(blocks * inverse(fp16_value(fp16_bytes(d)))).astype(np.int8)",
        bug="quantize_q8_0 takes 1/d from the fp16-rounded d (ggml uses the float32 d)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="d, q = fp16_value(blocks[:, :2]), blocks[:, 2:].view(np.int8)",
        replace="d, q = fp16_value(blocks[:, :2]), blocks[:, 2:]",
        bug="dequantize_q8_0 reads the codes as uint8 (negative weights come back near +256·d)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="d, q = fp16_value(blocks[:, :2]), blocks[:, 2:].view(np.int8)",
        replace="d, q = fp16_value(blocks[:, 1::-1]), blocks[:, 2:].view(np.int8)",
        bug="dequantize_q8_0 reads the fp16 scale big-endian",
    ),
    # Q4_0
    dict(
        file="llamacpp_quants.py",
        find="m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)\n    d = m / np.float32(-8)",
        replace="m = np.take_along_axis(blocks, blocks.argmax(axis=1)[:, None], axis=1)\n    d = m / np.float32(-8)",
        bug="quantize_q4_0 takes the largest value, not the one of largest magnitude",
    ),
    dict(
        file="llamacpp_quants.py",
        find="d = m / np.float32(-8)",
        replace="d = np.abs(m) / np.float32(8)",
        bug="quantize_q4_0 drops the sign of the extreme value (d = absmax / 8)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = np.minimum(15, np.trunc(blocks * inverse(d) + np.float32(8.5))).astype(np.uint8)",
        replace="q = np.minimum(15, np.trunc(blocks * inverse(d) + np.float32(8))).astype(np.uint8)",
        bug="quantize_q4_0 truncates x/d + 8 instead of rounding (trunc of + 8.5)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = np.minimum(15, np.trunc(blocks * inverse(d) + np.float32(8.5))).astype(np.uint8)",
        replace="q = np.trunc(blocks * inverse(d) + np.float32(8.5)).astype(np.uint8)",
        bug="quantize_q4_0 does not clamp the code to 15 (a value of -m overflows the nibble)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="qs = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)",
        replace="qs = q[:, 0::2] | (q[:, 1::2] << 4)",
        bug="quantize_q4_0 packs neighbours 2j, 2j+1 into a byte instead of j and j + 16",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)",
        replace="q = np.concatenate([qs >> 4, qs & 0x0F], axis=1).astype(np.float32)",
        bug="dequantize_q4_0 reads the high nibble first",
    ),
    dict(
        file="llamacpp_quants.py",
        find="return (d * (q - 8)).reshape(shape)",
        replace="return (d * (q - 7)).reshape(shape)",
        bug="dequantize_q4_0 subtracts 7 instead of 8",
    ),
    # Q4_K: fit_min_scale
    dict(
        file="llamacpp_quants.py",
        find="lo = np.minimum(x.min(axis=1, keepdims=True), 0)",
        replace="lo = x.min(axis=1, keepdims=True)",
        bug="fit_min_scale does not widen the range to contain 0 (an all-positive sub-block gets a negative m)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="scale, mn = span / np.float32(nmax), lo",
        replace="scale, mn = span / np.float32(nmax + 1), lo",
        bug="fit_min_scale's plain fit divides the range by 16 levels instead of 15 steps",
    ),
    dict(
        file="llamacpp_quants.py",
        find="c_min = np.where(positive, 0, c_min)",
        replace="c_min = c_min",
        bug="fit_min_scale lets the least-squares min go above 0 (m < 0, which Q4_K cannot store)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="better = (c_err < best_err) & (det > 0)",
        replace="better = det > 0",
        bug="fit_min_scale keeps the last grid candidate, not the best one",
    ),
    dict(
        file="llamacpp_quants.py",
        find="for step in (nmax - 1 + 0.1 * np.arange(n_grid + 1)).astype(np.float32):",
        replace="for step in (nmax - 1 + 0.1 * np.arange(n_grid)).astype(np.float32):",
        bug="fit_min_scale's grid stops one step short (i < n_grid)",
    ),
    # pack / unpack
    dict(
        file="llamacpp_quants.py",
        find="b[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)",
        replace="b[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 2) << 6)",
        bug="pack_q4_k_scales stores the wrong 2 bits of ls[4:8] (>> 2 instead of >> 4)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="b[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)",
        replace="b[:, 8:12] = (lm[:, 4:] & 0x0F) | ((ls[:, 4:] & 0x0F) << 4)",
        bug="pack_q4_k_scales swaps the scale and min nibbles in bytes 8-11",
    ),
    dict(
        file="llamacpp_quants.py",
        find="lm = np.concatenate([b[:, 4:8] & 0x3F, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], axis=1)",
        replace="lm = np.concatenate([b[:, 4:8], (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], axis=1)",
        bug="unpack_q4_k_scales forgets to mask the first four mins to 6 bits",
    ),
    dict(
        file="llamacpp_quants.py",
        find="ls = np.concatenate([b[:, 0:4] & 0x3F, (b[:, 8:12] & 0x0F) | ((b[:, 0:4] >> 6) << 4)], axis=1)",
        replace="ls = np.concatenate([b[:, 0:4] & 0x3F, (b[:, 8:12] & 0x0F) | ((b[:, 4:8] >> 6) << 4)], axis=1)",
        bug="unpack_q4_k_scales takes the top bits of scales 4-7 from the min bytes",
    ),
    # encode / dequantize Q4_K
    dict(
        file="llamacpp_quants.py",
        find="ls = np.minimum(63, np.rint(scale * (np.float32(63) * inverse(max_scale)))).astype(np.uint8)",
        replace="ls = np.minimum(63, scale * (np.float32(63) * inverse(max_scale))).astype(np.uint8)",
        bug="encode_q4_k truncates the 6-bit sub-block scales instead of rounding",
    ),
    dict(
        file="llamacpp_quants.py",
        find="step = fp16_value(d_bytes) * ls  # (n, 8): what the decoder will multiply by",
        replace="step = max_scale / np.float32(63) * ls",
        bug="encode_q4_k rounds the weights with the float32 d, not the fp16 d the decoder reads",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = np.clip(np.rint(divide(sub + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)",
        replace="q = np.clip(np.rint(divide(sub - offset[..., None], step[..., None])), 0, 15).astype(np.uint8)",
        bug="encode_q4_k subtracts the min instead of adding it back before dividing",
    ),
    dict(
        file="llamacpp_quants.py",
        find="qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)",
        replace="qs = (q[:, 1::2] | (q[:, 0::2] << 4)).reshape(n, 128)",
        bug="encode_q4_k puts the odd sub-block in the low nibble",
    ),
    dict(
        file="llamacpp_quants.py",
        find="d, dmin = fp16_value(blocks[:, 0:2]), fp16_value(blocks[:, 2:4])",
        replace="dmin, d = fp16_value(blocks[:, 0:2]), fp16_value(blocks[:, 2:4])",
        bug="dequantize_q4_k reads dmin before d",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)",
        replace="q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(n, 8, 32).astype(np.float32)",
        bug="dequantize_q4_k takes all low nibbles first (sub-blocks 0-3), not low/high per 32-byte chunk",
    ),
    dict(
        file="llamacpp_quants.py",
        find="return ((d * ls)[..., None] * q - (dmin * lm)[..., None]).reshape(shape)",
        replace="return ((d * ls)[..., None] * q + (dmin * lm)[..., None]).reshape(shape)",
        bug="dequantize_q4_k adds the min instead of subtracting it",
    ),
    # Q6_K: fit_symmetric_scale
    dict(
        file="llamacpp_quants.py",
        find="m = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)\n    inv_m",
        replace="m = np.take_along_axis(x, x.argmax(axis=1)[:, None], axis=1)\n    inv_m",
        bug="fit_symmetric_scale takes the largest value, not the one of largest magnitude",
    ),
    dict(
        file="llamacpp_quants.py",
        find="scale = m / np.float32(-nmax)",
        replace="scale = m / np.float32(nmax)",
        bug="fit_symmetric_scale's plain scale has the wrong sign (m lands on +nmax, clipped to nmax - 1)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="better = (c_err < best_err) & (sum_q2 > 0)",
        replace="better = sum_q2 > 0",
        bug="fit_symmetric_scale keeps the last grid candidate, not the best one",
    ),
    dict(
        file="llamacpp_quants.py",
        find="for step in (nmax + 0.1 * np.arange(-n_grid, n_grid + 1)).astype(np.float32):",
        replace="for step in (nmax + 0.1 * np.arange(0, n_grid + 1)).astype(np.float32):",
        bug="fit_symmetric_scale searches only the grids above nmax (i = 0 … n_grid)",
    ),
    # encode / dequantize Q6_K
    dict(
        file="llamacpp_quants.py",
        find="iscale = np.float32(-128) * inverse(s_max)",
        replace="iscale = np.float32(127) * inverse(s_max)",
        bug="encode_q6_k maps the largest sub-block scale to +127 instead of -128",
    ),
    dict(
        file="llamacpp_quants.py",
        find="sc = np.minimum(127, np.rint(s * iscale)).astype(np.int8)",
        replace="sc = np.rint(s * iscale).astype(np.int8)",
        bug="encode_q6_k does not clamp the int8 scale at 127 (a scale of -s_max wraps to -128)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="step = fp16_value(d_bytes) * sc\n",
        replace="step = inverse(iscale) * sc\n",
        bug="encode_q6_k rounds the weights with the float32 d, not the fp16 d the decoder reads",
    ),
    dict(
        file="llamacpp_quants.py",
        find="ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)",
        replace="ql = np.concatenate([low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4)], axis=2)",
        bug="encode_q6_k pairs quarters 0/1 and 2/3 in the low-nibble bytes instead of 0/2 and 1/3",
    ),
    dict(
        file="llamacpp_quants.py",
        find="qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)",
        replace="qh = (q[:, :, 0] >> 4) | ((q[:, :, 2] >> 4) << 2) | ((q[:, :, 1] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)",
        bug="encode_q6_k swaps quarters 1 and 2 in the high 2-bit pairs",
    ),
    dict(
        file="llamacpp_quants.py",
        find="return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=1)",
        replace="return np.concatenate([d_bytes, ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8)], axis=1)",
        bug="encode_q6_k writes d first, as in the other formats (Q6_K keeps it last)",
    ),
    dict(
        file="llamacpp_quants.py",
        find="sc, d = blocks[:, 192:208].view(np.int8).astype(np.float32), fp16_value(blocks[:, 208:210])",
        replace="sc, d = blocks[:, 192:208].astype(np.float32), fp16_value(blocks[:, 208:210])",
        bug="dequantize_q6_k reads the sub-block scales as uint8",
    ),
    dict(
        file="llamacpp_quants.py",
        find="high = np.concatenate([(qh >> (2 * k)) & 0x03 for k in range(4)], axis=2)",
        replace="high = np.concatenate([(qh >> k) & 0x03 for k in range(4)], axis=2)",
        bug="dequantize_q6_k shifts the high pairs by k instead of 2k",
    ),
    dict(
        file="llamacpp_quants.py",
        find="q = (low | (high << 4)).astype(np.float32).reshape(n, 16, 16) - 32",
        replace="q = (low | (high << 4)).astype(np.float32).reshape(n, 16, 16) - 31",
        bug="dequantize_q6_k subtracts 31 instead of 32",
    ),
    # gguf_export.py: permute_qk
    dict(
        file="gguf_export.py",
        find="return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)",
        replace="return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)",
        bug="permute_qk applies the inverse permutation (llama.cpp's → HF's)",
    ),
    dict(
        file="gguf_export.py",
        find="return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)",
        replace="return w.reshape(2, rows // 2, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)",
        bug="permute_qk interleaves the halves of the whole matrix, not of each head",
    ),
    # tensor_type
    dict(
        file="gguf_export.py",
        find='is_output = name == "output.weight" or (name == "token_embd.weight" and not has_output)',
        replace='is_output = name in ("output.weight", "token_embd.weight")',
        bug="tensor_type treats the token embedding as the output matrix even when output.weight exists",
    ),
    dict(
        file="gguf_export.py",
        find='if is_output and mix != "Q8_0":',
        replace="if is_output:",
        bug="tensor_type gives the output matrix Q6_K in a Q8_0 file too",
    ),
    dict(
        file="gguf_export.py",
        find="more_bits = layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2",
        replace="more_bits = layer < n_layer // 8 or layer > 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2",
        bug="use_more_bits misses the first layer of the last eighth (> instead of ≥)",
    ),
    dict(
        file="gguf_export.py",
        find="more_bits = layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2",
        replace="more_bits = layer < n_layer // 8 or layer >= 7 * n_layer // 8 or layer % 3 == 2",
        bug="use_more_bits counts every third layer from 0, not from n_layer / 8",
    ),
    dict(
        file="gguf_export.py",
        find='chosen = "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits else "Q4_K"',
        replace='chosen = "Q6_K" if name.endswith(("attn_v.weight", "ffn_up.weight")) and more_bits else "Q4_K"',
        bug="tensor_type gives ffn_up the extra bits instead of ffn_down",
    ),
    dict(
        file="gguf_export.py",
        find='return chosen if shape[-1] % block == 0 else "F32"',
        replace='return chosen if shape[0] % block == 0 else "F32"',
        bug="tensor_type checks the number of rows, not the row length, against the block size",
    ),
    dict(
        file="gguf_export.py",
        find='block = 256 if chosen.endswith("_K") else 32',
        replace="block = 32",
        bug="tensor_type checks every type against 32-weight blocks (K-quants need 256)",
    ),
]
