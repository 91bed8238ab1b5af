"""The fast decode step beside the teaching model: fused weights, static shapes, compiled or captured.

labkit.model runs a one-token step as ~470 small PyTorch ops (~1,600 counting the ops they call):
at the tiny target's size a step costs its dispatch overhead, not its bytes. A GPU engine removes
that overhead by capturing the step's kernel launches once as a CUDA graph and replaying them;
the CPU analogue is torch.compile, which traces the step once and emits fused C++ loops. Both need
the step's shapes to stay the same from token to token, so this step:

- attends over the whole preallocated cache (max_seq_len keys) with a mask hiding positions not
  yet written, instead of a slice that grows every step;
- takes its position as a tensor, so RoPE rows and the cache slot are indexed, not sliced;
- runs q/k/v and gate/up each as one matmul on weights concatenated once (what vLLM and
  llama.cpp do), a snapshot: build the decoder after the last weight change.

    cache = model.new_cache(1, 1024)
    logits = model(prompt_ids, cache)             # prefill: the eager model writes the same cache
    step = StaticDecoder(model, cache, "compile") # "eager", "compile" (CPU) or "cudagraph" (GPU)
    logits = step(next_ids)                       # (B, 1) -> (B, 1, vocab); writes and advances cache

make bench STAGE=decode compares it with the eager model, Hugging Face and llama.cpp.
"""

import torch
import torch.nn.functional as F

from .model import KVCache, Llama, apply_rope, grouped_attention, refuse_extras

BACKENDS = ("eager", "compile", "cudagraph")


class StaticDecoder:
    """One-token decode steps on `cache` (a labkit.model.KVCache) with static shapes.

    backend: "eager" (the fused step, no compiler), "compile" (torch.compile, fixed shapes: compiles
    once, a few tens of seconds on CPU) or "cudagraph" (the fused step captured as one
    torch.cuda.CUDAGraph on first call; model and cache on a CUDA device).
    """

    def __init__(self, model: Llama, cache: KVCache, backend: str = "compile"):
        c = model.config
        refuse_extras(c, "labkit.fast_decode.StaticDecoder", max_len=cache.max_seq_len)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
        if backend == "cudagraph" and cache.k[0].device.type != "cuda":
            raise ValueError("backend='cudagraph' captures CUDA kernels: put the model and its cache on a GPU")
        self.model, self.cache, self.backend, self.c = model, cache, backend, c
        with torch.no_grad():  # (q + 2 kv heads) * head_dim rows, and 2 * intermediate rows
            self.qkv = [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) for a in self.attns()]
            self.gate_up = [torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in self.mlps()]
        self.key_positions = torch.arange(cache.max_seq_len, device=cache.k[0].device)
        self.fn = torch.compile(self.step, fullgraph=True, dynamic=False) if backend == "compile" else self.step
        self.graph = None

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids: (B, 1) int64 at position pos ((1,) int64 tensor) -> logits (B, 1, vocab)."""
        c, m = self.c, self.model
        B = ids.shape[0]
        H, KV, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = m.model.embed_tokens(ids)  # (B, 1, hidden)
        cos, sin = m.rope_cos[pos], m.rope_sin[pos]  # (1, D)
        mask = (self.key_positions <= pos)[None]  # (1, max_seq_len): the keys written so far
        for i, layer in enumerate(m.model.layers):
            qkv = F.linear(layer.input_layernorm(x), self.qkv[i])
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            q = apply_rope(q.view(B, H, 1, D), cos, sin)  # T = 1: (B, 1, H*D) views as (B, H, 1, D)
            k = apply_rope(k.view(B, KV, 1, D), cos, sin)
            self.cache.k[i].index_copy_(2, pos, k)  # write in place at slot pos
            self.cache.v[i].index_copy_(2, pos, v.view(B, KV, 1, D))
            y = grouped_attention(q, self.cache.k[i], self.cache.v[i], mask)
            x = x + layer.self_attn.o_proj(y.view(B, 1, H * D))
            gate, up = F.linear(layer.post_attention_layernorm(x), self.gate_up[i]).chunk(2, dim=-1)
            x = x + layer.mlp.down_proj(F.silu(gate) * up)
        return m.lm_head(m.model.norm(x))

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, 1) int64 -> logits (B, 1, vocab); writes position cache.length and advances it."""
        if self.cache.length >= self.cache.max_seq_len:
            raise ValueError(f"KV cache full ({self.cache.max_seq_len} positions); create a longer one")
        pos = torch.tensor([self.cache.length], device=ids.device)
        if self.backend == "cudagraph":
            logits = self.replay(ids, pos)
        else:
            logits = self.fn(ids, pos)
        self.cache.length += 1
        return logits

    def replay(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Capture the step once (static input buffers), then replay it: one launch per step."""
        if self.graph is None:
            self.ids, self.pos = ids.clone(), pos.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up off the capture (allocator, cuBLAS handles)
                self.step(self.ids, self.pos)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.step(self.ids, self.pos)
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites self.out

    def attns(self):
        return [layer.self_attn for layer in self.model.model.layers]

    def mlps(self):
        return [layer.mlp for layer in self.model.model.layers]
