"""Autoregressive generation three ways: recompute everything, use the cache, batch with padding."""

import torch

from labkit.model import Llama

from .cached_llama import forward
from .kv_cache import KVCache


def sample(logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens from last-position logits (B, vocab): argmax if temperature == 0, else one
    torch.multinomial draw per row from softmax(logits / temperature) using `generator` (given)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate_no_cache(
    model: Llama,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The baseline: every step runs the full forward pass over prompt + everything generated so far.

    Returns exactly max_new_tokens new token ids (EOS does not stop it). Step t costs a forward
    over len(prompt) + t tokens, so the whole generation is quadratic in its length.
    """
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = forward(model, torch.tensor([ids]))
        ids.append(int(sample(logits[:, -1], temperature, generator)))
    return ids[len(prompt) :]


@torch.no_grad()
def generate_kv_cache(
    model: Llama,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Prefill the prompt once into a KVCache, then feed one token per step.

    Same contract and same tokens as generate_no_cache (same sampler, same generator draws),
    but no step ever runs a layer over the prefix again.
    """
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.config, 1, len(prompt) + max_new_tokens, dtype)
    logits = forward(model, torch.tensor([prompt]), cache)
    out: list[int] = []
    for step in range(max_new_tokens):
        token = sample(logits[:, -1], temperature, generator)
        out.append(int(token))
        if step + 1 < max_new_tokens:
            logits = forward(model, token[:, None], cache)
    return out


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align prompts of different lengths in one batch.

    returns ids (B, max_len) int64, with pad_id filling the left of shorter prompts, and
    pad (B,) int64, the number of padding slots of each row. Left, not right: every row's
    next token then lands in the same column.
    """
    width = max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts])
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    return ids, pad


@torch.no_grad()
def generate_batched(model: Llama, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0) -> list[list[int]]:
    """Greedy generation for several prompts at once with one KVCache of batch len(prompts).

    Left-pad, prefill all rows together, then decode all rows one token per step, passing `pad`
    so every row gets its own positions and never attends to padding. Returns each prompt's
    max_new_tokens new ids, equal to generating it alone.
    """
    ids, pad = left_pad(prompts, pad_id)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.config, len(prompts), ids.shape[1] + max_new_tokens, dtype)
    logits = forward(model, ids, cache, pad)
    out = []
    for step in range(max_new_tokens):
        tokens = logits[:, -1].argmax(dim=-1)  # (B,)
        out.append(tokens)
        if step + 1 < max_new_tokens:
            logits = forward(model, tokens[:, None], cache, pad)
    return torch.stack(out, dim=1).tolist()
