"""Block manager: block tables, reference counts, copy-on-write, prefix caching and LRU eviction."""

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _seq(impl, rid, tokens):
    sq = impl("stage04_batching.sequence")
    return sq.Sequence(str(rid), tokens, sq.SamplingParams())


def _computed(bm, seq):
    """Pretend the model computed every token of seq, as the engine does after a step."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)


def check_invariants(bm, live, msg):
    owned = Counter(b for s in live for b in s.block_table)
    free = set(bm.free_queue)
    for block in bm.blocks:
        assert block.ref_count == owned[block.block_id], (
            f"{msg}: block {block.block_id} has ref_count {block.ref_count} but {owned[block.block_id]} owners"
        )
        assert (block.block_id in free) == (block.ref_count == 0), (
            f"{msg}: block {block.block_id} (ref_count {block.ref_count}) must be free exactly when nobody owns it"
        )
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].block_hash == h, f"{msg}: stale hash {h} maps to block {block_id}, reused since"
    bs = bm.block_size
    for s in live:
        assert len(s.block_table) == -(-s.num_tokens // bs), f"{msg}: {s} must hold ceil(tokens / block_size) blocks"
        for i in range(s.num_computed_tokens // bs):  # every computed full block is registered, with its tokens
            block = bm.blocks[s.block_table[i]]
            assert block.token_ids == tuple(s.token_ids[i * bs : (i + 1) * bs]), (
                f"{msg}: block {block.block_id} at position {i} of {s} holds the tokens {block.token_ids}, "
                "not the sequence's: a reused block kept stale content, or a prefix hit skipped a block"
            )
            assert block.block_hash is not None, f"{msg}: computed full block {block.block_id} of {s} has no hash"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocate_gives_each_sequence_its_own_blocks(impl, seed):
    bm = impl("stage04_batching.block_manager").BlockManager(64, block_size=16, enable_prefix_caching=False)
    rng = random.Random(seed)
    seqs = [_seq(impl, i, [rng.randrange(3, 50) for _ in range(rng.randint(1, 70))]) for i in range(6)]
    for s in seqs:
        assert bm.can_allocate(s), f"seed={seed}: 64 free blocks must fit {s}"
        bm.allocate(s)
        assert len(s.block_table) == -(-s.num_tokens // 16), f"seed={seed}: {s} needs ceil(len/16) blocks"
    all_blocks = [b for s in seqs for b in s.block_table]
    assert len(set(all_blocks)) == len(all_blocks), f"seed={seed}: two sequences share a block without caching"
    assert bm.num_free_blocks == 64 - len(all_blocks), f"seed={seed}: free count is off"
    check_invariants(bm, seqs, f"seed={seed}")


def test_can_allocate_refuses_when_pool_is_short(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(4, block_size=16)
    big = _seq(impl, 0, list(range(3, 3 + 65)))  # 5 blocks
    assert not bm.can_allocate(big), "65 tokens need 5 blocks of 16; a pool of 4 cannot hold them"
    small = _seq(impl, 1, list(range(3, 3 + 64)))
    assert bm.can_allocate(small), "64 tokens need exactly 4 blocks"


@pytest.mark.parametrize("seed", [0, 1])
def test_append_slot_takes_a_block_only_at_a_boundary(impl, seed):
    bm = impl("stage04_batching.block_manager").BlockManager(16, block_size=16)
    rng = random.Random(seed)
    s = _seq(impl, 0, [rng.randrange(3, 50) for _ in range(rng.randint(1, 40))])
    bm.allocate(s)
    for _ in range(50):
        s.token_ids.append(rng.randrange(3, 50))
        before = len(s.block_table)
        assert bm.can_append(s), f"seed={seed}: the pool has room"
        assert bm.append_slot(s) is None, f"seed={seed}: an unshared sequence never needs a copy"
        grew = len(s.block_table) - before
        expected = 1 if (s.num_tokens - 1) % 16 == 0 else 0
        assert grew == expected, f"seed={seed}: at {s.num_tokens} tokens the table grew by {grew}, expected {expected}"
    check_invariants(bm, [s], f"seed={seed}")


def test_fork_shares_blocks_and_copies_the_shared_tail_on_write(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(16, block_size=16)
    parent = _seq(impl, 0, list(range(3, 3 + 40)))  # 3 blocks, the last one partial
    bm.allocate(parent)
    _computed(bm, parent)
    child = _seq(impl, 1, list(parent.token_ids))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table, "a fork shares every block"
    assert child.num_computed_tokens == parent.num_computed_tokens == 40, "the child's K/V are the parent's: computed"
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table), "shared blocks have ref_count 2"
    check_invariants(bm, [parent, child], "after fork")
    child.token_ids.append(7)
    copy = bm.append_slot(child)
    assert copy is not None and copy[0] == parent.block_table[-1], "writing into the shared tail must copy it"
    assert child.block_table[-1] == copy[1] != parent.block_table[-1], "the child writes into its own copy"
    assert child.block_table[:-1] == parent.block_table[:-1], "full blocks stay shared"
    parent.token_ids.append(9)
    assert bm.append_slot(parent) is None, "the parent owns its tail alone again: no copy"
    check_invariants(bm, [parent, child], "after copy-on-write")
    bm.free(parent)
    bm.free(child)
    check_invariants(bm, [], "after freeing both")
    assert bm.num_free_blocks == 16, "every block returns to the pool"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_hits_reuse_full_blocks_only(impl, seed):
    bm = impl("stage04_batching.block_manager").BlockManager(32, block_size=16)
    rng = random.Random(seed)
    system = [rng.randrange(3, 50) for _ in range(48)]
    a = _seq(impl, 0, system + [rng.randrange(3, 50) for _ in range(10)])
    bm.allocate(a)
    _computed(bm, a)
    b = _seq(impl, 1, system + [rng.randrange(3, 50) for _ in range(20)])
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3], f"seed={seed}: the 3 system-prompt blocks are shared"
    assert b.num_computed_tokens == 48, f"seed={seed}: 48 cached tokens, got {b.num_computed_tokens}"
    assert b.block_table[3] != a.block_table[3], f"seed={seed}: the partial block is never shared"
    check_invariants(bm, [a, b], f"seed={seed}")


def test_prefix_hash_is_chained_not_per_block(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(32, block_size=16)
    x, y = list(range(3, 19)), list(range(20, 36))
    a = _seq(impl, 0, x + y + [5])
    bm.allocate(a)
    _computed(bm, a)
    b = _seq(impl, 1, y + x + [5])  # the same blocks in another order: different prefixes
    assert bm.match_prefix(b.token_ids) == [], "block y at position 0 is not block y after x"
    c = _seq(impl, 2, x + y + [6])
    assert bm.match_prefix(c.token_ids) == a.block_table[:2], "the same two leading blocks must hit"


def test_uncached_free_blocks_are_reused_before_cached_ones_whenever_freed(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(3, block_size=2)
    a, b = _seq(impl, 0, [3, 4, 5, 6]), _seq(impl, 1, [9])  # a: two full blocks, cached; b: one partial block
    for s in (a, b):
        bm.allocate(s)
        _computed(bm, s)
    bm.free(a)
    bm.free(b)  # b's uncached block is freed last, yet it is the one to reuse first
    d = _seq(impl, 2, [7])
    bm.allocate(d)
    assert d.block_table == [2], f"b's uncached block 2 should be reused first, got {d.block_table}"
    assert bm.match_prefix([3, 4, 5, 6, 8]) == [0, 1], "both of a's cached blocks must survive"


def test_an_evicted_block_is_registered_afresh_for_its_new_content(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(3, block_size=2)
    a = _seq(impl, 0, [3, 4, 5, 6, 7])
    bm.allocate(a)
    _computed(bm, a)
    bm.free(a)
    b = _seq(impl, 1, [8, 9, 10, 11, 12])  # takes all three blocks: a's two cached ones are evicted
    bm.allocate(b)
    _computed(bm, b)
    check_invariants(bm, [b], "after reusing evicted blocks")
    assert bm.match_prefix([3, 4, 5, 6, 7]) == [], "a's prefix was evicted"
    assert bm.match_prefix([8, 9, 10, 11, 1]) == b.block_table[:2], "b's full blocks are cached under b's tokens"


def test_can_append_counts_the_block_a_copy_on_write_needs(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(2, block_size=4)
    parent = _seq(impl, 0, [3, 4, 5, 6, 7])  # 2 blocks: the whole pool
    bm.allocate(parent)
    child = _seq(impl, 1, list(parent.token_ids))
    bm.fork(parent, child)
    child.token_ids.append(8)  # still 2 blocks, but the last one is shared: writing it needs a copy
    assert not bm.can_append(child), "copy-on-write of the shared last block needs a free block; none is left"
    bm.free(parent)
    assert bm.can_append(child), "once the parent is gone the child owns its last block alone"
    assert bm.append_slot(child) is None, "an unshared last block is written in place"


def test_a_hash_collision_never_serves_another_prefix(impl, monkeypatch):
    """Hashes can collide; the block's own tokens are what make a hit safe."""
    mod = impl("stage04_batching.block_manager")
    monkeypatch.setattr(mod, "hash_block", lambda parent, token_ids: 7)  # every block collides
    bm = mod.BlockManager(8, block_size=4)
    a = _seq(impl, 0, [3, 4, 5, 6, 7])
    bm.allocate(a)
    _computed(bm, a)
    b = _seq(impl, 1, [9, 9, 9, 9, 8])
    assert bm.match_prefix(b.token_ids) == [], "a block whose tokens differ is not a hit, whatever its hash"
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and b.block_table[0] != a.block_table[0], "b must not read a's K/V"
    assert bm.match_prefix([3, 4, 5, 6, 1]) == a.block_table[:1], "equal tokens under the same hash do hit"


def test_full_prefix_hit_leaves_the_last_token_to_compute(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(32, block_size=16)
    prompt = list(range(3, 3 + 32))
    a = _seq(impl, 0, prompt)
    bm.allocate(a)
    _computed(bm, a)
    b = _seq(impl, 1, prompt)
    bm.allocate(b)
    assert b.num_computed_tokens < b.num_tokens, "a full hit must still compute the last prompt token"
    assert b.num_computed_tokens == 16, f"the first block hits, got {b.num_computed_tokens} cached tokens"


def test_eviction_is_lru_tail_first_and_spares_cached_blocks_while_uncached_ones_are_free(impl):
    bm = impl("stage04_batching.block_manager").BlockManager(8, block_size=16)
    prompt = list(range(3, 3 + 50))  # 3 full blocks + 1 partial
    a = _seq(impl, 0, prompt)
    bm.allocate(a)
    _computed(bm, a)
    bm.free(a)
    assert len(bm.match_prefix(prompt)) == 3, "freed blocks keep their cached prefix"
    b = _seq(impl, 1, list(range(60, 60 + 80)))  # 5 blocks: exactly the uncached free ones
    bm.allocate(b)
    assert len(bm.match_prefix(prompt)) == 3, "uncached free blocks must be used before evicting cached ones"
    c = _seq(impl, 2, [7])
    bm.allocate(c)
    assert len(bm.match_prefix(prompt)) == 2, "eviction takes the chain's tail block first"
    check_invariants(bm, [b, c], "after eviction")
    bm.free(b)
    bm.free(c)
    d = _seq(impl, 3, prompt + [9])
    bm.allocate(d)
    assert d.num_computed_tokens == 32, "the two surviving blocks still hit after other blocks came and went"


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_invariants_hold_under_random_operations(impl, data):
    bm = impl("stage04_batching.block_manager").BlockManager(24, block_size=4)
    live = []
    next_id = 0
    prefixes = [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 11, 12]]  # shared starts make prefix hits likely
    for step in range(data.draw(st.integers(5, 30), label="steps")):
        op = data.draw(st.sampled_from(["add", "append", "fork", "free", "free"]), label=f"op{step}")
        if op == "add":
            tokens = data.draw(st.sampled_from(prefixes), label="prefix") + data.draw(
                st.lists(st.integers(3, 6), min_size=1, max_size=9), label="suffix"
            )
            s = _seq(impl, next_id, tokens)
            next_id += 1
            if bm.can_allocate(s):
                bm.allocate(s)
                _computed(bm, s)
                live.append(s)
        elif op == "append" and live:
            s = data.draw(st.sampled_from(live), label="who")
            s.token_ids.append(data.draw(st.integers(3, 6), label="token"))
            if bm.can_append(s):
                bm.append_slot(s)
                _computed(bm, s)
            else:
                s.token_ids.pop()
        elif op == "fork" and live:
            parent = data.draw(st.sampled_from(live), label="parent")
            child = _seq(impl, next_id, list(parent.token_ids))
            next_id += 1
            bm.fork(parent, child)
            live.append(child)
        elif op == "free" and live:
            s = live.pop(data.draw(st.integers(0, len(live) - 1), label="which"))
            bm.free(s)
            assert s.block_table == [], f"after step {step}: a freed sequence keeps a stale block table {s.block_table}"
        check_invariants(bm, live, f"after step {step} ({op})")
    for s in live:
        bm.free(s)
    check_invariants(bm, [], "after freeing everything")
    assert bm.num_free_blocks == 24, "every block returns to the pool once all sequences finish"
