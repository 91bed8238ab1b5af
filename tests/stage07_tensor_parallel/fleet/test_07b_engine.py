"""§2 of lab2.ipynb: the replica engine with your radix cache. Greedy outputs equal the model's own
cached greedy decoding (labkit.model.Llama.generate, no paging, no reuse) with shared prefixes, under a pool small enough to evict and preempt; the prefill
the engine computes drops by exactly the cached prefix; every slot comes back after requests finish
or are aborted; the radix cache hits exactly as much as the hash chain at the same page size; the
KV events, replayed, give the pages the cache holds after every step; bad requests are refused."""

import random

import pytest
import torch

from labkit.device import pin_threads
from labkit.testing import FP32_MARGIN, LLAMA_CONFIGS, assert_greedy_within, greedy_logits, random_labkit_llama

pytestmark = pytest.mark.in_process("the engine holds the test's model and reads the learner's cache in place")

ENGINE = "stage07_tensor_parallel.fleet.replica_engine"
VOCAB = 97  # labkit.testing's tiny vocabulary


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards gain nothing from intra-op threads; on a shared 2-core machine they cost a lot."""
    with pin_threads(1):
        yield


@pytest.fixture(scope="module")
def models():
    """models(config, seed) -> a random labkit Llama of LLAMA_CONFIGS[config], built once per module."""
    built = {}

    def get(config: str, seed: int):
        if (config, seed) not in built:
            built[(config, seed)] = random_labkit_llama(seed, **LLAMA_CONFIGS[config])
        return built[(config, seed)]

    return get


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The reference: the model's own KV-cached greedy decoding, n tokens (EOS does not stop it)."""
    return model.generate(prompt, n, stop_at_eos=False)


def like_greedy(got: list[int], model, prompt: list[int], n: int, what: str) -> None:
    """got is greedy(model, prompt, n) up to a near-tie of the model's logits: a batch over pages sums in other
    shapes than the contiguous cache (labkit.testing.assert_greedy_within)."""
    want = greedy(model, prompt, n)
    assert_greedy_within(got, want, lambda: greedy_logits(model, prompt, want), FP32_MARGIN, what)


def shared_prefix_prompts(seed: int, n: int, system: int, turns: bool = False):
    """n prompts behind one `system`-token system prompt; with turns, each later prompt of a session
    extends an earlier one (multi-turn chat). Prompts diverge right after what they share."""
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB) for _ in range(system)]
    prompts = []
    for i in range(n):
        base = prompts[rng.randrange(i)] if turns and i and rng.random() < 0.5 else head
        first = (31 * i + 7) % VOCAB  # distinct per prompt: no two share more than their base
        prompts.append(base + [first] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 11))])
    return prompts


def drive(engine, mod, requests, join_at=None, on_step=None):
    """Submit requests (more at the steps in join_at), step until idle; request id -> generated tokens."""
    out, join_at, step = {}, join_at or {}, 0
    for r in requests:
        engine.add_request(r)
    while engine.has_work() or join_at:
        for r in join_at.pop(step, []):
            engine.add_request(r)
        for o in engine.step():
            out.setdefault(o.request_id, [])
            if o.token_id is not None:
                out[o.request_id].append(o.token_id)
        step += 1
        if on_step:
            on_step(step)
    return out


@pytest.mark.parametrize(
    ("config", "seed", "page_size", "num_slots"),
    [("gqa2-tied", 0, 1, 4096), ("mqa-odd", 1, 4, 4096), ("gqa4-3layers", 2, 3, 90), ("mha-untied", 3, 1, 70)],
)
def test_greedy_with_the_radix_cache_equals_plain_greedy(impl, models, config, seed, page_size, num_slots):
    """A small num_slots forces eviction and preemption: reused KV must still be the right KV."""
    mod = impl(ENGINE)
    model = models(config, seed)
    prompts = shared_prefix_prompts(seed, 8, 13, turns=True)
    rng = random.Random(seed)
    news = [rng.randrange(3, 10) for _ in prompts]
    reqs = [mod.EngineRequest(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, news, strict=True))]
    removed = []
    engine = mod.ReplicaEngine(
        model, num_slots=num_slots, page_size=page_size, max_num_seqs=3, max_num_batched_tokens=16,
        on_kv_event=lambda e: removed.extend(e.block_hashes if e.kind == "removed" else []),
    )  # fmt: skip
    out = drive(engine, mod, reqs[:4], join_at={3: reqs[4:6], 7: reqs[6:]})
    for r in reqs:
        what = f"seed={seed} {config} page_size={page_size}: {r.request_id} against plain greedy decoding"
        like_greedy(out[r.request_id], model, r.prompt, r.max_tokens, what)
    assert engine.stats["cached_tokens"] > 0, f"seed={seed}: nothing was served from the cache"
    assert engine.stats["slots_in_use"] == 0, f"seed={seed}: {engine.stats['slots_in_use']} slots still held"
    assert removed or num_slots > 1000, f"seed={seed}: the small pool never evicted (the case tests nothing extra)"


@pytest.mark.parametrize(("seed", "page_size"), [(0, 1), (1, 4), (2, 5)])
def test_prefill_drops_by_exactly_the_cached_prefix(impl, models, seed, page_size):
    mod = impl(ENGINE)
    model = models("gqa2-tied", 0)
    system = 21
    prompts = shared_prefix_prompts(seed, 5, system)
    computed = {}
    for mode in ("radix", "none"):
        engine = mod.ReplicaEngine(model, num_slots=4096, page_size=page_size, prefix_cache=mode)
        for i, p in enumerate(prompts):  # one at a time: each request finds the earlier ones cached
            drive(engine, mod, [mod.EngineRequest(f"r{i}", p, 4)])
        computed[mode] = engine.stats
    # the first request computes its whole prompt, each later one all but the cached whole pages of the system prompt
    hit = system // page_size * page_size
    want = sum(map(len, prompts)) - (len(prompts) - 1) * hit
    got = computed["radix"]
    assert got["prefill_tokens_computed"] == want, (
        f"seed={seed} page_size={page_size}: radix computed {got['prefill_tokens_computed']} prefill tokens, expected {want}"
    )
    assert got["cached_tokens"] + got["prefill_tokens_computed"] == got["prompt_tokens"], (
        f"seed={seed}: counts do not add up"
    )
    assert computed["none"]["prefill_tokens_computed"] == sum(map(len, prompts)), f"seed={seed}: no cache, full prefill"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_slot_comes_back_after_requests_finish_or_are_aborted(impl, models, seed):
    mod = impl(ENGINE)
    model = models("gqa2-tied", 0)
    prompts = shared_prefix_prompts(seed, 10, 9, turns=True)
    rng = random.Random(seed)
    num_slots = 120
    engine = mod.ReplicaEngine(model, num_slots=num_slots, page_size=2, max_num_seqs=4, max_num_batched_tokens=8)
    reqs = [mod.EngineRequest(f"r{i}", p, rng.randrange(2, 12)) for i, p in enumerate(prompts)]
    aborts = {rng.randrange(1, 12): r.request_id for r in rng.sample(reqs, 4)}  # waiting, mid-prefill or decoding

    def check(step):
        if step in aborts:
            engine.abort(aborts[step])
        engine.abort("no-such-request")  # unknown ids are ignored
        s = engine.stats
        free = engine.store.free_blocks
        assert len(set(free)) == len(free), f"seed={seed} step {step}: a slot is free twice"
        assert s["slots_in_use"] + s["slots_cached"] + len(free) <= num_slots, (
            f"seed={seed} step {step}: slots overcounted"
        )

    out = drive(engine, mod, reqs, on_step=check)
    s = engine.stats
    assert s["slots_in_use"] == 0, f"seed={seed}: {s['slots_in_use']} slots still held after every request left"
    assert s["slots_cached"] + len(engine.store.free_blocks) == num_slots, f"seed={seed}: slots leaked"
    assert (s["num_running"], s["num_waiting"]) == (0, 0), f"seed={seed}: requests left behind"
    aborted = set(aborts.values())
    for r in reqs:  # the others are unharmed by the aborts around them
        if r.request_id not in aborted:
            like_greedy(out[r.request_id], model, r.prompt, r.max_tokens, f"seed={seed}: {r.request_id}")
    again = mod.EngineRequest("again", prompts[-1], 3)  # the cache left behind still serves correct KV
    like_greedy(drive(engine, mod, [again])["again"], model, again.prompt, 3, f"seed={seed}: stale cached KV?")


@pytest.mark.parametrize("seed", [0, 1])
def test_radix_hits_equal_the_hash_chain_at_page_16(impl, models, seed):
    mod = impl(ENGINE)
    model = models("gqa2-tied", 0)
    prompts = shared_prefix_prompts(seed, 12, 40, turns=True)
    hits = {}
    for mode in ("radix", "hash"):
        engine = mod.ReplicaEngine(model, num_slots=4096, page_size=16, prefix_cache=mode, max_num_seqs=4)
        cached = {}
        for i in range(0, len(prompts), 3):  # waves of 3 concurrent requests
            wave = [mod.EngineRequest(f"r{j}", prompts[j], 5) for j in range(i, min(i + 3, len(prompts)))]
            engine_out = []
            for r in wave:
                engine.add_request(r)
            while engine.has_work():
                engine_out += engine.step()
            cached |= {o.request_id: o.num_cached_tokens for o in engine_out if o.finished}
        hits[mode] = (cached, engine.stats["cached_tokens"], engine.cached_block_hashes())
    assert hits["radix"][0] == hits["hash"][0], f"seed={seed}: per-request hits differ from the hash chain's"
    assert hits["radix"][1] > 0, f"seed={seed}: nothing was served from the cache"
    assert hits["radix"][2] == hits["hash"][2], f"seed={seed}: the two caches hold different pages"


@pytest.mark.parametrize(("seed", "page_size"), [(0, 1), (1, 4)])
def test_kv_events_replay_to_the_pages_the_cache_holds(impl, models, seed, page_size):
    mod = impl(ENGINE)
    model = models("gqa2-tied", 0)
    held, removed = set(), []

    def on_event(e):
        if e.kind == "stored":
            assert not held & set(e.block_hashes), f"seed={seed}: a page is stored twice"
            held.update(e.block_hashes)
        else:
            assert set(e.block_hashes) <= held, f"seed={seed}: a page is removed that was never stored"
            held.difference_update(e.block_hashes)
            removed.extend(e.block_hashes)

    engine = mod.ReplicaEngine(model, num_slots=100, page_size=page_size, max_num_seqs=3, on_kv_event=on_event)
    prompts = shared_prefix_prompts(seed, 12, 11, turns=True)
    reqs = [mod.EngineRequest(f"r{i}", p, 6) for i, p in enumerate(prompts)]

    def check(step):
        assert held == engine.cached_block_hashes(), f"seed={seed} step {step}: replayed events != cached pages"

    drive(engine, mod, reqs, on_step=check)
    assert removed, f"seed={seed}: the pool never ran short (no eviction happened; shrink num_slots)"
    last = prompts[-1]
    want = set(mod.page_hashes(last, page_size)[: (len(last) - 1) // page_size])
    assert want <= held, f"seed={seed}: the last request's whole prompt pages are not announced as cached"


def test_bad_requests_are_refused_while_serving(impl, models):
    mod = impl(ENGINE)
    model = models("gqa2-tied", 0)
    engine = mod.ReplicaEngine(model, num_slots=64, page_size=4)
    good = mod.EngineRequest("good", [5, 6, 7, 8, 9, 10], 6)
    engine.add_request(good)
    first = [o.token_id for o in engine.step()]
    bad = {
        "empty prompt": mod.EngineRequest("a", [], 3),
        "token id": mod.EngineRequest("b", [1, VOCAB], 3),
        "negative token id": mod.EngineRequest("c", [-1, 2], 3),
        "max_tokens": mod.EngineRequest("d", [1, 2], 0),
        "too long for the pool": mod.EngineRequest("e", [1] * 40, 30),
        "duplicate id": mod.EngineRequest("good", [1, 2], 3),
    }
    for what, r in bad.items():
        with pytest.raises(ValueError) as err:
            engine.add_request(r)
        assert str(err.value), f"{what}: the error says nothing"
    with pytest.raises(ValueError, match="prefix_cache"):
        mod.ReplicaEngine(model, prefix_cache="lru")
    out = drive(engine, mod, [])
    like_greedy(first + out["good"], model, good.prompt, 6, "the running request was disturbed by refused ones")


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_follows_each_requests_own_seeded_generator(impl, models, seed):
    """Temperature sampling draws from softmax(logits / T) with a generator seeded per request, so a
    request's tokens do not depend on its neighbours or on what was cached."""
    mod = impl(ENGINE)
    model = models("mqa-odd", 1)
    prompts = shared_prefix_prompts(seed, 4, 10)
    reqs = [
        mod.EngineRequest(f"r{i}", p, 6, temperature=0.5 + 0.4 * i, seed=seed * 10 + i) for i, p in enumerate(prompts)
    ]
    engine = mod.ReplicaEngine(model, num_slots=512, page_size=1, max_num_seqs=2)
    drive(engine, mod, reqs[:1])  # the others find its prefix cached
    out = drive(engine, mod, reqs[1:])
    assert engine.stats["cached_tokens"] > 0, f"seed={seed}: nothing was served from the cache"
    for r in reqs[1:]:
        g, tokens = torch.Generator().manual_seed(r.seed), list(r.prompt)
        for _ in range(r.max_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([tokens]))[0, -1].float()
            tokens.append(int(torch.multinomial(torch.softmax(logits / r.temperature, -1), 1, generator=g)))
        assert out[r.request_id] == tokens[len(r.prompt) :], f"seed={seed}: {r.request_id}'s samples differ"


@pytest.mark.parametrize(("mode", "page_size"), [("radix", 1), ("radix", 4)])  # "hash" too, but it is given code
def test_a_prompt_is_cached_when_its_prefill_ends_not_when_it_finishes(impl, models, mode, page_size):
    """SGLang's cache_unfinished_req: a request admitted while the first still decodes reuses its
    prompt's whole pages, so a shared prefix is computed once even when the two run together."""
    mod = impl(ENGINE)
    model = models("gqa2-tied", 0)
    first, second = shared_prefix_prompts(page_size, 2, 22)
    engine = mod.ReplicaEngine(model, num_slots=512, page_size=page_size, prefix_cache=mode, max_num_batched_tokens=64)
    out = drive(engine, mod, [mod.EngineRequest("a", first, 12)], join_at={2: [mod.EngineRequest("b", second, 5)]})
    hit = 22 // page_size * page_size
    s = engine.stats
    assert s["prefill_tokens_computed"] == len(first) + len(second) - hit, (
        f"{mode} page_size={page_size}: computed {s['prefill_tokens_computed']} prefill tokens; the shared "
        f"{hit} should be computed once (b joined while a was decoding)"
    )
    like_greedy(out["a"], model, first, 12, f"{mode}: a")
    like_greedy(out["b"], model, second, 5, f"{mode}: b")
    assert s["slots_in_use"] == 0, f"{mode} page_size={page_size}: {s['slots_in_use']} slots still held"
    assert s["slots_cached"] + len(engine.store.free_blocks) == 512, f"{mode} page_size={page_size}: slots leaked"
