"""Edges a real workload reaches: a request arriving (or leaving) while another is mid-prefill, prefix
matching after part of a cached chain was evicted, and sampling knobs combined with temperature.

References: the blocks whose K/V exist are the first num_computed_tokens // block_size (the definition);
labkit's contiguous-cache model for outputs; exact probabilities computed here for sampling. Never the solution.
"""

import random

import pytest
import torch
from stage04_helpers import assert_alone, make_model, random_prompts, reference


def _seq(impl, rid, tokens):
    sq = impl("stage04_batching.sequence")
    return sq.Sequence(str(rid), list(tokens), sq.SamplingParams())


def _params(impl, **kw):
    return impl("stage04_batching.sequence").SamplingParams(**kw)


def _hits_hold_their_own_tokens(bm, hits, tokens, msg):
    bs = bm.block_size
    for i, block_id in enumerate(hits):
        held = bm.blocks[block_id].token_ids
        assert held == tuple(tokens[i * bs : (i + 1) * bs]), (
            f"{msg}: hit {i} is block {block_id} holding {held}, not the tokens of block position {i}"
        )


# --- prefix caching while a prefill is still in flight ------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_prefill_in_flight_shares_only_the_blocks_it_has_computed(impl, seed):
    """Chunked prefill computes a long prompt over several steps. A second request with the same prefix that
    arrives in between may reuse only the blocks whose K/V the first has written; a full block whose tokens are
    known but not yet computed would hand it empty K/V."""
    rng = random.Random(seed)
    bm = impl("stage04_batching.block_manager").BlockManager(64, block_size=4)
    prompt = [rng.randrange(3, 90) for _ in range(rng.randint(30, 41))]
    a = _seq(impl, "a", prompt)
    bm.allocate(a)
    computed, step = 0, 0
    while computed < len(prompt):
        computed = min(len(prompt), computed + rng.randint(1, 9))  # chunks cross block boundaries anywhere
        a.num_computed_tokens = computed
        bm.cache_blocks(a)
        shared = rng.randint(4, len(prompt))
        b = _seq(impl, f"b{step}", prompt[:shared] + [rng.randrange(100, 200) for _ in range(rng.randint(1, 6))])
        want = min(computed // 4, shared // 4, (b.num_tokens - 1) // 4)
        hits = bm.match_prefix(b.token_ids)
        assert hits == a.block_table[:want], (
            f"seed={seed}: the first request has computed {computed} of {len(prompt)} tokens (blocks of 4); a "
            f"second sharing {shared} tokens should hit its first {want} blocks, got {len(hits)}: {hits}"
        )
        bm.allocate(b)
        assert b.num_computed_tokens == 4 * want, f"seed={seed}: prefill must start after the {want} hit blocks"
        bm.free(b)
        step += 1


@pytest.mark.parametrize("seed", [0, 1])
def test_a_prompt_retried_after_an_abort_mid_prefill_gives_the_same_output(impl, seed):
    """A client gives up during a long prefill and sends the same prompt again: the retry may reuse what
    the first attempt computed, and nothing it did not."""
    model = make_model(seed)
    prompt = random_prompts(seed, 1, 70, 70)[0]
    engine = impl("stage04_batching.engine").LLMEngine(
        model, num_blocks=32, block_size=8, max_num_seqs=4, max_num_batched_tokens=20
    )
    rid = engine.add_request(prompt, _params(impl, max_tokens=8))
    engine.step()  # 20 of 70 prompt tokens computed
    engine.abort(rid)
    again = engine.generate([prompt], _params(impl, max_tokens=8))[0]
    assert again.num_cached_tokens <= 16, (
        f"seed={seed}: the aborted attempt computed 20 tokens (2 full blocks of 8); the retry reused "
        f"{again.num_cached_tokens}"
    )
    assert_alone(again.token_ids, model, prompt, reference(model, [prompt], [8])[0], f"seed={seed}: the retry")


@pytest.mark.parametrize("seed", [0, 1])
def test_requests_sharing_a_prefix_arrive_while_it_is_being_prefilled(impl, seed):
    """Requests with one system prompt arrive a step apart under a small token budget, so each is admitted
    while the others are still prefilling: every output equals generating it alone."""
    model = make_model(seed)
    system = random_prompts(seed, 1, 45, 45)[0]
    suffixes = random_prompts(seed + 20, 4, 1, 12)
    prompts = [system + s for s in suffixes]
    engine = impl("stage04_batching.engine").LLMEngine(
        model, num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=24
    )
    outputs = {}
    ids = []
    for p in prompts:
        ids.append(engine.add_request(p, _params(impl, max_tokens=6)))
        for out in engine.step():
            outputs[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    ref = reference(model, prompts, [6] * 4)
    for i, rid in enumerate(ids):
        assert_alone(outputs[rid].token_ids, model, prompts[i], ref[i], f"seed={seed}: request {i} against alone")
    assert engine.block_manager.num_used_blocks == 0, f"seed={seed}: finished requests must free their blocks"


# --- prefix matching after a middle block was evicted -------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_match_stops_at_the_first_evicted_block(impl, seed):
    """Two requests with one prompt, admitted together, each compute their own copy of its blocks (neither
    could hit the other's yet); the first copy to finish a block is the one the cache names. Evicting the first
    request's blocks then removes a middle block of the chain while a later one, the second request's, stays:
    a hit after that gap would put the later block's K/V at the wrong position."""
    rng = random.Random(seed)
    bm = impl("stage04_batching.block_manager").BlockManager(8, block_size=4)
    prompt = [rng.randrange(3, 90) for _ in range(13)]  # 3 full blocks x, y, z and one token
    a, c = _seq(impl, "a", prompt), _seq(impl, "c", prompt)
    bm.allocate(a)
    bm.allocate(c)
    assert bm.num_free_blocks == 0, f"seed={seed}: two 4-block requests fill a pool of 8"
    a.num_computed_tokens = 8  # a is mid-prefill: x and y computed, cached under a's blocks
    bm.cache_blocks(a)
    c.num_computed_tokens = 13  # c overtakes it: z is cached under c's block
    bm.cache_blocks(c)
    a.num_computed_tokens = 13
    bm.cache_blocks(a)
    x_blocks = (a.block_table[0], c.block_table[0])
    bm.free(a)  # a's blocks go to the free queue, uncached tail first
    d = _seq(impl, "d", [rng.randrange(100, 200) for _ in range(9)])
    bm.allocate(d)  # 3 blocks: a's tail, then its z and y copies are evicted, its x stays
    tokens = prompt[:12] + [rng.randrange(100, 200)]
    hits = bm.match_prefix(tokens)
    _hits_hold_their_own_tokens(bm, hits, tokens, f"seed={seed}")
    assert hits and hits[0] in x_blocks, f"seed={seed}: block x is still cached and must hit, got {hits}"


@pytest.mark.parametrize("seed", range(4))
def test_a_match_after_eviction_never_skips_a_block(impl, seed):
    """Random traffic over a few shared prefixes on a pool small enough to evict all the time, requests
    admitted together and computed in random chunks: every prefix hit is a run of the request's own leading
    blocks."""
    rng = random.Random(seed)
    bm = impl("stage04_batching.block_manager").BlockManager(12, block_size=2)
    roots = [[rng.randrange(3, 9) for _ in range(9)] for _ in range(3)]
    live = []
    for step in range(1500):
        if live and (len(live) > 3 or rng.random() < 0.3):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        root = rng.choice(roots)
        tokens = root[: rng.randint(3, 9)] + [rng.randrange(3, 9) for _ in range(rng.randint(0, 2))]
        s = _seq(impl, step, tokens)
        hits = bm.match_prefix(s.token_ids)
        _hits_hold_their_own_tokens(bm, hits, s.token_ids, f"seed={seed} step {step}")
        if not bm.can_allocate(s):
            continue
        bm.allocate(s)
        live.append(s)
        for other in live:  # some prefills advance by a random chunk
            if rng.random() < 0.5:
                other.num_computed_tokens = min(other.num_tokens, other.num_computed_tokens + rng.randint(1, 4))
                bm.cache_blocks(other)


# --- sampling knobs combined --------------------------------------------------------------------------------


def exact_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's order, written out in float64: scale by 1/T, keep the k largest, renormalise, keep the smallest
    set of most likely tokens whose probability reaches top_p, renormalise."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True).tolist()
    keep = order[: top_k or len(order)]
    mass = p[keep] / p[keep].sum()
    nucleus, total = [], 0.0
    for token, q in zip(keep, mass.tolist(), strict=True):
        if total >= top_p:
            break
        nucleus.append(token)
        total += q
    out = torch.zeros_like(p)
    out[nucleus] = p[nucleus] / p[nucleus].sum()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.5, 0, 0.8), (2.0, 0, 0.6), (0.7, 5, 0.8), (1.6, 4, 0.7), (1.0, 3, 0.9)]
)
def test_sampling_combines_temperature_top_k_and_top_p_in_order(impl, seed, temperature, top_k, top_p):
    """Temperature reshapes the distribution before top-p measures its mass, and top-p measures the mass of
    what top-k kept: the nucleus of a flattened or sharpened distribution has a different size."""
    sample = impl("stage04_batching.sampling").sample
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(10, generator=gen) * 1.5
    want = exact_filtered(logits, temperature, top_k, top_p)
    params = _params(impl, temperature=temperature, top_k=top_k, top_p=top_p)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(logits, params, gen) for _ in range(n)]), minlength=10)
    support = set(want.nonzero().flatten().tolist())
    got = set(counts.nonzero().flatten().tolist())
    assert got <= support, (
        f"seed={seed} T={temperature} top_k={top_k} top_p={top_p}: sampled {sorted(got - support)} outside the "
        f"support {sorted(support)}"
    )
    # 4000 draws: each frequency's standard error is at most 0.008, so 0.04 is 5 sigma
    assert (counts / n - want).abs().max() < 0.04, (
        f"seed={seed} T={temperature} top_k={top_k} top_p={top_p}: frequencies {(counts / n).tolist()} "
        f"should be {want.tolist()}"
    )
