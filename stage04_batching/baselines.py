"""What continuous batching is measured against, on the same weights. Both generate exactly
max_tokens greedy tokens per request (EOS ignored, as serving benchmarks do).

- sequential: one request at a time with labkit's contiguous KV cache.
- static_batching: requests in fixed batches; a batch is prefilled together and decoded until its
  longest member is done, so finished rows keep occupying the batch and nobody new can join.
"""

import time
from dataclasses import dataclass

import torch

from labkit.model import Llama

from .block_manager import BlockManager
from .config import EngineConfig
from .engine import run_batch
from .paged_attention import PagedKVCache
from .sequence import SamplingParams, Sequence


@dataclass
class Result:
    token_ids: list[int]
    arrival_time: float
    first_token_time: float
    finish_time: float


@torch.inference_mode()
def sequential(model: Llama, prompts: list[list[int]], max_tokens: list[int]) -> list[Result]:
    """Serve the requests one after another; all arrive at the start."""
    arrival = time.perf_counter()
    results = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        cache = model.new_cache(1, len(prompt) + n)
        logits = model(torch.tensor([prompt]), cache)
        out: list[int] = []
        first = 0.0
        while True:
            out.append(int(logits[0, -1].argmax()))
            first = first or time.perf_counter()
            if len(out) == n:
                break
            logits = model(torch.tensor([[out[-1]]]), cache)
        results.append(Result(out, arrival, first, time.perf_counter()))
    return results


@torch.inference_mode()
def static_batching(
    model: Llama,
    prompts: list[list[int]],
    max_tokens: list[int],
    batch_size: int,
    block_size: int = EngineConfig.block_size,
) -> list[Result]:
    """Serve the requests in arrival order, batch_size at a time; a batch returns when its longest is done."""
    arrival = time.perf_counter()
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
    num_blocks = batch_size * -(-longest // block_size)
    cache = PagedKVCache(model.config, num_blocks, block_size, next(model.parameters()).dtype)
    results = []
    for b in range(0, len(prompts), batch_size):
        blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        seqs = [Sequence(str(i), p, SamplingParams()) for i, p in enumerate(prompts[b : b + batch_size])]
        limits = max_tokens[b : b + batch_size]
        for seq in seqs:
            blocks.allocate(seq)
        num_tokens = [s.num_tokens for s in seqs]
        first = []
        for _ in range(max(limits)):
            logits = run_batch(model, cache, seqs, num_tokens)
            for seq, n, row in zip(seqs, num_tokens, logits, strict=True):
                seq.num_computed_tokens += n
                seq.token_ids.append(int(row.argmax()))
                blocks.append_slot(seq)
            first = first or [time.perf_counter()] * len(seqs)
            num_tokens = [1] * len(seqs)
        done = time.perf_counter()
        results += [
            Result(s.output_token_ids[:n], arrival, t, done) for s, n, t in zip(seqs, limits, first, strict=True)
        ]
    return results
