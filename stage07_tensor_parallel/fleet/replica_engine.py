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
(stage 04's idea, vLLM's prefix caching); "none" reuses nothing (prefix_caches.py). Both caches report
the pages that enter and leave them as KVEvents named by page_hashes, which the router's KV index replays.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit import paged
from labkit.model import Llama
from labkit.serving import check_request

from .prefix_caches import HashChainCache, NoPrefixCache, RadixPrefixCache, page_hashes


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
        if not isinstance(r.max_tokens, int) or r.max_tokens < 1:
            raise ValueError(f"request {r.request_id!r}: max_tokens must be an int >= 1, got {r.max_tokens!r}")
        if r.temperature < 0:
            raise ValueError(f"request {r.request_id!r}: temperature must be >= 0, got {r.temperature}")
        # the checks the router made (and stage 04's server makes); the context is what KV slots and positions hold
        limit = min(self.store.num_blocks, c.max_position_embeddings)
        check_request(list(r.prompt), r.max_tokens, max_model_len=limit, vocab_size=c.vocab_size)
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
