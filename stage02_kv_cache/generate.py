"""Autoregressive generation three ways: recompute everything, use the cache, batch with padding."""

import torch

from labkit.model import Llama

from .cached_llama import forward  # noqa: F401
from .kv_cache import KVCache  # noqa: F401


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
    raise NotImplementedError("stage02: generate_no_cache — see lab.ipynb §5")


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
    raise NotImplementedError("stage02: generate_kv_cache — see lab.ipynb §5")


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align prompts of different lengths in one batch.

    returns ids (B, max_len) int64, with pad_id filling the left of shorter prompts, and
    pad (B,) int64, the number of padding slots of each row. Left, not right: every row's
    next token then lands in the same column.
    """
    raise NotImplementedError("stage02: left_pad — see lab.ipynb §6")


@torch.no_grad()
def generate_batched(model: Llama, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0) -> list[list[int]]:
    """Greedy generation for several prompts at once with one KVCache of batch len(prompts).

    Left-pad, prefill all rows together, then decode all rows one token per step, passing `pad`
    so every row gets its own positions and never attends to padding. Returns each prompt's
    max_new_tokens new ids, equal to generating it alone.
    """
    raise NotImplementedError("stage02: generate_batched — see lab.ipynb §6")
