"""A compiled multi-token step for speculative verification, built on labkit.fast_decode's weight snapshot.

Verifying k drafts runs the target over k + 1 positions at once. The eager model spends such a step
mostly in dispatch (as it does a one-token step), so an eager verification of 5 tokens measured 4.49
compiled one-token steps on SmolLM2 (one thread, the cpp loop): a speculative decoder timed that way against the
compiled plain decode pays for the compiler it does not use. This step is StaticDecoder's, with the
one-token shapes widened to T: positions pos .. pos + T - 1 as a tensor, a causal mask over the
fixed window, the T new keys written in place. It compiles once per (T, window) and returns the
final normed hidden states beside the logits, since EAGLE's draft reads them. Compiled on the cpp loop
(kernels="cpp"), 2 tokens measured 1.09 one-token compiled steps and 5 tokens 1.40 (bench_results/stage06b_eagle.json).
StaticDraft is the same step for an EAGLE head's one layer (a draft step: 0.051 of a target step compiled, 0.063
eager on the same kernels).

Its matrices are stored (out, in) and multiplied as W @ x^T: for 5 rows of x, PyTorch's CPU GEMM
measured 1.7x a one-row product that way against 2.9x as x @ W with W (in, out), the one-row step's
layout (30 of SmolLM2's 576 x 3,072 matrices, one thread, shared 2-core AMD EPYC).

    cache = model.new_cache(1, 1024)
    verify = StaticVerifier(model, cache)       # build after the last weight change
    feats, logits = verify(ids)                 # (1, T) -> (1, T, hidden), (1, T, vocab); cache grows by T
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import cpu_kernels
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
        feats = rms_norm(self.layers(F.embedding(ids, self.embed), pos, window), self.final_norm, self.c.rms_norm_eps)
        return feats, self.matmul(feats, self.lm_head)

    def layers(self, x: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
        """x (B, T, hidden) at positions pos ((T,) int64) through every layer, each writing its keys in the cache."""
        c, eps = self.c, self.c.rms_norm_eps
        B, T = x.shape[:2]
        H, KV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
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
        return x

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, T) int64 -> (features (B, T, hidden), logits (B, T, vocab)); writes positions
        cache.length .. cache.length + T - 1 and advances the cache by T."""
        return self.advance(ids.shape[1], ids)

    def advance(self, T: int, *inputs: torch.Tensor):
        """self.fn(*inputs, positions, window) over the next T positions, then the cache advanced by T."""
        length, max_len = self.cache.length, self.cache.max_seq_len
        if length + T > max_len:
            raise ValueError(f"KV cache full ({max_len} positions); create a longer one")
        window = self.window
        while window < length + T:  # the keys 0 .. length + T - 1 must fit
            window *= 2
        window = min(window, max_len)
        out = self.fn(*inputs, torch.arange(length, length + T, device=inputs[0].device), window)
        self.cache.length += T
        return out


class StaticDraft(StaticVerifier):
    """An EAGLE head's draft step (stage 06 part 2's draft_forward) with StaticVerifier's static shapes: T positions
    after the head's cached prefix, compiled once per T, the head's matrices (fc, its layer, its reduced LM head)
    in llama.cpp's Q8_0 with rows interleaved in eights (labkit.cpu_kernels' q8_0x8_matvec, as eagle.packed(head,
    "q8_0") stores them; float32 PyTorch where the kernels cannot build). Eager, with its matrices already on those
    loops, a draft step is about half PyTorch's dispatch (~100 small ops).

        draft = StaticDraft(head, head.new_cache(1024))
        feats, logits = draft(feats, next_ids)   # (T, hidden), (T,) -> (T, hidden), (T, vocab): as draft_forward
    """

    def __init__(self, head, cache, window: int = 256, backend: str = "compile"):
        target = head.target[0]
        model = SimpleNamespace(  # the head as a one-layer Llama: its layer, the target's RoPE tables and rows
            config=head.config, rope_cos=target.rope_cos, rope_sin=target.rope_sin, lm_head=head.lm_head,
            model=SimpleNamespace(layers=[head.layer], embed_tokens=target.model.embed_tokens, norm=target.model.norm),
        )  # fmt: skip
        super().__init__(model, cache, backend, window, kernels="cpp")
        fc = head.fc.weight.detach()
        self.fc, self.fc_bias = self.quantize(fc, "fc") if self.kernels == "cpp" else fc, head.fc.bias.detach()
        self.vocab, self.vocab_size = head.vocab, target.config.vocab_size

    def quantize(self, w: torch.Tensor, name: str):
        return cpu_kernels.pack_q8_0x8(*cpu_kernels.quantize_q8_0(w.detach()))

    def matmul(self, x: torch.Tensor, w) -> torch.Tensor:
        if self.kernels != "cpp":
            return super().matmul(x, w)
        return self.ops.q8_0x8_matvec(x.reshape(-1, x.shape[-1]), *w).view(*x.shape[:-1], -1)

    def step(self, feats: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, window: int):
        x = self.matmul(torch.cat([feats, F.embedding(ids, self.embed)], dim=-1), self.fc) + self.fc_bias
        x = self.layers(x[None], pos, window)[0]
        logits = torch.full((len(ids), self.vocab_size), -torch.inf)
        logits[:, self.vocab] = self.matmul(x, self.lm_head)
        return x, logits

    @torch.no_grad()
    def __call__(self, feats: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (T, hidden), ids (T,) int64 -> (predicted features (T, hidden), logits (T, vocab) float32)."""
        return self.advance(len(ids), feats, ids)
