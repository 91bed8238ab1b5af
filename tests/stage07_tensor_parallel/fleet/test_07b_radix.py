"""§1 of lab2.ipynb: the radix prefix cache. On seeded random workloads with shared prefixes and
several page sizes, the tree is checked against the obvious prefix cache written here (every cached
page stored under the whole prefix it ends, as a hash chain does): the same hits and insert
counts, every cached key still findable after splits, leaf-first LRU eviction in the same order,
the exact values freed, and locked paths never evicted."""

import random

import pytest

pytestmark = pytest.mark.in_process("the test walks the learner's tree nodes")

RADIX = "stage07_tensor_parallel.fleet.radix_cache"
PAGE_SIZES = [1, 2, 3, 4]
SEEDS = [0, 1, 2]


class ObviousCache:
    """Every cached page under the tuple of all tokens up to its end: [values, last use, locks]."""

    def __init__(self, page_size: int):
        self.P, self.pages, self.clock = page_size, {}, 0

    def prefixes(self, key: list[int]) -> list[tuple]:
        return [tuple(key[:end]) for end in range(self.P, len(key) + 1, self.P)]

    def hit(self, key: list[int]) -> int:
        n = 0
        for p in self.prefixes(key):
            if p not in self.pages:
                break
            n = len(p)
        return n

    def match(self, key: list[int]) -> list[int]:
        self.clock += 1
        values = []
        for p in self.prefixes(key[: self.hit(key)]):
            self.pages[p][1] = self.clock
            values += self.pages[p][0]
        return values

    def insert(self, key: list[int], values: list[int]) -> int:
        self.clock += 1
        n = self.hit(key)
        for p in self.prefixes(key):
            self.pages.setdefault(p, [values[len(p) - self.P : len(p)], 0, 0])[1] = self.clock
        return n

    def lock(self, prefix: list[int], delta: int) -> None:
        for p in self.prefixes(prefix):
            self.pages[p][2] += delta

    def unlocked_leaves(self) -> list[tuple]:
        parents = {p[: -self.P] for p in self.pages}
        return [p for p, (_, _, locks) in self.pages.items() if p not in parents and locks == 0]

    def evict_pages(self, count: int) -> list[tuple]:
        """The next `count` pages leaf-first LRU would free: [(prefix, values)]."""
        out = []
        for _ in range(count):
            leaves = sorted(self.unlocked_leaves(), key=lambda p: self.pages[p][1])
            assert len(leaves) < 2 or self.pages[leaves[0]][1] < self.pages[leaves[1]][1], "the model has a tie"
            out.append((leaves[0], self.pages.pop(leaves[0])[0]))
        return out


def workload(seed: int, n: int):
    """n keys over a 3-token vocabulary with a few shared stems, so prefixes overlap and nodes split."""
    rng = random.Random(seed)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(2, 9))] for _ in range(3)]
    return [
        rng.choice(stems)[: rng.randrange(0, 9)] + [rng.randrange(3) for _ in range(rng.randrange(0, 8))]
        for _ in range(n)
    ]


def path_key(cache, node) -> list[int]:
    """Every token from the root through node, read off the parent links."""
    parts = []
    while node is not cache.root:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def check_tree(cache, model: ObviousCache, where: str):
    """The tree's structure agrees with the model: page-aligned nodes, consistent links, lock counts, sizes."""
    stack, seen = [cache.root], {}
    while stack:
        node = stack.pop()
        for name, child in node.children.items():
            assert child.parent is node, f"{where}: a child's parent link does not point at the node holding it"
            assert len(child.key) > 0 and len(child.key) % model.P == 0, (
                f"{where}: a node holds {len(child.key)} tokens, not a positive multiple of page_size={model.P}"
            )
            assert len(child.value) == len(child.key), (
                f"{where}: a node holds {len(child.key)} tokens but {len(child.value)} values"
            )
            assert name == (child.key[0] if model.P == 1 else tuple(child.key[: model.P])), (
                f"{where}: a child is filed under {name!r}, not under its first token/page"
            )
            full = path_key(cache, child)
            for end in range(len(full) - len(child.key) + model.P, len(full) + 1, model.P):
                seen[tuple(full[:end])] = child.lock_ref
            stack.append(child)
    assert set(seen) == set(model.pages), f"{where}: the tree caches other pages than the obvious cache"
    locks = {p: v[2] for p, v in model.pages.items()}
    assert seen == locks, f"{where}: lock_ref differs from the number of locked requests reading each node"
    total, protected = len(model.pages) * model.P, sum(model.P for v in model.pages.values() if v[2] > 0)
    assert (cache.total_size(), cache.protected_size(), cache.evictable_size()) == (
        total,
        protected,
        total - protected,
    ), f"{where}: sizes (total, protected, evictable) are wrong"


def flatten(evicted, P: int) -> list[tuple]:
    """The pages of evicted nodes, each node's deepest page first: [(prefix, values)]."""
    out = []
    for e in evicted:
        start = len(e.key) - len(e.value)
        out += [(tuple(e.key[:end]), e.value[end - P - start : end - start]) for end in range(len(e.key), start, -P)]
    return out


def run_ops(mod, seed: int, P: int, n: int, lock_rate: float = 0.0, evict_rate: float = 0.0):
    """A random mix of insert / match / lock / unlock / evict on the tree and the model, compared at every op."""
    rng = random.Random(seed)
    cache, model = mod.RadixCache(page_size=P), ObviousCache(P)
    counter, locks, kept = iter(range(10**9)), [], set()
    for i, key in enumerate(workload(seed, n)):
        where = f"seed={seed} page_size={P} op {i} key={key}"
        r = rng.random()
        if r < 0.45:
            values = [next(counter) for _ in key]
            expected = model.insert(key, values)
            got = cache.insert(key, values)
            assert got == expected, f"{where}: insert says {got} tokens were cached already, expected {expected}"
            kept |= set(values[expected : len(key) // P * P])
        else:
            expected = model.match(key)
            values, node = cache.match_prefix(key)
            assert values == expected, f"{where}: match_prefix returned {values}, expected {expected}"
            assert path_key(cache, node) == key[: len(values)], f"{where}: the node returned does not end at the match"
            if rng.random() < lock_rate:
                cache.inc_lock_ref(node)
                model.lock(key[: len(values)], +1)
                locks.append((node, key[: len(values)]))
        if locks and rng.random() < lock_rate / 2:
            node, prefix = locks.pop(rng.randrange(len(locks)))
            cache.dec_lock_ref(node)
            model.lock(prefix, -1)
        if rng.random() < evict_rate:
            want = rng.randrange(1, 3 * P + 2)
            evicted = cache.evict(want)
            got = flatten(evicted, P)
            freed = sum(len(e.value) for e in evicted)
            assert got == model.evict_pages(len(got)), (
                f"{where}: evict({want}) freed {got}; leaf-first LRU frees them in another order or other ones"
            )
            assert freed >= want or not model.unlocked_leaves(), f"{where}: evict({want}) stopped at {freed} tokens"
            assert not evicted or freed - len(evicted[-1].value) < want, (
                f"{where}: evict({want}) freed more nodes than needed"
            )
            kept -= {v for _, vals in got for v in vals}
        check_tree(cache, model, where)
    return cache, model, locks, kept


@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_match_prefix_hits_equal_the_hash_chain(impl, seed, P):
    run_ops(impl(RADIX), seed, P, 150)


@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_lock_ref_counts_the_locks_on_every_node_of_the_path(impl, seed, P):
    run_ops(impl(RADIX), seed + 10, P, 150, lock_rate=0.4)


@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_evict_frees_least_recently_used_leaves_first(impl, seed, P):
    run_ops(impl(RADIX), seed + 20, P, 200, lock_rate=0.3, evict_rate=0.2)


@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_insert_keeps_only_whole_pages_and_every_cached_key_stays_findable(impl, seed, P):
    mod = impl(RADIX)
    cache, model, _, _ = run_ops(mod, seed + 30, P, 120)
    for prefix, _ in list(model.pages.items()):
        key = list(prefix) + [7] * (P - 1)  # a partial page after a cached prefix is never part of a hit
        values, _ = cache.match_prefix(key)
        assert values == model.match(key), f"seed={seed} page_size={P}: cached key {list(prefix)} is not found whole"


@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_evict_never_frees_a_locked_node(impl, seed, P):
    mod = impl(RADIX)
    cache, model, locks, kept = run_ops(mod, seed + 40, P, 150, lock_rate=0.5)
    assert locks, f"seed={seed}: the workload locked nothing (pick another seed)"
    freed = [v for e in cache.evict(10**9) for v in e.value]
    assert len(freed) == len(set(freed)), f"seed={seed} page_size={P}: evict freed a value twice"
    locked = {v for p, (vals, _, n) in model.pages.items() if n > 0 for v in vals}
    assert set(freed) == kept - locked, (
        f"seed={seed} page_size={P}: evicting everything must free exactly the unlocked values the tree kept"
    )
    model.pages = {p: v for p, v in model.pages.items() if v[2] > 0}
    check_tree(cache, model, f"seed={seed} page_size={P} after evicting everything")
    for _, prefix in locks:
        values, _ = cache.match_prefix(prefix)
        assert len(values) == len(prefix), f"seed={seed} page_size={P}: a locked prefix {prefix} was evicted"
    for node, _ in locks:
        cache.dec_lock_ref(node)
    rest = [v for e in cache.evict(10**9) for v in e.value]
    assert sorted(freed + rest) == sorted(kept), (
        f"seed={seed} page_size={P}: unlocked, the locked values must be freed too"
    )
    assert cache.total_size() == 0, f"seed={seed} page_size={P}: the tree is not empty after evicting everything"
