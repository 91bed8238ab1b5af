"""labkit.paged, the given paged KV store of stage 06 part 2: its ragged forward equals the model's own
forward for every family it accepts, and its block accounting never leaks."""

import pytest
import torch

from labkit import paged
from labkit.checkpoint import CheckpointError
from labkit.model import Config, Llama, init_weights
from labkit.testing import FAMILY_CONFIGS, LLAMA_CONFIGS, labkit_from_hf, random_family, random_llama, random_tokens

FAMILIES = ["llama3.1-4x-layout", "llama-attention-mlp-bias", "qwen2-tied", "qwen3-bias-untied"]


def ragged_equals_full(model: Llama, seed: int, block_size: int) -> None:
    """Three sequences fed in ragged chunks (prefill, decode, several tokens) against one full forward each."""
    vocab = model.config.vocab_size
    seqs = [random_tokens(seed * 3 + i, n, vocab).tolist() for i, n in enumerate((13, 6, 9))]
    cuts = [(0, 7, 8, 13), (0, 1, 2, 6), (0, 9)]
    store = paged.PagedKVStore(model, 40, block_size)
    got = [[] for _ in seqs]
    for step in range(3):
        live = [i for i, c in enumerate(cuts) if step + 1 < len(c)]
        chunks = [seqs[i][cuts[i][step] : cuts[i][step + 1]] for i in live]
        for i, logits in zip(live, paged.forward(model, store, [10 + i for i in live], chunks), strict=True):
            got[i].append(logits)
    for i, seq in enumerate(seqs):
        with torch.no_grad():
            full = model(torch.tensor([seq]))[0].float()
        torch.testing.assert_close(torch.cat(got[i]), full, atol=1e-5, rtol=0, msg=f"seed={seed} sequence {i}")
        assert store.length(10 + i) == len(seq)
    assert store.num_used == sum(store.blocks_needed(len(s)) for s in seqs)


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_paged_forward_equals_the_models_forward(name):
    ragged_equals_full(labkit_from_hf(random_llama(seed=4, **LLAMA_CONFIGS[name])), 4, block_size=4)


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_forward_equals_the_models_forward_for_families(name):
    assert name in FAMILY_CONFIGS
    hf, _ = random_family(name, seed=5)
    ragged_equals_full(labkit_from_hf(hf), 5, block_size=3)


@pytest.mark.parametrize("seed", [6, 7])
def test_a_prefill_chunk_beside_decodes_equals_the_models_forward(seed):
    """The shape a serving engine runs: one sequence's long prefill chunk packed with decodes of several
    context lengths and a short chunk, in a shuffled order. Each row equals the model's own forward."""
    model = labkit_from_hf(random_llama(seed=seed, **LLAMA_CONFIGS[sorted(LLAMA_CONFIGS)[0]]))
    vocab, g = model.config.vocab_size, torch.Generator().manual_seed(seed)
    cached = [int(n) for n in torch.randint(1, 30, (5,), generator=g)] + [0]  # the last one starts its prefill
    new = [1, 1, 1, 5, 1, 24]
    seqs = [
        random_tokens(seed * 10 + i, c + n, vocab).tolist() for i, (c, n) in enumerate(zip(cached, new, strict=True))
    ]
    store = paged.PagedKVStore(model, 64, 4)
    warm = [i for i, c in enumerate(cached) if c]
    paged.forward(model, store, warm, [seqs[i][: cached[i]] for i in warm])
    order = torch.randperm(len(seqs), generator=g).tolist()
    logits = paged.forward(model, store, order, [seqs[i][cached[i] :] for i in order])
    for i, got in zip(order, logits, strict=True):
        with torch.no_grad():
            full = model(torch.tensor([seqs[i]]))[0, cached[i] :].float()
        torch.testing.assert_close(got, full, atol=1e-5, rtol=0, msg=f"seed={seed} sequence {i} cached {cached[i]}")


def test_truncate_returns_blocks_and_out_of_blocks_allocates_nothing():
    model = init_weights(Llama(Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)))  # fmt: skip
    store = paged.PagedKVStore(model, 5, 4)
    paged.forward(model, store, [0, 1], [list(range(10)), list(range(5))])  # 3 + 2 blocks
    assert store.num_used == 5 and store.free_blocks == []
    with pytest.raises(paged.OutOfBlocks):
        paged.forward(model, store, [0, 1], [[1, 2, 3], [4]])  # sequence 0 would need a 4th block
    assert (store.length(0), store.length(1), store.num_used) == (10, 5, 5), "a refused pass must change nothing"
    store.truncate(0, 3)
    assert store.num_used == 3 and len(store.block_tables[0]) == 1
    store.free(1)
    assert store.num_used == 1 and 1 not in store.block_tables
    with pytest.raises(ValueError, match="cannot truncate"):
        store.truncate(0, 4)


def test_sliding_window_is_refused():
    model = Llama(Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8))  # fmt: skip
    with pytest.raises(CheckpointError, match="sliding_window"):
        paged.PagedKVStore(model, 4, 4)
