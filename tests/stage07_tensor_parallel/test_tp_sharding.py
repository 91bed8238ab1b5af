"""Sharding without processes: which rank holds which slice, and the errors for shapes that do not divide."""

import pytest
import torch

from labkit.model import Config, Llama, init_weights

SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
def test_shard_gives_each_rank_its_contiguous_slice(impl, seed):
    layers = impl("stage07_tensor_parallel.layers")
    t = torch.randn(8, 12, 4, generator=torch.Generator().manual_seed(seed))
    for dim in (0, 1, -2):
        for p in (1, 2, 4):
            n = t.shape[dim]
            parts = [layers.shard(t, dim, r, p) for r in range(p)]
            for r, part in enumerate(parts):
                want = t.index_select(dim, torch.arange(r * n // p, (r + 1) * n // p))
                assert torch.equal(part, want), (
                    f"seed={seed}: shard(t, dim={dim}, rank={r}, world_size={p}) is not rows [r·n/p, (r+1)·n/p)"
                )


def test_shard_rejects_an_indivisible_dimension(impl):
    layers = impl("stage07_tensor_parallel.layers")
    with pytest.raises(ValueError, match="world_size"):
        layers.shard(torch.zeros(6, 5), 1, 0, 2)


@pytest.mark.parametrize(
    "heads, kv_heads, p, expected",
    [
        (8, 2, 1, (8, 2)),
        (8, 2, 2, (4, 1)),
        (8, 8, 4, (2, 2)),
        (64, 8, 8, (8, 1)),
        (8, 2, 4, (2, 1)),
        (64, 8, 16, (4, 1)),
        (4, 1, 4, (1, 1)),
    ],  # fmt: skip
)
def test_local_head_counts_split_or_replicate_kv_heads(impl, heads, kv_heads, p, expected):
    tp = impl("stage07_tensor_parallel.tp_model")
    c = Config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    got = tp.local_head_counts(c, p)
    assert tuple(got) == expected, f"{heads} heads / {kv_heads} KV heads at TP={p}: got {got}, expected {expected}"


@pytest.mark.parametrize(
    "heads, kv_heads, p, field", [(5, 5, 2, "num_attention_heads"), (12, 6, 4, "num_key_value_heads")]
)
def test_local_head_counts_rejects_heads_that_do_not_divide(impl, heads, kv_heads, p, field):
    tp = impl("stage07_tensor_parallel.tp_model")
    with pytest.raises(ValueError, match=field):
        tp.local_head_counts(Config(num_attention_heads=heads, num_key_value_heads=kv_heads), p)


def _heads_of(rank, p, heads):
    return list(range(rank * heads // p, (rank + 1) * heads // p))


def _rows(head_ids, head_dim):
    return torch.tensor([h * head_dim + i for h in head_ids for i in range(head_dim)])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [2, 4])
def test_shard_state_dict_follows_the_megatron_layout(impl, seed, p):
    tp = impl("stage07_tensor_parallel.tp_model")
    c = Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=8, tie_word_embeddings=seed % 2 == 0)  # fmt: skip
    full = init_weights(Llama(c), seed=seed).state_dict()
    group = c.num_attention_heads // c.num_key_value_heads
    for r in range(p):
        q_heads = _heads_of(r, p, c.num_attention_heads)
        kv_heads = sorted({h // group for h in q_heads})  # the KV heads this rank's queries read
        got = tp.shard_state_dict(full, r, p, c)
        assert set(got) == set(full), f"seed={seed}: keys differ: {set(got) ^ set(full)}"
        for name, w in full.items():
            if name.endswith("q_proj.weight"):
                want = w[_rows(q_heads, c.head_dim)]
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                want = w[_rows(kv_heads, c.head_dim)]
            elif name.endswith("o_proj.weight"):
                want = w[:, _rows(q_heads, c.head_dim)]
            elif name.endswith(("gate_proj.weight", "up_proj.weight")) or name.endswith("embed_tokens.weight"):
                want = w[r * w.shape[0] // p : (r + 1) * w.shape[0] // p]
            elif name == "lm_head.weight":
                want = w[r * c.vocab_size // p : (r + 1) * c.vocab_size // p]
            elif name.endswith("down_proj.weight"):
                want = w[:, r * c.intermediate_size // p : (r + 1) * c.intermediate_size // p]
            else:
                want = w  # norms are replicated
            assert torch.equal(got[name], want), f"seed={seed}, TP={p}, rank {r}: {name} is not this rank's slice"


@pytest.mark.parametrize("field, value", [("vocab_size", 97), ("intermediate_size", 90)])
def test_shard_state_dict_rejects_sizes_that_do_not_divide(impl, field, value):
    tp = impl("stage07_tensor_parallel.tp_model")
    c = Config(**{"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, field: value})  # fmt: skip
    full = init_weights(Llama(c)).state_dict()
    with pytest.raises(ValueError, match=field):
        tp.shard_state_dict(full, 0, 4, c)
