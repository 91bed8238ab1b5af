"""PagedAttention's memory manager: a pool of fixed-size KV blocks, per-sequence block tables,
reference counts for sharing, and prefix caching with chained block hashes and LRU eviction.

Free blocks sit in one LRU queue (least recently used first). A freed block that holds a cached
prefix stays in the queue with its hash, so a later request can revive it; allocation pops the head,
and if that block still carries a hash, popping it is the eviction.
"""

from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and its K/V are computed
    token_ids: tuple[int, ...] = ()  # the tokens it holds, to verify a hash hit


def hash_block(parent_hash: int | None, token_ids: Tokens[int]) -> int:
    """Hash of a full block chained to the hash of the block before it (None for the first block),
    so equal hashes mean equal prefixes, not just equal blocks."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order, head first
        self.hash_to_block_id: dict[int, int] = {}  # block_hash -> block_id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def _pop_free(self) -> Block:
        """Take the least recently used free block for a new owner (ref_count 1), evicting its cached
        prefix if it holds one."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached run of leading full blocks of `token_ids`.

        Only blocks that end before the last token count: a full hit must still compute at least the
        last prompt token to get the logits of the first output token."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        for i in range((len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether allocate(seq) would find enough blocks: fresh ones plus the cached hits it revives
        from the free queue."""
        hits = self.match_prefix(seq.token_ids)
        revived = sum(self.blocks[b].ref_count == 0 for b in hits)
        return seq.num_blocks_needed(self.block_size) - len(hits) + revived <= len(self.free_queue)

    def allocate(self, seq: Sequence) -> None:
        """Build the block table of a waiting sequence: cached prefix blocks first (shared, ref_count + 1,
        revived from the free queue if nobody held them), then fresh blocks for all its remaining tokens.

        Sets both seq.num_computed_tokens and seq.num_cached_tokens to the cached length,
        len(hits) * block_size (0 without a hit): prefill starts after the hits, and the engine reports
        num_cached_tokens in each RequestOutput."""
        hits = self.match_prefix(seq.token_ids)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        fresh = [self._pop_free().block_id for _ in range(seq.num_blocks_needed(self.block_size) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """Whether append_slot(seq) can get the one block it may need."""
        needs_block = seq.num_blocks_needed(self.block_size) > len(seq.block_table)
        shared_tail = not needs_block and self.blocks[seq.block_table[-1]].ref_count > 1
        return len(self.free_queue) >= (needs_block or shared_tail)

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the sequence's newest token: a new block at a block boundary, or copy-on-write
        when the last block is shared (after fork). Returns (src, dst) block ids to copy, else None."""
        if seq.num_blocks_needed(self.block_size) > len(seq.block_table):
            seq.block_table.append(self._pop_free().block_id)
            return None
        last = self.blocks[seq.block_table[-1]]
        if last.ref_count == 1:
            return None
        last.ref_count -= 1
        copy = self._pop_free()
        seq.block_table[-1] = copy.block_id
        return last.block_id, copy.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (parallel sampling): no copy until one of them
        writes into a shared block."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the hash of every full block whose K/V are now computed, so later requests can hit it."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            parent = self.blocks[seq.block_table[i - 1]].block_hash if i else None
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.block_hash = hash_block(parent, block.token_ids)
            self.hash_to_block_id.setdefault(block.block_hash, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Blocks nobody owns go back to the queue: uncached ones at the
        head (reused first), cached ones at the tail in reverse order, so a chain's tail is evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
