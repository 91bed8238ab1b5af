"""§2–§4 of lab4.ipynb (stage 04 part 2): batch invariance. linear_tiled against float64 F.linear and against
itself on one row; split_kv_attention against a per-query float64 softmax written here and against itself on one
query; the engine in batch-invariant mode, whose every request's logprobs must be the bits of a batch-of-one
forward of the same tokens, whatever batch, chunk size, prefix-cache hit or preemption served it.

The default engine is not batch invariant (lab4 §1 measures by how much); its test records the figure and checks
only that its logprobs are right to a tolerance."""

import random

import pytest
import torch
import torch.nn.functional as F
from stage04_helpers import log_softmax64, make_model, random_prompts
from torch.overrides import TorchFunctionMode

BI = "stage04_batching.batch_invariant"

# ---- §2 linear_tiled ----------------------------------------------------------------------------------


class MatmulRows(TorchFunctionMode):
    """Records how many rows each matmul-like call multiplies (the first operand's second-to-last dim)."""

    FIRST = (F.linear, torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm)

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []
        self.other: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FIRST:
            self.rows.append(args[0].shape[-2] if args[0].dim() > 1 else 1)
        elif func in (torch.addmm, torch.einsum, torch.tensordot, torch.inner):
            self.other.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_linear_tiled_rows_do_not_depend_on_the_batch(impl, seed):
    mod = impl(BI)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    d_in, d_out, N, tile = rng.randint(3, 90), rng.randint(2, 70), rng.randint(1, 45), rng.choice([4, 5, 8, 16])
    x, w = torch.randn(N, d_in, generator=g), torch.randn(d_out, d_in, generator=g)
    b = torch.randn(d_out, generator=g) if seed % 2 else None
    with MatmulRows() as seen:
        y = mod.linear_tiled(x, w, b, tile)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (N, d_out) and y.dtype == torch.float32, f"shape {tuple(y.shape)} {y.dtype}, seed={seed}"
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5), f"linear_tiled is not x @ W.T + b, seed={seed}"
    assert seen.rows and set(seen.rows) == {tile} and not seen.other, (
        f"every matmul call must multiply exactly tile={tile} rows (got calls of {sorted(set(seen.rows))} rows"
        f"{', and ' + str(seen.other) if seen.other else ''}), seed={seed}"
    )
    others = torch.randn(rng.randint(1, 40), d_in, generator=g)
    for i in rng.sample(range(N), min(N, 6)):
        alone = mod.linear_tiled(x[i : i + 1], w, b, tile)
        mixed = mod.linear_tiled(torch.cat([others, x[i : i + 1], others[:3]]), w, b, tile)[len(others)]
        assert torch.equal(y[i], alone[0]) and torch.equal(y[i], mixed), (
            f"row {i} of {N} differs in its last bits from the same row alone or in another batch, seed={seed}"
        )


# ---- §3 split_kv_attention ----------------------------------------------------------------------------


def random_paged_batch(rng: random.Random, g: torch.Generator, n_kv: int, n_rep: int, D: int, block_size: int):
    """A pool holding B sequences (random blocks) and a packed batch of queries: decodes and prefill chunks."""
    B, num_blocks = rng.randint(1, 6), 240
    k_pool = torch.randn(num_blocks, block_size, n_kv, D, generator=g)
    v_pool = torch.randn(num_blocks, block_size, n_kv, D, generator=g)
    free = rng.sample(range(num_blocks), num_blocks)
    context_lens, query_lens, tables = [], [], []
    for _ in range(B):
        ctx = rng.randint(1, 150)
        context_lens.append(ctx)
        query_lens.append(rng.choice([1, 1, rng.randint(1, ctx)]))
        tables.append([free.pop() for _ in range(-(-ctx // block_size))])
    width = max(map(len, tables))
    q = torch.randn(sum(query_lens), n_kv * n_rep, D, generator=g)
    tables = torch.tensor([t + [rng.randrange(num_blocks)] * (width - len(t)) for t in tables])
    return q, k_pool, v_pool, tables, torch.tensor(context_lens), torch.tensor(query_lens)


def attention64(q, k_pool, v_pool, tables, context_lens, query_lens):
    """The obvious version: every query alone, float64 softmax over keys 0 .. its position."""
    bs, n_kv = k_pool.shape[1], k_pool.shape[2]
    n_rep = q.shape[1] // n_kv
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for b in range(len(query_lens)):
        ctx, n = int(context_lens[b]), int(query_lens[b])
        slots = [int(tables[b, p // bs]) * bs + p % bs for p in range(ctx)]
        k = k_pool.view(-1, n_kv, k_pool.shape[-1])[slots].double().repeat_interleave(n_rep, 1)  # (ctx, H, D)
        v = v_pool.view(-1, n_kv, v_pool.shape[-1])[slots].double().repeat_interleave(n_rep, 1)
        for t in range(n):
            p = ctx - n + t
            s = torch.einsum("hd,khd->hk", q[row].double(), k[: p + 1]) / q.shape[-1] ** 0.5
            out[row] = torch.einsum("hk,khd->hd", s.softmax(-1), v[: p + 1])
            row += 1
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_split_kv_attention_is_the_same_for_a_query_alone(impl, seed):
    mod = impl(BI)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n_kv, n_rep, D, bs, split = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4]), rng.choice([8, 16, 32]), rng.choice([4, 8, 16]), rng.choice([8, 16, 32])  # fmt: skip
    q, k_pool, v_pool, tables, context_lens, query_lens = batch = random_paged_batch(rng, g, n_kv, n_rep, D, bs)
    y = mod.split_kv_attention(*batch, split=split)
    want = attention64(*batch)
    assert y.shape == q.shape, f"shape {tuple(y.shape)}, want {tuple(q.shape)}, seed={seed}"
    err = float((y.double() - want).abs().max())
    assert err < 1e-5, f"split_kv_attention is off by {err:.2e} from softmax attention, seed={seed}"
    starts = (torch.cumsum(query_lens, 0) - query_lens).tolist()
    for b in range(len(query_lens)):
        for t in rng.sample(range(int(query_lens[b])), min(int(query_lens[b]), 4)):
            p = int(context_lens[b] - query_lens[b]) + t  # the query alone, as a decode at position p
            one = mod.split_kv_attention(q[starts[b] + t][None], k_pool, v_pool, tables[b : b + 1], torch.tensor([p + 1]), torch.tensor([1]), split=split)  # fmt: skip
            assert torch.equal(y[starts[b] + t], one[0]), (
                f"sequence {b}'s query at position {p} differs in its last bits from the same query alone "
                f"(batch of {len(query_lens)} sequences, {len(q)} queries, split={split}), seed={seed}"
            )


# ---- §4 the engine ------------------------------------------------------------------------------------

MODELS = {  # random Llamas with what real checkpoints vary: GQA ratio, odd widths, biases, RoPE θ, eps
    "gqa2": dict(),
    "mqa-odd-mlp": dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, intermediate_size=75),
    "mha-bias": dict(
        hidden_size=48, num_attention_heads=3, num_key_value_heads=3, attention_bias=True, mlp_bias=True,
        rope_theta=500_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}  # fmt: skip


def serve_under_load(engine_mod, params_cls, model, rng, target, invariant: bool, counts: dict, tight: bool) -> list:
    """One run: the target prompt among 2-16 others (some sharing its first blocks, for prefix-cache hits),
    arriving between steps, with a random chunk size and a pool small enough to preempt. [(prompt, output)]."""
    block_size = rng.choice([4, 8])
    engine = engine_mod.LLMEngine(
        model,
        batch_invariant=invariant,
        block_size=block_size,
        num_blocks=72 // block_size + (1 if tight else rng.choice([4, 64])),  # the longest request fits, few more
        max_num_batched_tokens=rng.choice([5, 16, 33, 512]),
        max_num_seqs=16 if tight else rng.choice([4, 16]),
    )
    preempt = engine.scheduler.preempt

    def counting_preempt(seq):
        counts["preemptions"] += 1
        preempt(seq)

    engine.scheduler.preempt = counting_preempt
    prompts = [
        target[: rng.randint(1, len(target))] + p
        for p in random_prompts(rng.random(), rng.randint(12 if tight else 2, 16), 1, 25)
    ]
    prompts.insert(rng.randint(0, len(prompts)), target)
    ids, served = {}, []

    def step():
        for out in engine.step():
            if out.finished:
                served.append((ids[out.request_id], out))
                counts["prefix_hits"] += out.num_cached_tokens > 0

    for p in prompts:
        params = params_cls(max_tokens=12 if p is target else rng.randint(1, 12), logprobs=5, ignore_eos=True)
        ids[engine.add_request(p, params)] = p
        for _ in range(rng.choice([0, 0, 1, 3])):
            step()
    while engine.has_unfinished_requests():
        step()
    return served


def batch_of_one(engine_mod, params_cls, model, prompt: list[int], output: list[int], invariant: bool) -> list:
    """The logprobs of `output` from one forward pass over prompt + output, the request alone in its engine."""
    engine = engine_mod.LLMEngine(model, batch_invariant=invariant, enable_prefix_caching=False)
    out = engine.generate([prompt + output], params_cls(max_tokens=1, prompt_logprobs=5))[0]
    return out.prompt_logprobs[len(prompt) :]


def as_bits(logprobs) -> list[tuple]:
    return [(t.token_id, t.logprob, tuple(t.top)) for t in logprobs]


def target_output(served: list, target: list[int]):
    return next(out for prompt, out in served if prompt is target)


def run_workload(impl, name: str, seed: int, invariant: bool, runs: int = 6):
    engine_mod, params_cls = impl("stage04_batching.engine"), impl("stage04_batching.sequence").SamplingParams
    model = make_model(seed, **MODELS[name])
    rng = random.Random(seed)
    target = random_prompts(seed, 1, 20, 30)[0]
    counts = {"preemptions": 0, "prefix_hits": 0}
    results = [
        serve_under_load(engine_mod, params_cls, model, rng, target, invariant, counts, r == 0) for r in range(runs)
    ]
    return engine_mod, params_cls, model, target, counts, results


@pytest.mark.parametrize("name,seed", [("gqa2", 0), ("mqa-odd-mlp", 1), ("mha-bias", 2)])
def test_invariant_engine_logprobs_are_a_batch_of_one(impl, name, seed):
    engine_mod, params_cls, model, target, counts, results = run_workload(impl, name, seed, invariant=True)
    assert counts["preemptions"] and counts["prefix_hits"], f"the load drew no preemption or no prefix hit: {counts}"
    for run, served in enumerate(results):
        for prompt, out in served:
            alone = batch_of_one(engine_mod, params_cls, model, prompt, out.token_ids, invariant=True)
            assert as_bits(out.logprobs) == as_bits(alone), (
                f"run {run}: a request's logprobs under load differ from a batch of one forward of the same "
                f"tokens (prompt of {len(prompt)} tokens, {len(out.token_ids)} generated), {name}, seed={seed}"
            )
    outputs = {tuple(target_output(served, target).token_ids) for served in results}
    assert len(outputs) == 1, f"the same greedy prompt gave {len(outputs)} continuations, {name}, seed={seed}"
    tokens = torch.tensor([target + list(outputs.pop())[:-1]])
    want = log_softmax64(model(tokens)[0, len(target) - 1 :])  # labkit's own forward, the plain way
    first = target_output(results[0], target)
    got = torch.tensor([t.logprob for t in first.logprobs], dtype=torch.float64)
    chosen = want.gather(1, torch.tensor(first.token_ids)[:, None])[:, 0]
    err = float((got - chosen).abs().max().detach())
    assert err < 1e-4, f"invariant logprobs are off by {err:.2e} from labkit's forward, {name}, seed={seed}"


def test_default_engine_figure(impl, record_property):
    """The default engine under the same load: only recorded (its last bits may change with the batch), and
    checked against labkit's forward to a tolerance."""
    engine_mod, params_cls, model, target, counts, results = run_workload(impl, "gqa2", 0, invariant=False)
    vectors = {tuple(t.logprob for t in target_output(served, target).logprobs) for served in results}
    outputs = {tuple(target_output(served, target).token_ids) for served in results}
    worst = 0.0
    for served in results:
        for prompt, out in served:
            alone = batch_of_one(engine_mod, params_cls, model, prompt, out.token_ids, invariant=False)
            worst = max(worst, *(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, alone, strict=True)))
    record_property("default_distinct_logprob_vectors", len(vectors))
    record_property("default_distinct_outputs", len(outputs))
    record_property("default_max_logprob_diff", worst)
    print(
        f"default mode: {len(vectors)} distinct logprob vectors, {len(outputs)} continuations, max |diff| {worst:.2e}"
    )
    assert worst < 1e-3, f"the default engine's logprobs under load are off by {worst:.2e} from a batch of one"
