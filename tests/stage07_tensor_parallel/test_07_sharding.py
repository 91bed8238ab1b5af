"""Sharding without processes: which rank holds which slice, and the errors for shapes that do not divide."""

import pytest
import torch

from labkit.model import Config, Llama, init_weights
from labkit.testing import FP32_MARGIN, assert_greedy_within, greedy_logits

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


# Without a process group the collectives are no-ops, so each layer returns its rank's partial result.
# Building every rank in one process and combining the partials by hand (concatenate for an
# all-gather, sum for an all-reduce) checks each rank's share of the math; the distributed tests check
# the collectives themselves.


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [2, 4])
def test_parallel_layers_partials_combine_to_the_full_layer(impl, seed, p):
    layers = impl("stage07_tensor_parallel.layers")
    g = torch.Generator().manual_seed(seed)
    W, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x = torch.randn(3, 5, 16, generator=g)
    cols, rows = [], []
    for r in range(p):
        col = layers.ColumnParallelLinear(16, 24, bias=True, rank=r, world_size=p)
        col.load_state_dict({"weight": W.chunk(p, 0)[r], "bias": b.chunk(p, 0)[r]})
        cols.append(col(x))
        row = layers.RowParallelLinear(16, 24, bias=True, input_is_parallel=False, rank=r, world_size=p)
        row.load_state_dict({"weight": W.chunk(p, 1)[r], "bias": b})
        rows.append(row(x) - b)  # each rank adds the bias once after the (here absent) all-reduce
    full = x @ W.T + b
    torch.testing.assert_close(torch.cat(cols, -1), full, msg=f"seed={seed} p={p}: column partials, concatenated")
    torch.testing.assert_close(sum(rows) + b, full, msg=f"seed={seed} p={p}: row partials, summed, plus the bias once")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [2, 4])
def test_vocab_parallel_embedding_partials_sum_to_the_lookup(impl, seed, p):
    layers = impl("stage07_tensor_parallel.layers")
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(32, 8, generator=g)
    ids = torch.randint(0, 32, (2, 9), generator=g)
    ids[0, :4] = torch.tensor([0, 32 // p - 1, 32 // p, 31])  # the edges of the ranks' ranges
    parts = []
    for r in range(p):
        emb = layers.VocabParallelEmbedding(32, 8, rank=r, world_size=p)
        emb.load_state_dict({"weight": table.chunk(p, 0)[r]})
        parts.append(emb(ids))
        owned = (ids >= r * 32 // p) & (ids < (r + 1) * 32 // p)
        assert (parts[-1][~owned] == 0).all(), f"seed={seed} p={p} rank {r}: ids it does not own must give zeros"
    torch.testing.assert_close(sum(parts), table[ids], msg=f"seed={seed} p={p}: the partial lookups sum to the table's")


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_tp_llama_at_world_size_one_is_the_model(impl, name):
    tp = impl("stage07_tensor_parallel.tp_model")
    kv = {"mha": 4, "gqa": 2, "mqa": 1}[name]
    c = Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=kv, head_dim=16, rope_theta=500_000.0)  # fmt: skip
    full = init_weights(Llama(c), seed=3, std=0.08).eval()
    model = tp.TPLlama(c, rank=0, world_size=1).eval()
    model.load_state_dict(tp.shard_state_dict(full.state_dict(), 0, 1, c))
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), full(ids), atol=1e-5, rtol=1e-5, msg=f"{name}: logits differ")
    prompt = ids[0, :5].tolist()
    want = full.generate(prompt, 8)  # within 1e-5 of full's logits: equal up to a near-tie
    assert_greedy_within(
        model.generate(prompt, 8), want, greedy_logits(full, prompt, want), FP32_MARGIN, f"{name}: cached"
    )


def test_shard_is_a_view_not_a_copy(impl):
    t = torch.arange(24.0).view(4, 6)
    got = impl("stage07_tensor_parallel.layers").shard(t, 1, 1, 3)
    assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), "shard returns a view of t (narrow)"


def test_shard_state_dict_adds_the_tied_lm_head_a_checkpoint_leaves_out(impl):
    tp = impl("stage07_tensor_parallel.tp_model")
    c = Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)  # fmt: skip
    full = init_weights(Llama(c), seed=1).state_dict()
    del full["lm_head.weight"]  # save_pretrained drops a tied lm_head
    got = tp.shard_state_dict(full, 1, 2, c)
    assert torch.equal(got["lm_head.weight"], full["model.embed_tokens.weight"][48:]), "rank 1's lm_head rows"
