"""A continuous-batching engine that speculates: given code around batch_verify's two TODOs.

Every step: admit waiting requests while the block pool has room, pick each running sequence's
k (fixed, or choose_k from its measured acceptance and the batch size), draft k tokens per
sequence with the draft model (one batched draft forward per draft position), verify all drafts in
one target forward (verify_batch), then retire the sequences that are done. The draft may instead be
an EAGLE head (labkit.eagle.EagleHead, lab4): it drafts per sequence from the target features that
the last verification produced, in a small contiguous cache of its own, and a sequence drafts
nothing until one verification has given it features. Sequences join and
leave between steps, so the batch is ragged: sequences differ in length, in k, in accepted count.

KV lives in two paged stores (labkit.paged), one per model. Invariant between steps, for every
running sequence: the target store holds all its tokens but the last, the draft store a prefix of
that, and each holds exactly the blocks those positions need. When the pool runs short, the
most recently admitted sequence is preempted: its blocks are freed and it waits to be recomputed
from its tokens (nothing it generated is lost).
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from labkit import paged, timing
from labkit.eagle import EagleHead
from labkit.model import KVCache, Llama

from . import eagle
from .batch_verify import choose_k, verify_batch
from .sampling import sample, warp


@dataclass
class Costs:
    """Seconds of one forward pass: draft(B) over B sequences one token each, target(B, T) over B
    sequences T tokens each. measure() times them; a test passes its own cost model."""

    draft: Callable[[int], float]
    target: Callable[[int, int], float]

    @classmethod
    def measure(cls, target: Llama, draft: Llama, batch_sizes: list[int], k_max: int, context: int = 64):
        """Time both models on the paged forward the engine uses (medians, interleaved); a batch size
        between two measured ones takes the larger one's cost."""
        seconds = {}
        for B in batch_sizes:
            one = _eagle_step(draft, B, context) if isinstance(draft, EagleHead) else _paged_step(draft, B, context, 1)
            steps = {("draft", 1): one}
            steps |= {("target", T): _paged_step(target, B, context, T) for T in range(1, k_max + 2)}
            seconds |= {(B, *name): t.median for name, t in timing.interleaved(steps, 3, warmup=1).items()}

        def at(B: int, model: str, T: int) -> float:
            if T > k_max + 1:
                raise ValueError(
                    f"costs were measured for k <= {k_max}; measure with a larger k_max to ask about k = {T - 1}"
                )
            return seconds[(min((b for b in batch_sizes if b >= B), default=max(batch_sizes)), model, T)]

        return cls(draft=lambda B: at(B, "draft", 1), target=lambda B, T: at(B, "target", T))


def _paged_step(model: Llama, B: int, context: int, T: int):
    """A callable running one paged forward of B sequences over T new tokens after `context` cached ones."""
    store = paged.PagedKVStore(model, B * (-(-(context + T) // 16)), 16)
    ids = list(range(B))
    paged.forward(model, store, ids, [[1] * context for _ in ids])

    def step():
        paged.forward(model, store, ids, [[1] * T for _ in ids])
        for s in ids:
            store.truncate(s, context)

    return step


def _eagle_step(head: EagleHead, B: int, context: int):
    """A callable running one EAGLE draft step for each of B sequences (the engine drafts them one by one)."""
    H = head.config.hidden_size
    caches = [head.new_cache(context + 1) for _ in range(B)]
    for cache in caches:
        eagle.draft_forward(head, cache, torch.zeros(context, H), torch.ones(context, dtype=torch.long))

    def step():
        for cache in caches:
            eagle.draft_forward(head, cache, torch.zeros(1, H), torch.ones(1, dtype=torch.long))
            cache.truncate(context)

    return step


@dataclass
class EagleState:
    """One sequence's EAGLE draft: its cache (positions read from true features) and the true features
    of the positions after them, with the token after each, that it has not read yet."""

    cache: KVCache
    feats: list[torch.Tensor] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


@dataclass
class Sequence:
    """One request in the engine, with its own acceptance counts."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended on a rejected draft
    token_times: list[float] = field(default_factory=list)  # when each generated token was emitted

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


class SpecBatchEngine:
    """Continuous batching with speculative decoding; k=0 (or draft=None) is the same engine without it.

    k:           tokens drafted per sequence per step, or the most choose_k may pick when costs is given
    costs:       Costs for choose_k (adaptive k per sequence, off when it does not pay); None = always k
    temperature: 0 for greedy decoding, else sampling from warp(logits, temperature, top_p)
    """

    def __init__(
        self,
        target: Llama,
        draft: Llama | EagleHead | None = None,
        k: int = 4,
        costs: Costs | None = None,
        num_blocks: int = 256,
        block_size: int = 16,
        max_batch: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_id: int | None = None,
    ):
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}); a draft must share the target's tokenizer"
            )
        self.target, self.draft = target, draft
        self.k_max = k if draft is not None else 0
        self.costs = costs
        self.store = paged.PagedKVStore(target, num_blocks, block_size)
        self.eagle = draft if isinstance(draft, EagleHead) else None
        self.eagle_states: dict[int, EagleState] = {}
        paged_draft = draft is not None and self.eagle is None
        self.draft_store = paged.PagedKVStore(draft, num_blocks, block_size) if paged_draft else None
        self.max_batch, self.temperature, self.top_p, self.eos_id = max_batch, temperature, top_p, eos_id
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = self.preemptions = 0
        self.accepted = self.rejected = 0  # over every sequence so far: the prior of a new one's alpha
        self.next_id = 0

    def add(self, prompt: list[int], max_new_tokens: int) -> Sequence:
        """Queue a request; it joins the batch at the next step with room for it."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1")
        need = self.store.blocks_needed(len(prompt) + max_new_tokens + self.k_max)
        if need > self.store.num_blocks:
            raise ValueError(
                f"a request of {len(prompt)} + {max_new_tokens} tokens needs {need} blocks, the pool has "
                f"{self.store.num_blocks}; create the engine with a larger num_blocks"
            )
        seq = Sequence(self.next_id, list(prompt), max_new_tokens, list(prompt))
        self.next_id += 1
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> list[Sequence]:
        """Step until every request is done; the sequences in the order they finished."""
        done = []
        while self.has_work():
            done += self.step()
        return done

    def fits(self, seqs: list[Sequence], ks: list[int]) -> bool:
        """Whether both pools hold seqs once this step has read their tokens and ks drafts."""
        target = sum(self.store.blocks_needed(len(s.tokens) + k) for s, k in zip(seqs, ks, strict=True))
        if target > self.store.num_blocks:
            return False
        # the draft reads the tokens and all drafts but the last
        draft = sum(self.store.blocks_needed(len(s.tokens) + k - 1) for s, k in zip(seqs, ks, strict=True))
        return self.draft_store is None or draft <= self.draft_store.num_blocks

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it."""
        self.admit()
        ks = self.plan()
        seqs = self.running
        drafts, q = self.propose(seqs, ks)
        unread = [len(s.tokens) - self.store.length(s.seq_id) for s in seqs]
        seen = []  # the target's features, (1, N, H): the chunks packed in sequence order, for an EAGLE draft
        hook = self.target.model.norm.register_forward_hook(lambda m, a, out: seen.append(out)) if self.eagle else None
        new = verify_batch(
            self.target, self.store, [s.seq_id for s in seqs], [s.tokens for s in seqs], drafts, q,
            self.temperature or 1.0, self.top_p, self.generator,
        )  # fmt: skip
        if hook is not None:
            hook.remove()
            self.hand_off(seqs, [u + len(d) for u, d in zip(unread, drafts, strict=True)], unread, new, seen[-1])
        now, finished = time.perf_counter(), []
        for seq, drafted, emitted in zip(seqs, drafts, new, strict=True):
            n = len(emitted) - 1
            seq.proposed += len(drafted)
            seq.accepted += n
            seq.rejected += n < len(drafted)
            self.accepted, self.rejected = self.accepted + n, self.rejected + (n < len(drafted))
            if self.eos_id is not None and self.eos_id in emitted:
                emitted = emitted[: emitted.index(self.eos_id) + 1]
            seq.tokens += emitted
            seq.token_times += [now] * len(emitted)
            if self.draft_store is not None and self.draft_store.length(seq.seq_id) >= len(seq.tokens):
                self.draft_store.truncate(seq.seq_id, len(seq.tokens) - 1)  # the draft's rejected positions too
            if len(seq.generated) >= seq.max_new_tokens or (self.eos_id is not None and self.eos_id in emitted):
                finished.append(seq)
        for seq in finished:
            self.release(seq)
            self.running.remove(seq)
        self.steps += 1
        return finished

    def hand_off(self, seqs: list[Sequence], sizes: list[int], unread: list[int], new: list[list[int]],
                 feats: torch.Tensor) -> None:  # fmt: skip
        """Give each sequence's EAGLE draft the true features of the positions the target just kept: its
        unread tokens and accepted drafts. feats (1, N, H) holds the verification's chunks packed in sequence
        order, sizes[i] rows each (labkit.paged.forward packs the batch)."""
        rows = feats.reshape(-1, feats.shape[-1])
        if rows.shape[0] != sum(sizes):
            raise RuntimeError(f"paged.forward's final norm saw {rows.shape[0]} rows for chunks of {sizes}")
        for i, (seq, emitted, chunk) in enumerate(zip(seqs, new, rows.split(sizes), strict=True)):
            size = len(seq.prompt) + seq.max_new_tokens + self.k_max + 1
            state = self.eagle_states.setdefault(seq.seq_id, EagleState(self.eagle.new_cache(size)))
            kept = unread[i] + len(emitted) - 1
            start = len(seq.tokens) - unread[i] + 1  # seq.tokens is not extended yet: the token after the first row
            state.feats.append(chunk[:kept])
            state.ids += (seq.tokens + emitted)[start : start + kept]

    def admit(self) -> None:
        """Move waiting requests into the batch, first come first served, while their blocks fit."""
        while self.waiting and len(self.running) < self.max_batch:
            seqs = [*self.running, self.waiting[0]]
            if self.running and not self.fits(seqs, [self.k_max] * len(seqs)):
                break
            self.running.append(self.waiting.popleft())

    def plan(self) -> list[int]:
        """Each running sequence's k for this step, preempting the newest sequences until the pools hold them all."""
        while True:
            ks = [self.k_for(s) for s in self.running]
            if self.fits(self.running, ks):
                return ks
            if len(self.running) == 1:
                raise paged.OutOfBlocks(f"one sequence of {len(self.running[0].tokens)} tokens does not fit the pool")
            victim = self.running.pop()
            self.release(victim)
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def k_for(self, seq: Sequence) -> int:
        """Drafts for seq this step: never more than it still needs minus the target's own token."""
        left = seq.max_new_tokens - len(seq.generated) - 1
        if self.eagle is not None and seq.seq_id not in self.eagle_states:
            return 0  # no target features yet: this step's verification is the prefill
        if self.costs is None:
            return min(self.k_max, left)
        k = choose_k(self.alpha(seq), len(self.running), self.costs, self.k_max)
        if self.accepted + self.rejected == 0:  # nothing measured yet: draft one token to find out
            k = max(k, 1)
        return min(k, left)

    def alpha(self, seq: Sequence) -> float:
        """seq's acceptance, (accepted + 2 prior) / (accepted + rejected + 2), where the prior is the
        engine's pooled acceptance (0.75 before any measurement). Until something is measured, k_for
        drafts at least one token: a choose_k of 0 would never draft, so never measure, so never start."""
        prior = (self.accepted + 3) / (self.accepted + self.rejected + 4)
        return (seq.accepted + 2 * prior) / (seq.accepted + seq.rejected + 2)

    def release(self, seq: Sequence) -> None:
        """Free every block of seq; a preempted sequence keeps its tokens and is recomputed from them."""
        for store in (self.store, self.draft_store):
            if store is not None:
                store.free(seq.seq_id)
        self.eagle_states.pop(seq.seq_id, None)  # recomputed with the target's features on its return

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """Draft ks[i] tokens for seqs[i]: draft position j is one batched draft forward over the
        sequences with ks[i] > j (the first also reads what the draft's cache lacks). Greedy drafts are
        argmaxes; sampled ones come with q[i]: (ks[i], V), the distributions they were drawn from."""
        if self.eagle is not None:
            return self.propose_eagle(seqs, ks)
        drafts: list[list[int]] = [[] for _ in seqs]
        q: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > j]
            chunks = [seqs[i].tokens[self.draft_store.length(seqs[i].seq_id) :] if j == 0 else drafts[i][-1:] for i in active]  # fmt: skip
            logits = paged.forward(self.draft, self.draft_store, [seqs[i].seq_id for i in active], chunks)
            for i, row in zip(active, logits, strict=True):
                if self.temperature == 0:
                    drafts[i].append(int(row[-1].argmax()))
                else:
                    q[i].append(warp(row[-1], self.temperature, self.top_p))
                    drafts[i].append(sample(q[i][-1], self.generator))
        if self.temperature == 0:
            return drafts, None
        vocab = self.target.config.vocab_size
        return drafts, [torch.stack(rows) if rows else torch.zeros(0, vocab) for rows in q]

    def propose_eagle(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """propose() with an EAGLE head: each sequence drafts on its own from the features it was handed."""
        drafts, q = [], []
        vocab = self.target.config.vocab_size
        for seq, k in zip(seqs, ks, strict=True):
            state = self.eagle_states.get(seq.seq_id)
            if not k or state is None:
                drafts.append([])
                q.append(torch.zeros(0, vocab))
                continue
            read = state.cache.length + len(state.ids)
            d, dist = eagle.propose(self.eagle, state.cache, torch.cat(state.feats), state.ids, k, self.temperature, self.top_p, self.generator)  # fmt: skip
            state.cache.truncate(read)  # forget the positions read from the draft's own predictions
            state.feats, state.ids = [], []
            drafts.append(d)
            q.append(dist)
        return drafts, (None if self.temperature == 0 else q)
