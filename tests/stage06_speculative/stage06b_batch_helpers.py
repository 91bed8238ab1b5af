"""Shared by the test_06b_batch_* files: a target with a close draft, and the block-accounting check."""

import copy

import torch

from labkit.testing import LLAMA_CONFIGS, random_labkit_llama


def close_pair(config: str, seed: int, noise: float = 0.01):
    """(target, draft): a random-init target and a copy of it with noise on its last layer, so drafts
    are often accepted and sometimes not (a random draft would almost never agree with a random target).
    labkit models, no transformers twin: the references are the target's own greedy decoding and
    distributions, and importing transformers would cost a section's check two seconds."""
    target = random_labkit_llama(seed, **{"tie_word_embeddings": False, **LLAMA_CONFIGS[config]})
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{target.config.num_hidden_layers - 1}."
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith(last):
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return target, draft


def blocks_match_tokens(store, cached: dict[int, int]) -> str | None:
    """None if `store` holds exactly the sequences in `cached` (id -> cached positions), each at that
    length, in ceil(length / block_size) blocks, and no other block is in use; else what is wrong."""
    for sid, length in cached.items():
        if store.length(sid) != length:
            return f"sequence {sid}: {store.length(sid)} cached positions, expected {length}"
        if len(store.block_tables.get(sid, [])) != store.blocks_needed(length):
            return f"sequence {sid}: {len(store.block_tables[sid])} blocks for {length} positions"
    needed = sum(store.blocks_needed(n) for n in cached.values())
    if store.num_used != needed:
        return f"{store.num_used} blocks in use, the cached tokens need {needed} (a leak from rejected drafts?)"
    return None
