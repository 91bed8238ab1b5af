"""A compiled multi-token step for speculative verification, built on labkit.fast_decode's weight snapshot.

Verifying k drafts runs the target over k + 1 positions at once. The eager model spends such a step
mostly in dispatch (as it does a one-token step), so an eager verification of 5 tokens measured 4.37
compiled one-token steps on SmolLM2 (one thread, the cpp loop): a speculative decoder timed that way against the
compiled plain decode pays for the compiler it does not use. This step is StaticDecoder's, with the
one-token shapes widened to T: positions pos .. pos + T - 1 as a tensor, a causal mask over the
fixed window, the T new keys written in place. It compiles once per (T, window) and returns the
final normed hidden states beside the logits, since EAGLE's draft reads them. Compiled on the cpp loop
(kernels="cpp"), 2 tokens measured 1.05 one-token compiled steps and 5 tokens 1.36 (bench_results/stage06b_eagle.json).

Its matrices are stored (out, in) and multiplied as W @ x^T: for 5 rows of x, PyTorch's CPU GEMM
measured 1.7x a one-row product that way against 2.9x as x @ W with W (in, out), the one-row step's
layout (30 of SmolLM2's 576 x 3,072 matrices, one thread, shared 2-core AMD EPYC).

    cache = model.new_cache(1, 1024)
    verify = StaticVerifier(model, cache)       # build after the last weight change
    feats, logits = verify(ids)                 # (1, T) -> (1, T, hidden), (1, T, vocab); cache grows by T
"""

import torch
import torch.nn.functional as F

from .fast_decode import StaticDecoder, rms_norm
from .model import apply_rope, grouped_attention


class StaticVerifier(StaticDecoder):
    """StaticDecoder's snapshot, for T >= 1 tokens a step: float32 weights, "eager" or "compile", PyTorch's
    kernels or (kernels="cpp") labkit.cpu_kernels' float32 loop, which reads each weight once for all T rows."""

    def __init__(self, model, cache, backend: str = "compile", window: int = 256, kernels: str = "torch"):
        if backend not in ("eager", "compile"):
            raise ValueError(f"backend={backend!r}; StaticVerifier runs 'eager' or 'compile'")
        super().__init__(model, cache, backend, window, kernels=kernels)
        if self.kernels == "torch":
            with torch.no_grad():  # the snapshot's (L, in, out) stacks become (L, out, in), in place of the old
                for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
                    setattr(self, name, getattr(self, name).transpose(1, 2).contiguous())

    def matmul(self, x: torch.Tensor, w) -> torch.Tensor:
        """x (B, T, in) times w (out, in) -> (B, T, out): w @ x^T, or the cpp loop over all B * T rows at once."""
        if self.kernels == "cpp":
            return super().matmul(x, w)
        return (w @ x.reshape(-1, x.shape[-1]).T).T.reshape(*x.shape[:-1], -1)

    def step(self, ids: torch.Tensor, pos: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, T) int64 at positions pos ((T,) int64) -> (features (B, T, hidden), logits (B, T, vocab))."""
        c, eps = self.c, self.c.rms_norm_eps
        B, T = ids.shape
        H, KV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self.model.rope_cos[pos], self.model.rope_sin[pos]  # (T, D)
        mask = self.key_positions[None, :window] <= pos[:, None]  # (T, window): causal over the written keys
        for i in range(c.num_hidden_layers):
            qkv = self.matmul(rms_norm(x, self.norms[i, 0], eps), self.w_qkv[i])
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            q = apply_rope(q.view(B, T, H, D).transpose(1, 2), cos, sin)
            k = apply_rope(k.view(B, T, KV, D).transpose(1, 2), cos, sin)
            self.cache.k[i].index_copy_(2, pos, k)
            self.cache.v[i].index_copy_(2, pos, v.view(B, T, KV, D).transpose(1, 2))
            y = grouped_attention(q, self.cache.k[i][:, :, :window], self.cache.v[i][:, :, :window], mask)
            x = x + self.matmul(y.transpose(1, 2).reshape(B, T, H * D), self.w_o[i])
            gate, up = self.matmul(rms_norm(x, self.norms[i, 1], eps), self.w_gate_up[i]).chunk(2, dim=-1)
            x = x + self.matmul(F.silu(gate) * up, self.w_down[i])
        feats = rms_norm(x, self.final_norm, eps)
        return feats, self.matmul(feats, self.lm_head)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, T) int64 -> (features (B, T, hidden), logits (B, T, vocab)); writes positions
        cache.length .. cache.length + T - 1 and advances the cache by T."""
        T, length, max_len = ids.shape[1], self.cache.length, self.cache.max_seq_len
        if length + T > max_len:
            raise ValueError(f"KV cache full ({max_len} positions); create a longer one")
        window = self.window
        while window < length + T:  # the keys 0 .. length + T - 1 must fit
            window *= 2
        window = min(window, max_len)
        out = self.fn(ids, torch.arange(length, length + T, device=ids.device), window)
        self.cache.length += T
        return out
