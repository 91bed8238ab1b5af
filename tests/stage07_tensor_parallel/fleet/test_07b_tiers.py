"""§3 of lab5.ipynb: the tiered KV cache. Its RAM tier evicts least recently used pages to disk in the
order a plain list model predicts, and hands back exactly the bytes it was given; a corrupted disk
entry is a miss (deleted, counted); behind a ReplicaEngine whose pool is too small for the working
set, pages come back from the tiers bit-equal to recomputed KV, the greedy output does not change, and
a corrupted tier falls back to recompute with the same output and no leaked slot."""

import random

import pytest
import torch

from labkit.device import pin_threads
from labkit.testing import FP32_MARGIN, LLAMA_CONFIGS, assert_greedy_within, greedy_logits, random_labkit_llama

pytestmark = pytest.mark.in_process("the engine holds the test's model and calls the learner's store in place")

ENGINE = "stage07_tensor_parallel.fleet.replica_engine"
TIERS = "stage07_tensor_parallel.fleet.kv_tiers"
VOCAB = 97
PAGE = (2, 4, 2, 8)  # layers, page size, KV heads, head_dim


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with pin_threads(1):
        yield


def page(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(PAGE, generator=g), torch.randn(PAGE, generator=g)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("disk", [True, False])
def test_lru_spill_order_matches_a_list_model(impl, tmp_path, seed, disk):
    mod = impl(TIERS)
    rng = random.Random(seed)
    k, _ = page(rng)
    page_bytes = 2 * k.nbytes
    store = mod.TieredKVStore(ram_bytes=3 * page_bytes + page_bytes // 2, disk_dir=tmp_path if disk else None)
    ram, on_disk, pages = [], set(), {}  # the model: RAM least recently used first
    for step in range(60):
        h = rng.randrange(-8, 8) * 0x9E3779B97F4A7C15 % 2**64 - 2**63  # 16 names, some negative
        if rng.random() < 0.5:
            pages.setdefault(h, page(rng))
            store.put(h, *pages[h])
            want = None
            if h in ram:
                ram.remove(h)
            ram.append(h)
        else:
            got = store.get(h)
            want = pages.get(h) if (h in ram or h in on_disk) else None
            if h in ram:
                ram.remove(h)
                ram.append(h)
            elif h in on_disk:  # back to RAM as the most recently used
                on_disk.discard(h)
                ram.append(h)
            if want is None:
                assert got is None, f"seed={seed} step {step}: get returned a page that is in no tier"
            else:
                assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (
                    f"seed={seed} step {step}: get({h}) did not return the bytes put under that hash"
                )
        while len(ram) > 3:
            gone = ram.pop(0)
            if disk:
                on_disk.add(gone)
        assert list(store.ram) == ram, (
            f"seed={seed} step {step}: RAM tier (LRU first) {list(store.ram)}, expected {ram}"
        )
        assert {h for h in pages if store.on_disk(h)} == on_disk, f"seed={seed} step {step}: disk tier differs"
    assert store.stats["spilled" if disk else "dropped"] > 0, f"seed={seed}: nothing left RAM (the case tests nothing)"


def test_a_corrupted_disk_entry_is_a_deleted_miss(impl, tmp_path):
    mod = impl(TIERS)
    rng = random.Random(3)
    store = mod.TieredKVStore(ram_bytes=0, disk_dir=tmp_path)  # every put goes straight to disk
    pages = {h: page(rng) for h in (11, 12, 13)}
    for h, (k, v) in pages.items():
        store.put(h, k, v)
    assert all(store.on_disk(h) for h in pages), "with ram_bytes=0 every page should be on disk"
    flipped = bytearray(store.path(11).read_bytes())
    flipped[len(flipped) // 2] ^= 0x10
    store.path(11).write_bytes(bytes(flipped))
    store.path(12).write_bytes(store.path(12).read_bytes()[:50])  # truncated
    for h in (11, 12):
        assert store.get(h) is None, f"page {h}: a corrupted entry was returned"
        assert not store.on_disk(h), f"page {h}: the corrupted file was not deleted"
    assert store.stats["corrupt"] == 2, f"corrupt count {store.stats['corrupt']}, expected 2"
    got = store.get(13)
    assert got is not None and torch.equal(got[0], pages[13][0]) and torch.equal(got[1], pages[13][1])


def chat(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


def serve(engine, mod, prompts, new_tokens):
    out = {}
    for i, p in enumerate(prompts):  # one after another: each evicts what came before
        engine.add_request(mod.EngineRequest(f"r{i}", p, new_tokens))
        tokens = []
        while engine.has_work():
            tokens += [o.token_id for o in engine.step() if o.token_id is not None]
        out[i] = tokens
    return out


@pytest.mark.parametrize(("mode", "corrupt"), [("radix", False), ("hash", False), ("radix", True)])
def test_pages_come_back_from_the_tiers_bit_equal_to_recomputed_kv(impl, tmp_path, mode, corrupt):
    eng, mod = impl(ENGINE), impl(TIERS)
    model = random_labkit_llama(5, **LLAMA_CONFIGS["gqa2-tied"])
    P, num_slots = 4, 72  # the pool holds one prompt and a half: the working set of three does not fit
    prompts = chat(5, 3, 41)
    tiers = mod.TieredKVStore(ram_bytes=0 if corrupt else 10**6, disk_dir=tmp_path)
    engine = eng.ReplicaEngine(model, num_slots=num_slots, page_size=P, prefix_cache=mode, kv_tiers=tiers)
    first = serve(engine, eng, prompts, 3)
    if corrupt:
        files = sorted(tmp_path.iterdir())
        assert files, "nothing was spilled to disk (the case tests nothing)"
        for f in files:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x01  # one bit, inside the K/V bytes or the file's own structure
            f.write_bytes(bytes(data))
    before = dict(engine.stats)
    again = serve(engine, eng, prompts[:1], 3)[0]  # the first prompt was evicted long ago
    loaded = engine.stats["tier_loaded_tokens"] - before["tier_loaded_tokens"]
    computed = engine.stats["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    want = (len(prompts[0]) - 1) // P * P
    # pages batch otherwise than the contiguous cache: equal to plain greedy up to a near-tie of its logits
    plain = [model.generate(p, 3, stop_at_eos=False) for p in prompts]
    for i, (p, ref) in enumerate(zip(prompts, plain, strict=True)):
        assert_greedy_within(first[i], ref, greedy_logits(model, p, ref), FP32_MARGIN, f"{mode}: r{i}, plain greedy")
    what = f"{mode} corrupt={corrupt}: the repeated prompt, plain greedy"
    assert_greedy_within(again, plain[0], greedy_logits(model, prompts[0], plain[0]), FP32_MARGIN, what)
    if corrupt:
        assert loaded == 0 and computed == len(prompts[0]), (
            f"corrupt tier: loaded {loaded}, computed {computed}; every page should have been recomputed"
        )
        assert tiers.stats["corrupt"] > 0, "the corrupted files were never detected"
    else:
        assert loaded == want and computed == len(prompts[0]) - want, (
            f"{mode}: {loaded} tokens came back from the tiers and {computed} were computed; expected {want} "
            f"and {len(prompts[0]) - want}"
        )
        cold = eng.ReplicaEngine(model, num_slots=num_slots, page_size=P, prefix_cache="none")
        cold.add_request(eng.EngineRequest("cold", prompts[0], 2))
        cold.step()  # the whole prompt in one chunk; the request still runs, so its table stays
        slots, handle = engine.cache.acquire(prompts[0][:want])
        engine.cache.release(handle)
        ref = cold.store.block_tables[0][:want]
        for layer in range(model.config.num_hidden_layers):
            assert torch.equal(engine.store.k[layer][slots], cold.store.k[layer][ref]), (
                f"{mode}: layer {layer} K differs"
            )
            assert torch.equal(engine.store.v[layer][slots], cold.store.v[layer][ref]), (
                f"{mode}: layer {layer} V differs"
            )
    s = engine.stats
    assert s["slots_in_use"] == 0 and s["slots_cached"] + len(engine.store.free_blocks) == num_slots, (
        f"{mode} corrupt={corrupt}: slots leaked ({s})"
    )
