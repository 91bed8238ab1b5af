"""Tensor parallelism on real processes: gloo process groups of 1, 2 and 4 ranks on the CPU.

One process group per world size runs every check (starting a process costs seconds here) and
reports per check, so a learner sees which capability fails. References: torch.nn layers for
the parallel layers, Hugging Face LlamaForCausalLM (computed here, in the pytest process) for
the model. Collectives are counted by wrapping torch.distributed itself inside the workers.
"""

import traceback

import pytest
import torch
import torch.distributed as dist

from labkit.distributed import RankFailed, launch
from labkit.model import Config
from labkit.testing import FP32_MARGIN, assert_greedy_within, hf_greedy_logits, random_llama, random_tokens

pytestmark = pytest.mark.dist
WORLD_SIZES = [1, 2, 4]
SEED = 7
# Every config divides over 1, 2 and 4 ranks; 8 heads / 2 KV heads and MQA replicate KV heads at TP=4.
MODEL_CONFIGS = {
    "gqa-tied-3layers": dict(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vocab_size=96,
        tie_word_embeddings=True,
    ),
    "mha-untied": dict(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=72,
        vocab_size=100,
    ),
    "mqa": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, vocab_size=104),
}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "reduce", "send", "recv")  # fmt: skip


# ---------------------------------------------------------------- runs inside each rank


class _Counter:
    """Wraps torch.distributed's collectives: calls and payload bytes per collective name."""

    def __init__(self):
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            tensor = args[1] if name == "all_gather" else args[0]
            self.bytes[name] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    def reset(self):
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self.bytes = dict.fromkeys(COLLECTIVES, 0)

    def made(self):
        return {k: v for k, v in self.calls.items() if v}


def _layer_checks(layers, counter, rank, p):
    """Each parallel layer against its torch.nn counterpart; returns name -> result dict."""
    torch.manual_seed(SEED)  # same full weights and inputs on every rank
    n_in, n_out, vocab = 20, 36, 36
    x = torch.randn(2, 5, n_in)
    out = {}

    def slice_of(n):
        return slice(rank * n // p, (rank + 1) * n // p)

    def run(name, fn):
        counter.reset()
        try:
            out[name] = fn()
            out[name]["collectives"] = counter.made()
        except Exception:
            out[name] = {"error": traceback.format_exc()}

    def column(gather_output):
        full = torch.nn.Linear(n_in, n_out, bias=True)
        layer = layers.ColumnParallelLinear(n_in, n_out, bias=True, gather_output=gather_output)
        layer.weight.data.copy_(full.weight[slice_of(n_out)])
        layer.bias.data.copy_(full.bias[slice_of(n_out)])
        got, want = layer(x), full(x)
        if not gather_output:
            want = want[..., slice_of(n_out)]  # each rank keeps its own slice of the outputs
        return {
            "delta": (got - want).abs().max().item(),
            "shape": tuple(got.shape),
            "expected_shape": tuple(want.shape),
        }

    def row(input_is_parallel):
        full = torch.nn.Linear(n_out, n_in, bias=True)
        h = torch.randn(2, 5, n_out)
        layer = layers.RowParallelLinear(n_out, n_in, bias=True, input_is_parallel=input_is_parallel)
        layer.weight.data.copy_(full.weight[:, slice_of(n_out)])
        layer.bias.data.copy_(full.bias)
        got = layer(h[..., slice_of(n_out)] if input_is_parallel else h)
        return {"delta": (got - full(h)).abs().max().item(), "shape": tuple(got.shape)}

    def embedding():
        full = torch.nn.Embedding(vocab, n_in)
        ids = torch.cat([torch.randint(0, vocab, (2, 7)), torch.tensor([[0, vocab - 1], [vocab // 2, vocab // 4]])], 1)
        layer = layers.VocabParallelEmbedding(vocab, n_in)
        layer.weight.data.copy_(full.weight[slice_of(vocab)])
        got = layer(ids)
        return {"delta": (got - full(ids)).abs().max().item(), "shape": tuple(got.shape)}

    def lm_head():
        table = torch.randn(vocab, n_in)
        head = layers.ColumnParallelLinear(n_in, vocab, gather_output=True)
        head.weight.data.copy_(table[slice_of(vocab)])
        got = head(x)
        return {"delta": (got - x @ table.T).abs().max().item(), "shape": tuple(got.shape)}

    run("column", lambda: column(gather_output=False))
    run("column_gather", lambda: column(gather_output=True))
    run("row", lambda: row(input_is_parallel=True))
    run("row_full_input", lambda: row(input_is_parallel=False))
    run("embedding", embedding)
    run("lm_head", lm_head)
    return out


def _model_checks(tp_model, cost_model, counter, rank, p, cases):
    out = {}
    for name, (config, state, ids, prompt, n_new) in cases.items():
        res = out[name] = {}
        try:
            model = tp_model.TPLlama(config).eval()
            model.load_state_dict(tp_model.shard_state_dict(state, rank, p, config))
            res["params"] = sum(t.numel() for t in model.parameters())
            with torch.no_grad():
                counter.reset()
                res["logits"] = model(ids)
                res["forward_calls"], res["forward_bytes"] = counter.made(), dict(counter.bytes)

                cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
                res["cache_shape"] = tuple(cache.k[0].shape)
                chunks = [model(ids[:, :9], cache)]
                counter.reset()
                chunks.append(model(ids[:, 9:10], cache))  # one decode step
                res["decode_calls"], res["decode_bytes"] = counter.made(), dict(counter.bytes)
                chunks.append(model(ids[:, 10:], cache))
                res["cached_logits"] = torch.cat(chunks, 1)
            res["greedy"] = model.generate(prompt, n_new, stop_at_eos=False)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        try:  # separately, so an unwritten formula does not hide the model's results
            out[name]["bytes_formula"] = cost_model.comm_bytes_per_token(config, p, dtype_bytes=4)
        except Exception:
            out[name]["bytes_formula"] = traceback.format_exc()
    return out


def check_everything(cases):
    """Worker: every check of this file on one rank."""
    from labkit.distributed import report
    from labkit.impl import load

    rank, p = dist.get_rank(), dist.get_world_size()
    counter = _Counter()
    report("parallel layers")
    layers = load("stage07_tensor_parallel.layers")
    results = {"layers": _layer_checks(layers, counter, rank, p)}
    report("model")
    tp, cost = load("stage07_tensor_parallel.tp_model"), load("stage07_tensor_parallel.cost_model")
    results["model"] = _model_checks(tp, cost, counter, rank, p, cases)
    return results


def one_rank_fails(state, config, bad_config):
    """Worker: rank 1 builds a model whose heads do not divide; rank 0 waits in a collective."""
    from labkit.impl import load

    tp = load("stage07_tensor_parallel.tp_model")
    rank = dist.get_rank()
    if rank == 1:
        tp.TPLlama(bad_config)
    model = tp.TPLlama(config)
    model.load_state_dict(tp.shard_state_dict(state, rank, 2, config))
    model(torch.zeros(1, 3, dtype=torch.long))  # blocks in the embedding's all-reduce
    return "rank 0 should not get here: its peer failed"


# ---------------------------------------------------------------- the pytest side


@pytest.fixture(scope="module")
def references():
    cases, expected = {}, {}
    for i, (name, overrides) in enumerate(MODEL_CONFIGS.items()):
        hf = random_llama(seed=SEED + i, **overrides)
        config = Config.from_hf(hf.config.to_dict())
        ids = random_tokens(SEED + i, 13, config.vocab_size, batch=2)
        # No pad id (0) in the prompt: HF would mask it out of attention.
        prompt = (random_tokens(SEED + i + 100, 6, config.vocab_size - 3) + 3).tolist()
        with torch.no_grad():
            logits = hf(ids).logits
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        cases[name] = (config, state, ids, prompt, 8)
        greedy, greedy_logits = hf_greedy_logits(hf, prompt, 8)
        expected[name] = {
            "logits": logits,
            "greedy": greedy,
            "greedy_logits": greedy_logits,
            "config": config,
            "ids": ids,
        }
    return cases, expected


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"tp{p}")
def group(request, references):
    """(world_size, per-rank results, HF references); the run's exception if the group failed."""
    cases, expected = references
    try:
        results = launch(check_everything, request.param, cases, timeout=120)
    except (RankFailed, TimeoutError) as e:
        results = e
    return request.param, results, expected


def _results(group, section, name):
    """Every rank's result for one check; fails with the rank's traceback if it raised."""
    p, results, _ = group
    if isinstance(results, Exception):
        pytest.fail(f"the TP={p} process group failed before reporting (seed={SEED}):\n{results}")
    per_rank = [r[section][name] for r in results]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"TP={p}: {section} check {name!r} raised on rank {rank} (seed={SEED}):\n{res['error']}")
    return per_rank


def _close(per_rank, what, p):
    for rank, res in enumerate(per_rank):
        assert res["delta"] <= 1e-5, (
            f"TP={p} rank {rank}: {what} differs from torch.nn by {res['delta']:.2e} (seed={SEED})"
        )


def _layer_matches_nn(group, check, what, made=None):
    """Every rank's output of layer `check` equals torch.nn's; with `made`, the collectives of more
    than one rank were exactly those (and a single rank made none)."""
    p = group[0]
    per_rank = _results(group, "layers", check)
    _close(per_rank, what, p)
    if made is not None:
        expected = made if p > 1 else {}
        assert per_rank[0]["collectives"] == expected, f"TP={p}: expected {expected}, made {per_rank[0]['collectives']}"


def _logits_equal_hf(group, name, key, what):
    p, _, expected = group
    for rank, res in enumerate(_results(group, "model", name)):
        torch.testing.assert_close(
            res[key], expected[name]["logits"], atol=1e-5, rtol=0,
            msg=lambda m, rank=rank: f"TP={p} rank {rank}, config {name}, seed={SEED}: {what} differ from HF: {m}",
        )  # fmt: skip


def test_column_parallel_linear_keeps_its_slice_without_communication(group):
    p = group[0]
    per_rank = _results(group, "layers", "column")
    _close(per_rank, "ColumnParallelLinear (gather_output=False) output slice", p)
    for rank, res in enumerate(per_rank):
        assert res["shape"] == res["expected_shape"], (
            f"TP={p} rank {rank}: shape {res['shape']} != {res['expected_shape']}"
        )
        assert not res["collectives"], f"TP={p}: a column-parallel layer needs no collective, made {res['collectives']}"


def test_column_parallel_linear_gather_output_equals_nn_linear(group):
    _layer_matches_nn(group, "column_gather", "ColumnParallelLinear(gather_output=True)", made={"all_gather": 1})


def test_row_parallel_linear_one_all_reduce_bias_once(group):
    _layer_matches_nn(group, "row", "RowParallelLinear(input_is_parallel=True) with bias", made={"all_reduce": 1})


def test_row_parallel_linear_splits_a_full_input(group):
    _layer_matches_nn(group, "row_full_input", "RowParallelLinear(input_is_parallel=False)")


def test_vocab_parallel_embedding_equals_nn_embedding(group):
    what = "VocabParallelEmbedding (ids at both ends of every shard)"
    _layer_matches_nn(group, "embedding", what, made={"all_reduce": 1})


def test_vocab_parallel_lm_head_gathers_full_logits(group):
    _layer_matches_nn(group, "lm_head", "vocab-parallel LM head logits")


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_tp_logits_equal_hf_llama(group, name):
    _logits_equal_hf(group, name, "logits", "logits")


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_tp_cached_decode_equals_hf_llama(group, name):
    _logits_equal_hf(group, name, "cached_logits", "prefill+decode logits")


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_tp_greedy_generation_equals_hf(group, name):
    p, _, expected = group
    for rank, res in enumerate(_results(group, "model", name)):
        # all-reduced partial sums round otherwise than HF's full matmuls: equal up to a near-tie of HF's logits
        want, logits = expected[name]["greedy"], expected[name]["greedy_logits"]
        assert_greedy_within(res["greedy"], want, logits, FP32_MARGIN, f"TP={p} rank {rank}, {name}, seed={SEED}: HF")


def _local_kv_heads(c, p):
    """KV heads one rank holds: its share, or one replicated head when they do not divide over the ranks."""
    return c.num_key_value_heads // p if c.num_key_value_heads % p == 0 else 1


def test_tp_kv_cache_holds_only_local_kv_heads(group):
    p, _, expected = group
    for name in MODEL_CONFIGS:
        c = expected[name]["config"]
        shape, local_kv = _results(group, "model", name)[0]["cache_shape"], _local_kv_heads(c, p)
        assert shape[1] == local_kv and shape[3] == c.head_dim, (
            f"TP={p}, {name}: cache k shape {shape}, expected {local_kv} local KV heads of dim {c.head_dim}"
        )


def test_each_rank_holds_one_shard_of_the_weights(group):
    p, _, expected = group
    for name in MODEL_CONFIGS:
        c = expected[name]["config"]
        attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads // p + 2 * _local_kv_heads(c, p))
        mlp = 3 * c.hidden_size * c.intermediate_size // p
        norms = c.hidden_size * (2 * c.num_hidden_layers + 1)
        head = c.vocab_size * c.hidden_size // p * (1 if c.tie_word_embeddings else 2)
        want = c.num_hidden_layers * (attn + mlp) + norms + head
        for rank, res in enumerate(_results(group, "model", name)):
            assert res["params"] == want, (
                f"TP={p} rank {rank}, {name}: holds {res['params']} parameters, expected {want}"
            )


def test_two_all_reduces_per_layer_plus_embedding_and_one_gather(group):
    p, _, expected = group
    for name in MODEL_CONFIGS:
        L = expected[name]["config"].num_hidden_layers
        want = {"all_reduce": 2 * L + 1, "all_gather": 1} if p > 1 else {}
        for rank, res in enumerate(_results(group, "model", name)):
            for phase in ("forward", "decode"):
                got = res[f"{phase}_calls"]
                assert got == want, (
                    f"TP={p} rank {rank}, {name} ({L} layers), {phase}: collectives {got}, expected {want}"
                )


def test_counted_bytes_equal_the_formula(group):
    p, _, expected = group
    for name in MODEL_CONFIGS:
        c, ids = expected[name]["config"], expected[name]["ids"]
        per_token = {
            "all_reduce": (2 * c.num_hidden_layers + 1) * c.hidden_size * 4 if p > 1 else 0,
            "all_gather": c.vocab_size // p * 4 if p > 1 else 0,
        }
        res = _results(group, "model", name)[0]
        assert res["bytes_formula"] == per_token, (
            f"TP={p}, {name}: comm_bytes_per_token gave {res['bytes_formula']}, expected {per_token}"
        )
        for phase, tokens in (("forward", ids.numel()), ("decode", ids.shape[0])):
            counted = {k: res[f"{phase}_bytes"][k] for k in per_token}
            want = {k: v * tokens for k, v in per_token.items()}
            assert counted == want, f"TP={p}, {name}, {phase} of {tokens} tokens: counted {counted} B, formula {want} B"


def test_a_failing_rank_brings_the_group_down_with_its_message(references):
    cases, _ = references
    config, state, *_ = cases["gqa-tied-3layers"]
    bad = Config(
        **{**vars(config), "num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 8, "hidden_size": 40}
    )
    with pytest.raises(RankFailed) as failure:
        launch(one_rank_fails, 2, state, config, bad, timeout=60)
    message = str(failure.value)
    assert "rank 1" in message and "ValueError" in message and "num_attention_heads" in message, (
        f"expected rank 1's ValueError naming num_attention_heads (5 heads over 2 ranks), got:\n{message[-1500:]}"
    )
