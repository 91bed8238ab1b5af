"""One replica of the fleet: a small continuous-batching engine whose prefix cache is your RadixCache.

KV lives in a paged store (labkit.paged) with one slot per block, so every token has its own slot
and the prefix cache can own slots token by token. A slot is in exactly one of three places: the
pool (store.free_blocks), a request's table (the tokens it computed itself), or the prefix cache
(tokens some earlier request computed). A request that hits the cache starts with the cached slots
at the head of its block table and computes only the rest; while it runs it locks them, so eviction
cannot free KV it attends to. As soon as its prompt is computed, the prompt's whole pages go to the
cache (so requests arriving while it decodes reuse them), and when it finishes (or is aborted) the
rest of its slots do; each time the cache keeps what it did not hold yet and hands back duplicates.

Every step schedules, in admission order, each running request's next tokens (its uncached prompt,
in chunks, then one token at a time) within max_num_batched_tokens, and runs them as one ragged
forward. When the pool is short it evicts from the cache, then preempts the newest request (its
slots are freed; it is recomputed later from its tokens, nothing it generated is lost).

prefix_cache="radix" uses RadixCache(page_size); "hash" a given hash chain over whole pages
(stage 04's idea, vLLM's prefix caching); "none" reuses nothing. Both caches report the pages that
enter and leave them as KVEvents named by page_hashes, which the router's KV index replays.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit import paged
from labkit.model import Llama

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


@dataclass
class EngineRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class StepOutput:
    request_id: str
    token_id: int | None  # the new token (None when it finished without one: abort, error)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class KVEvent:
    kind: str  # "stored" | "removed"
    block_hashes: list[int]  # page_hashes of the pages that entered / left the cache


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


@dataclass
class Sequence:
    """A request inside the engine: its tokens so far (prompt + generated) and its cache lock."""

    request: EngineRequest
    seq_id: int
    tokens: list[int]
    generator: torch.Generator | None
    num_cached_tokens: int = 0  # from the cache at first admission (what the client is told)
    held: int = 0  # leading slots of its table that belong to the cache (locked)
    handle: object = None
    prefill_end: int = 0  # positions below this, when computed, count as prefill


class ReplicaEngine:
    """Continuous batching over a paged store with a prefix cache; see the module docstring."""

    def __init__(
        self,
        model: Llama,
        *,
        num_slots: int = 2048,
        page_size: int = 16,
        prefix_cache: str = "radix",
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 256,
        on_kv_event: Callable[[KVEvent], None] | None = None,
        kv_tiers=None,
    ):
        caches = {"radix": RadixPrefixCache, "hash": HashChainCache}
        if prefix_cache not in (*caches, "none"):
            raise ValueError(f"prefix_cache must be 'radix', 'hash' or 'none', got {prefix_cache!r}")
        if min(num_slots, page_size, max_num_seqs, max_num_batched_tokens) < 1:
            raise ValueError("num_slots, page_size, max_num_seqs and max_num_batched_tokens must all be >= 1")
        self.model, self.on_kv_event, self.page_size = model, on_kv_event, page_size
        self.store = paged.PagedKVStore(model, num_slots, 1)
        self.cache = caches[prefix_cache](page_size, self._emit) if prefix_cache in caches else NoPrefixCache()
        self.kv_tiers = kv_tiers  # a kv_tiers.TieredKVStore: evicted pages go there, admissions look there
        if kv_tiers is not None:
            if prefix_cache == "none":
                raise ValueError("kv_tiers needs a prefix cache to evict from and load into; use 'radix' or 'hash'")
            self.cache.on_evict = self._offload
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished_early: list[StepOutput] = []  # aborts, reported by the next step
        self.next_seq_id = 0
        # prompt_tokens and cached_tokens count first admissions; prefill_tokens_computed also counts
        # what preempted requests compute again, so without preemption prefill + cached == prompt.
        self.counts = dict(prefill_tokens_computed=0, prompt_tokens=0, cached_tokens=0, preemptions=0)
        self.counts["tier_loaded_tokens"] = 0  # of cached_tokens, those that came back from kv_tiers

    def _emit(self, kind: str, block_hashes: list[int]) -> None:
        if block_hashes and self.on_kv_event is not None:
            self.on_kv_event(KVEvent(kind, block_hashes))

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; ValueError (naming what is wrong) when it could never run."""
        r, c = request, self.model.config
        if any(s.request.request_id == r.request_id for s in (*self.waiting, *self.running)):
            raise ValueError(f"request id {r.request_id!r} is already in the engine; give each request its own id")
        if not r.prompt:
            raise ValueError(f"request {r.request_id!r} has an empty prompt; send at least one token")
        if bad := [t for t in r.prompt if not (isinstance(t, int) and 0 <= t < c.vocab_size)]:
            raise ValueError(f"request {r.request_id!r}: token ids {bad[:5]} are not in [0, {c.vocab_size})")
        if not isinstance(r.max_tokens, int) or r.max_tokens < 1:
            raise ValueError(f"request {r.request_id!r}: max_tokens must be an int >= 1, got {r.max_tokens!r}")
        if r.temperature < 0:
            raise ValueError(f"request {r.request_id!r}: temperature must be >= 0, got {r.temperature}")
        limit = min(self.store.num_blocks, c.max_position_embeddings)
        if len(r.prompt) + r.max_tokens > limit:
            raise ValueError(
                f"request {r.request_id!r}: {len(r.prompt)} prompt + {r.max_tokens} new tokens exceed the "
                f"{limit} this engine holds (KV slots {self.store.num_blocks}, model positions "
                f"{c.max_position_embeddings}); shorten the prompt or lower max_tokens"
            )
        gen = torch.Generator().manual_seed(r.seed) if r.seed is not None else None
        self.waiting.append(Sequence(r, self.next_seq_id, list(r.prompt), gen))
        self.next_seq_id += 1

    def abort(self, request_id: str) -> None:
        """Drop a request now (its computed KV goes to the cache); the next step reports it. Unknown id: no-op."""
        for seq in (*self.waiting, *self.running):
            if seq.request.request_id == request_id:
                if seq in self.running:
                    self.running.remove(seq)
                    self._release(seq, cache_it=True)
                else:
                    self.waiting.remove(seq)
                self.finished_early.append(StepOutput(request_id, None, True, "abort", seq.num_cached_tokens))
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finished_early)

    def cached_block_hashes(self) -> set[int]:
        """page_hashes of every page the prefix cache holds now (a snapshot)."""
        return self.cache.hashes()

    @property
    def stats(self) -> dict:
        cached = self.cache.evictable()
        in_use = self.store.num_blocks - len(self.store.free_blocks) - cached
        return dict(
            self.counts, slots_in_use=in_use, slots_cached=cached,
            num_running=len(self.running), num_waiting=len(self.waiting),
        )  # fmt: skip

    def step(self) -> list[StepOutput]:
        """Admit, schedule, run one ragged forward, sample; the outputs of this step."""
        out, self.finished_early = self.finished_early, []
        self._admit()
        batch = self._schedule()
        if not batch:
            return out
        logits = paged.forward(self.model, self.store, [s.seq_id for s, _ in batch], [c for _, c in batch])
        for (seq, chunk), rows in zip(batch, logits, strict=True):
            start = self.store.length(seq.seq_id) - len(chunk)
            self.counts["prefill_tokens_computed"] += max(0, min(seq.prefill_end - start, len(chunk)))
            if start < seq.prefill_end <= self.store.length(seq.seq_id):
                self._cache_prefill(seq)
            if self.store.length(seq.seq_id) < len(seq.tokens):
                continue  # a prefill chunk with more to come: nothing to sample yet
            out.append(self._sample(seq, rows[-1]))
        return out

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        r = seq.request
        if r.temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / r.temperature, -1), 1, generator=seq.generator))
        seq.tokens.append(token)
        reason = (
            "stop"
            if token in r.stop_token_ids
            else "length"
            if len(seq.tokens) - len(r.prompt) >= r.max_tokens
            else None
        )
        if reason:
            self.running.remove(seq)
            self._release(seq, cache_it=True)
        return StepOutput(r.request_id, token, reason is not None, reason, seq.num_cached_tokens)

    def _admit(self) -> None:
        """First come, first served, while a running slot is open and the pool (with what eviction can free) holds its prompt."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # keep at least the last token uncached: its logits give the first new token
            slots, handle = self.cache.acquire(seq.tokens[: len(seq.tokens) - 1])
            if self.kv_tiers is not None:
                slots, handle = self._load_from_tiers(seq.tokens[: len(seq.tokens) - 1], slots, handle)
            if len(seq.tokens) - len(slots) > len(self.store.free_blocks) + self.cache.evictable():
                self.cache.release(handle)
                return
            self.waiting.popleft()
            if seq.prefill_end == 0:  # first admission (a preempted request comes back with prefill_end set)
                seq.num_cached_tokens = len(slots)
                self.counts["prompt_tokens"] += len(seq.tokens)
                self.counts["cached_tokens"] += len(slots)
            seq.held, seq.handle, seq.prefill_end = len(slots), handle, len(seq.tokens)
            self.store.block_tables[seq.seq_id], self.store.lengths[seq.seq_id] = list(slots), len(slots)
            self.running.append(seq)

    def _schedule(self) -> list[tuple[Sequence, list[int]]]:
        """Each running request's next chunk within the token budget; evicts, then preempts, until the pool holds them."""
        while True:
            batch, budget = [], self.max_num_batched_tokens
            for seq in self.running:
                start = self.store.length(seq.seq_id)
                chunk = seq.tokens[start : start + budget]
                if chunk:
                    batch.append((seq, chunk))
                    budget -= len(chunk)
            short = sum(len(c) for _, c in batch) - len(self.store.free_blocks)
            if short > 0:
                self.store.free_blocks += self.cache.evict(short)
                short = sum(len(c) for _, c in batch) - len(self.store.free_blocks)
            if short <= 0:
                return batch
            victim = self.running.pop()  # the newest request: it has the least work to lose
            self._release(victim, cache_it=False)
            victim.handle, victim.held = None, 0
            self.waiting.appendleft(victim)
            self.counts["preemptions"] += 1

    def _offload(self, page_hash: int, slots: list[int]) -> None:
        """An evicted page's K and V, (layers, page_size, KV heads, head_dim), to the tiers before its slots are reused."""
        index = torch.tensor(slots)
        k = torch.stack([layer[index] for layer in self.store.k])
        self.kv_tiers.put(page_hash, k, torch.stack([layer[index] for layer in self.store.v]))

    def _load_from_tiers(self, tokens: list[int], slots: list[int], handle) -> tuple[list[int], object]:
        """Extend a cache hit with the pages that follow it along the hash chain and are in the tiers:
        written into free slots (evicting from the cache if needed) and inserted into the cache."""
        P, pages = self.page_size, []
        for h in page_hashes(tokens, P)[len(slots) // P :]:
            if (page := self.kv_tiers.get(h)) is None:
                break
            pages.append(page)
        if len(pages) * P > len(self.store.free_blocks):
            self.store.free_blocks += self.cache.evict(len(pages) * P - len(self.store.free_blocks))
        pages = pages[: len(self.store.free_blocks) // P]
        if not pages:
            return slots, handle
        new = [self.store.free_blocks.pop() for _ in range(len(pages) * P)]
        index = torch.tensor(new)
        for layer in range(len(self.store.k)):
            self.store.k[layer][index] = torch.cat([k[layer] for k, _ in pages])
            self.store.v[layer][index] = torch.cat([v[layer] for _, v in pages])
        end = len(slots) + len(new)
        self.store.free_blocks += self.cache.insert(tokens[:end], slots + new, len(slots))
        self.counts["tier_loaded_tokens"] += len(new)
        grown, grown_handle = self.cache.acquire(tokens[:end])
        self.cache.release(handle)
        return grown, grown_handle

    def _cache_prefill(self, seq: Sequence) -> None:
        """SGLang's cache_unfinished_req: once a prompt is computed its whole pages join the cache, so a
        request admitted while this one still decodes reuses them. Where the cache already held a page
        (a concurrent request cached it first), the table takes the cache's slots and frees its own;
        the lock moves to the node that now ends the prompt."""
        if isinstance(self.cache, NoPrefixCache):
            return
        sid, P = seq.seq_id, self.page_size
        kept = self.store.length(sid) // P * P
        if kept <= seq.held:
            return
        table, tokens = self.store.block_tables[sid], seq.tokens[:kept]
        duplicates = self.cache.insert(tokens, table[:kept], seq.held)
        slots, handle = self.cache.acquire(tokens)
        self.cache.release(seq.handle)
        table[:kept] = slots
        self.store.free_blocks += duplicates
        seq.held, seq.handle = kept, handle

    def _release(self, seq: Sequence, cache_it: bool) -> None:
        """Hand a leaving request's slots to the cache (cache_it) or the pool, and unlock its cached head."""
        sid = seq.seq_id
        table, length = self.store.block_tables.pop(sid), self.store.lengths.pop(sid)
        if cache_it:
            freed = self.cache.insert(seq.tokens[:length], table[:length], seq.held)
        else:
            freed = table[seq.held :]
        self.store.free_blocks += freed
        self.cache.release(seq.handle)
