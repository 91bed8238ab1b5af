"""The replica engine's three prefix caches behind one interface (acquire, release, insert, evict), and the
page hashes that name cached pages in KV events and in the router's index.

RadixPrefixCache adapts your RadixCache (lab2 §1); HashChainCache is stage 04's hash chain over whole
pages (vLLM's prefix caching); NoPrefixCache reuses nothing. Slots are the values each cache keeps.
"""

from collections.abc import Callable

from .radix_cache import RadixCache


def page_hashes(token_ids: list[int], page_size: int) -> list[int]:
    """The chained hash of every full page (hash of (parent page hash, tuple(page tokens))), first page
    first: equal hashes mean equal prefixes. Python's hash of ints and tuples is the same in every
    process (PYTHONHASHSEED randomizes only str/bytes), so router and engines agree."""
    hashes, h = [], 0
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hash((h, tuple(token_ids[start : start + page_size])))
        hashes.append(h)
    return hashes


class RadixPrefixCache:
    """The engine's view of a RadixCache: slot ids are its values; events name whole pages."""

    def __init__(self, page_size: int, emit: Callable[[str, list[int]], None]):
        self.tree, self.page_size, self.emit = RadixCache(page_size), page_size, emit
        self.on_evict: Callable[[int, list[int]], None] | None = None  # (page hash, its slots), before they are freed

    def acquire(self, tokens: list[int]) -> tuple[list[int], object]:
        slots, node = self.tree.match_prefix(tokens)
        self.tree.inc_lock_ref(node)
        return slots, node

    def release(self, node) -> None:
        self.tree.dec_lock_ref(node)

    def insert(self, tokens: list[int], slots: list[int], held: int) -> list[int]:
        """Give a request's computed tokens to the cache (slots[:held] came from it); the slots it did not keep."""
        cached = self.tree.insert(tokens, slots)
        kept = len(tokens) // self.page_size * self.page_size
        self.emit("stored", page_hashes(tokens[:kept], self.page_size)[cached // self.page_size :])
        return slots[held:cached] + slots[kept:]

    def evict(self, num_slots: int) -> list[int]:
        freed = []
        for e in self.tree.evict(num_slots):
            hashes = page_hashes(e.key, self.page_size)[(len(e.key) - len(e.value)) // self.page_size :]
            self.emit("removed", hashes)
            for i, h in enumerate(hashes if self.on_evict else ()):
                self.on_evict(h, e.value[i * self.page_size : (i + 1) * self.page_size])
            freed += e.value
        return freed

    def evictable(self) -> int:
        return self.tree.evictable_size()

    def hashes(self) -> set[int]:
        out, stack = set(), [(child, 0) for child in self.tree.root.children.values()]
        while stack:
            node, h = stack.pop()
            for start in range(0, len(node.key), self.page_size):  # a node's key is whole pages
                h = hash((h, tuple(node.key[start : start + self.page_size])))
                out.add(h)
            stack += [(child, h) for child in node.children.values()]
        return out


class HashChainCache:
    """Whole pages keyed by their chained hash, each with a reference count and a last-use time; a
    hit is the run of leading pages present. Eviction frees unreferenced pages, least recently used
    first and, among pages used together, the deepest first (a chain's tail goes before its head)."""

    def __init__(self, page_size: int, emit: Callable[[str, list[int]], None]):
        self.page_size, self.emit, self.clock = page_size, emit, 0
        self.pages: dict[int, list] = {}  # hash -> [slots, ref count, last use, depth]
        self.on_evict: Callable[[int, list[int]], None] | None = None

    def acquire(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        self.clock += 1
        hit = []
        for h in page_hashes(tokens, self.page_size):
            if h not in self.pages:
                break
            hit.append(h)
            self.pages[h][1] += 1
            self.pages[h][2] = self.clock
        return [s for h in hit for s in self.pages[h][0]], hit

    def release(self, hit: list[int]) -> None:
        for h in hit:
            self.pages[h][1] -= 1

    def insert(self, tokens: list[int], slots: list[int], held: int) -> list[int]:
        self.clock += 1
        P, rest, stored = self.page_size, [], []
        hashes = page_hashes(tokens, P)
        for i, h in enumerate(hashes):
            page = slots[i * P : (i + 1) * P]
            if h not in self.pages:
                self.pages[h] = [page, 0, self.clock, i]
                stored.append(h)
            elif self.pages[h][0] != page:
                rest += page  # computed again while another request cached it: a duplicate
            self.pages[h][2] = self.clock
        self.emit("stored", stored)
        return rest + slots[len(hashes) * P :]

    def evict(self, num_slots: int) -> list[int]:
        order = sorted((p[2], -p[3], h) for h, p in self.pages.items() if p[1] == 0)
        freed, removed = [], []
        for *_, h in order:
            if len(freed) >= num_slots:
                break
            slots = self.pages.pop(h)[0]
            if self.on_evict:
                self.on_evict(h, slots)
            freed += slots
            removed.append(h)
        self.emit("removed", removed)
        return freed

    def evictable(self) -> int:
        return sum(len(p[0]) for p in self.pages.values() if p[1] == 0)

    def hashes(self) -> set[int]:
        return set(self.pages)


class NoPrefixCache:
    """Reuses nothing: a request starts from scratch and its slots go straight back to the pool."""

    def acquire(self, tokens):
        return [], None

    def release(self, handle) -> None:
        pass

    def insert(self, tokens, slots, held):
        return slots

    def evict(self, num_slots):
        return []

    def evictable(self):
        return 0

    def hashes(self):
        return set()
