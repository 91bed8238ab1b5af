"""The continuous-batching engine: every request's greedy output equals generating it alone with
labkit's contiguous-cache model, whatever the batching, chunking, preemption or prefix hits."""

import pytest
import torch
from stage04_helpers import TokenCounter, assert_alone, make_model, random_prompts, reference

from labkit.testing import LLAMA_CONFIGS


def _engine(impl, model, **kw):
    return impl("stage04_batching.engine").LLMEngine(model, **kw)


def _params(impl, **kw):
    return impl("stage04_batching.sequence").SamplingParams(**kw)


def _check_same(outs, model, prompts, ref, seed, what):
    for i, (o, p, r) in enumerate(zip(outs, prompts, ref, strict=True)):
        assert_alone(o.token_ids, model, p, r, f"seed={seed}, {what}: request {i} against generated alone")


@pytest.mark.parametrize("config", list(LLAMA_CONFIGS), ids=list(LLAMA_CONFIGS))
def test_batched_greedy_equals_each_request_alone(impl, config):
    seed = list(LLAMA_CONFIGS).index(config)
    model = make_model(seed, **LLAMA_CONFIGS[config])
    prompts = random_prompts(seed, 8, 1, 60)
    max_tokens = [5 + 4 * i for i in range(8)]
    engine = _engine(impl, model, num_blocks=64, max_num_seqs=8)
    outs = engine.generate(prompts, [_params(impl, max_tokens=n) for n in max_tokens])
    _check_same(outs, model, prompts, reference(model, prompts, max_tokens), seed, config)
    assert engine.block_manager.num_used_blocks == 0, f"seed={seed}: finished requests must free their blocks"


@pytest.mark.parametrize("seed", [0, 1])
def test_one_forward_pass_per_step_admits_new_requests_mid_flight(impl, seed):
    model = make_model(seed)
    counter = TokenCounter(model)
    engine = _engine(impl, model, num_blocks=64, max_num_seqs=4)
    first, second = random_prompts(seed, 2, 10, 30)
    engine.add_request(first, _params(impl, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    counter.sizes.clear()
    engine.add_request(second, _params(impl, max_tokens=5, ignore_eos=True))
    engine.step()
    assert counter.sizes == [1 + len(second)], (
        f"seed={seed}: the step after a new arrival should run ONE forward over the running request's decode "
        f"token plus the new prompt ({1 + len(second)} tokens), got forwards of {counter.sizes}"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_prefill_respects_the_token_budget_and_keeps_outputs(impl, seed):
    model = make_model(seed)
    counter = TokenCounter(model)
    prompts = random_prompts(seed, 6, 20, 90)
    max_tokens = [12] * 6
    engine = _engine(impl, model, num_blocks=64, max_num_seqs=6, max_num_batched_tokens=24)
    outs = engine.generate(prompts, [_params(impl, max_tokens=n) for n in max_tokens])
    assert max(counter.sizes) <= 24, f"seed={seed}: a step computed {max(counter.sizes)} tokens, budget is 24"
    _check_same(outs, model, prompts, reference(model, prompts, max_tokens), seed, "chunked prefill")


@pytest.mark.parametrize("seed", [0, 1])
def test_a_chunk_ending_one_token_before_the_prompt_end_samples_nothing(impl, seed):
    model = make_model(seed)
    prompts = random_prompts(seed, 2, 17, 17) + random_prompts(seed + 5, 1, 33, 33)  # budget 16: 16 + 1, 16 + 16 + 1
    engine = _engine(impl, model, num_blocks=32, max_num_seqs=1, max_num_batched_tokens=16)
    outs = engine.generate(prompts, [_params(impl, max_tokens=6)] * 3)
    _check_same(outs, model, prompts, reference(model, prompts, [6] * 3), seed, "a prefill chunk one token short")


@pytest.mark.parametrize("budget,prompt_len", [(16, 50), (7, 30)])
def test_a_long_prompt_is_prefilled_in_budget_sized_chunks(impl, budget, prompt_len):
    bm = impl("stage04_batching.block_manager").BlockManager(32, block_size=16)
    sched = impl("stage04_batching.scheduler").Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget)
    sq = impl("stage04_batching.sequence")
    seq = sq.Sequence("a", list(range(3, 3 + prompt_len)), sq.SamplingParams(max_tokens=4))
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < seq.num_tokens:
        out = sched.schedule()
        chunks.append(out.num_tokens[out.seqs.index(seq)])
        seq.num_computed_tokens += chunks[-1]
    full, rest = divmod(prompt_len, budget)
    assert chunks == [budget] * full + [rest] * bool(rest), (
        f"a {prompt_len}-token prompt under a {budget}-token budget is computed in chunks {chunks}; every "
        "step should take as much of the remaining prompt as the budget allows"
    )


def test_more_running_sequences_than_tokens_in_the_budget_wait_their_turn(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(32, block_size=4)
    sched = impl("stage04_batching.scheduler").Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=4)
    sq = impl("stage04_batching.sequence")
    for i in range(6):
        sched.add(sq.Sequence(str(i), [3 + i], sq.SamplingParams(max_tokens=8)))
    for step in range(40):
        out = sched.schedule()
        assert sum(out.num_tokens) <= 4 and all(n > 0 for n in out.num_tokens), (
            f"step {step}: {out.num_tokens}: once the budget is spent, the other running sequences wait"
        )
        for s, n in zip(out.seqs, out.num_tokens, strict=True):
            s.num_computed_tokens += n
            s.token_ids.append(5)


def finish_step(sched, out, max_tokens: int) -> None:
    """Finish a scheduled step the way the engine would, with a dummy token (5) for each sampled sequence."""
    for s, n in zip(out.seqs, out.num_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(5)
            if len(s.output_token_ids) >= max_tokens:
                sched.finish(s, "length")


@pytest.mark.parametrize("seed", [0, 1])
def test_scheduler_never_exceeds_its_budgets(impl, seed):
    model = make_model(seed)
    engine = _engine(impl, model, num_blocks=40, max_num_seqs=3, max_num_batched_tokens=16)
    for p in random_prompts(seed, 7, 1, 40):
        engine.add_request(p, _params(impl, max_tokens=10, ignore_eos=True))
    sched = engine.scheduler
    steps = 0
    while engine.has_unfinished_requests() and steps < 500:
        out = sched.schedule()
        assert sum(out.num_tokens) <= 16, f"seed={seed}: {sum(out.num_tokens)} tokens in one step, budget 16"
        assert all(n > 0 for n in out.num_tokens), f"seed={seed}: a scheduled sequence must compute a token"
        assert len(sched.running) <= 3, f"seed={seed}: {len(sched.running)} running, max_num_seqs is 3"
        for s, n in zip(out.seqs, out.num_tokens, strict=True):
            assert len(s.block_table) * 16 >= s.num_computed_tokens + n, f"seed={seed}: {s} lacks blocks for {n}"
        finish_step(sched, out, max_tokens=10)
        steps += 1
    assert not engine.has_unfinished_requests(), f"seed={seed}: the scheduler stalled"
    assert engine.block_manager.num_used_blocks == 0, f"seed={seed}: blocks leaked"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preemption_recomputes_from_the_front_and_admits_nobody_that_step(impl, seed):
    bm = impl("stage04_batching.block_manager").BlockManager(8, block_size=4, enable_prefix_caching=False)
    sched = impl("stage04_batching.scheduler").Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    sq = impl("stage04_batching.sequence")
    for i, p in enumerate(random_prompts(seed, 5, 5, 9)):
        sched.add(sq.Sequence(str(i), p, sq.SamplingParams(max_tokens=12)))
    preemptions = 0
    for step in range(400):
        if not sched.has_unfinished():
            break
        was_running = {id(s) for s in sched.running}
        out = sched.schedule()
        assert sum(out.num_tokens) <= 32 and all(n > 0 for n in out.num_tokens), f"seed={seed}: {out.num_tokens}"
        if out.preempted:
            preemptions += 1
            gone = {id(v) for v in out.preempted}
            assert all(id(s) in was_running and id(s) not in gone for s in out.seqs), (
                f"seed={seed} step {step}: a step that preempts admits nobody, not even the victim"
            )
            assert sched.waiting[0] is out.preempted[-1], f"seed={seed} step {step}: a victim goes to the queue's front"
            for v in out.preempted:
                assert v.num_computed_tokens == 0 and v.block_table == [], f"seed={seed}: {v} must recompute from 0"
        finish_step(sched, out, max_tokens=12)
    assert preemptions, f"seed={seed}: 8 blocks of 4 cannot hold 4 sequences of up to 21 tokens: expected preemption"
    assert not sched.has_unfinished() and bm.num_used_blocks == 0, f"seed={seed}: stalled or leaked blocks"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preempted_requests_finish_with_the_same_output(impl, seed):
    model = make_model(seed)
    prompts = random_prompts(seed, 6, 10, 40)
    max_tokens = [40] * 6
    engine = _engine(impl, model, num_blocks=14, max_num_seqs=6, block_size=8)
    preempted = []
    original = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), original(seq))[1]
    outs = engine.generate(prompts, [_params(impl, max_tokens=n, ignore_eos=True) for n in max_tokens])
    assert preempted, f"seed={seed}: 14 blocks of 8 cannot hold 6 requests of up to 80 tokens: expected preemption"
    ref = [model.generate(p, n, stop_at_eos=False) for p, n in zip(prompts, max_tokens, strict=True)]
    _check_same(outs, model, prompts, ref, seed, f"preemption of {preempted}")
    assert engine.block_manager.num_used_blocks == 0, f"seed={seed}: blocks leaked after preemption"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_system_prompt_computes_only_the_suffix(impl, seed):
    model = make_model(seed)
    counter = TokenCounter(model)
    system, suffix_a, suffix_b = random_prompts(seed, 1, 64, 64)[0], *random_prompts(seed + 10, 2, 3, 20)
    engine = _engine(impl, model, num_blocks=64)
    a = engine.generate([system + suffix_a], _params(impl, max_tokens=6))[0]
    counter.tokens = 0
    b = engine.generate([system + suffix_b], _params(impl, max_tokens=6))[0]
    prefill = counter.tokens - (len(b.token_ids) - 1)  # every output token but the last is fed back once
    assert prefill == len(suffix_b), (
        f"seed={seed}: the 64-token system prompt is 4 cached blocks; the second request should prefill only "
        f"its {len(suffix_b)}-token suffix, it computed {prefill}"
    )
    assert b.num_cached_tokens == 64, f"seed={seed}: num_cached_tokens {b.num_cached_tokens}, expected 64"
    both = [system + suffix_a, system + suffix_b]
    _check_same([a, b], model, both, reference(model, both, [6, 6]), seed, "prefix hit")


@pytest.mark.parametrize("seed", [0, 1])
def test_repeated_prompt_full_hit_still_produces_the_first_token(impl, seed):
    model = make_model(seed)
    prompt = random_prompts(seed, 1, 48, 48)[0]
    engine = _engine(impl, model, num_blocks=32)
    first = engine.generate([prompt], _params(impl, max_tokens=8))[0]
    again = engine.generate([prompt], _params(impl, max_tokens=8))[0]
    assert again.num_cached_tokens > 0, f"seed={seed}: the repeated prompt should hit the prefix cache"
    _check_same([first, again], model, [prompt] * 2, reference(model, [prompt] * 2, [8, 8]), seed, "full prefix hit")


@pytest.mark.parametrize("seed", [0, 1])
def test_cached_blocks_are_evicted_under_pressure_and_outputs_stay_right(impl, seed):
    model = make_model(seed)
    prompts = random_prompts(seed, 10, 30, 60)
    engine = _engine(impl, model, num_blocks=12, max_num_seqs=2)
    outs = [engine.generate([p], _params(impl, max_tokens=6))[0] for p in prompts + prompts[:2]]
    bm = engine.block_manager
    assert len(bm.hash_to_block_id) <= bm.num_blocks, f"seed={seed}: more cached hashes than blocks"
    assert all(bm.blocks[b].block_hash == h for h, b in bm.hash_to_block_id.items()), (
        f"seed={seed}: a stale hash survived"
    )
    prompts += prompts[:2]
    _check_same(outs, model, prompts, reference(model, prompts, [6] * 12), seed, "eviction")


@pytest.mark.parametrize("seed", [0, 1])
def test_abort_frees_every_block(impl, seed):
    model = make_model(seed)
    engine = _engine(impl, model, num_blocks=32, max_num_seqs=2)
    ids = [engine.add_request(p, _params(impl, max_tokens=50, ignore_eos=True)) for p in random_prompts(seed, 4, 5, 40)]
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0, f"seed={seed}: running requests should hold blocks"
    for rid in ids:
        engine.abort(rid)
    assert not engine.has_unfinished_requests(), f"seed={seed}: aborted requests must leave both queues"
    assert engine.block_manager.num_used_blocks == 0, f"seed={seed}: abort must free every block"
    assert engine.step() == [], f"seed={seed}: nothing is left to run"


def test_prompt_that_cannot_fit_is_rejected_and_the_engine_goes_on(impl):
    model = make_model(0)
    engine = _engine(impl, model, num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(3, 60)), _params(impl, max_tokens=10))
    out = engine.generate([list(range(3, 50))], _params(impl, max_tokens=10))[0]
    prompt = list(range(3, 50))
    assert_alone(out.token_ids, model, prompt, model.generate(prompt, 10), "47 + 10 tokens fit 4 blocks of 16")


@pytest.mark.parametrize("seed", [0, 1])
def test_static_batching_baseline_matches_each_request_alone(impl, seed):
    model = make_model(seed)
    prompts = random_prompts(seed, 5, 1, 40)
    max_tokens = [3, 9, 5, 12, 7]
    got = impl("stage04_batching.baselines").static_batching(model, prompts, max_tokens, batch_size=3)
    ref = [model.generate(p, n, stop_at_eos=False) for p, n in zip(prompts, max_tokens, strict=True)]
    _check_same(got, model, prompts, ref, seed, "static batching")


def test_pool_has_one_block_tensor_per_layer_in_the_model_dtype(impl):
    model = make_model(3)
    engine = _engine(impl, model, num_blocks=8)
    assert engine.cache.k[0].dtype == torch.float32 and engine.cache.k[0].shape == (8, 16, 2, 16), (
        "pool: (num_blocks, block_size, n_kv_heads, head_dim)"
    )
    out = engine.generate([[5, 6, 7]], _params(impl, max_tokens=4))[0]
    assert_alone(out.token_ids, model, [5, 6, 7], model.generate([5, 6, 7], 4), "a 3-token prompt, like labkit's model")
