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
    raise NotImplementedError("stage04: hash_block — see lab.ipynb §3")


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
        raise NotImplementedError("stage04: BlockManager._pop_free — see lab.ipynb §1")

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached run of leading full blocks of `token_ids`.

        Only blocks that end before the last token count: a full hit must still compute at least the
        last prompt token to get the logits of the first output token."""
        if not self.enable_prefix_caching:
            return []
        raise NotImplementedError("stage04: BlockManager.match_prefix — see lab.ipynb §3")

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether allocate(seq) would find enough blocks: fresh ones plus the cached hits it revives
        from the free queue."""
        raise NotImplementedError("stage04: BlockManager.can_allocate — see lab.ipynb §1")

    def allocate(self, seq: Sequence) -> None:
        """Build the block table of a waiting sequence: cached prefix blocks first (shared, ref_count + 1,
        revived from the free queue if nobody held them), then fresh blocks for all its remaining tokens.

        Sets both seq.num_computed_tokens and seq.num_cached_tokens to the cached length,
        len(hits) * block_size (0 without a hit): prefill starts after the hits, and the engine reports
        num_cached_tokens in each RequestOutput."""
        raise NotImplementedError("stage04: BlockManager.allocate — see lab.ipynb §1")

    def can_append(self, seq: Sequence) -> bool:
        """Whether append_slot(seq) can get the one block it may need."""
        needs_block = seq.num_blocks_needed(self.block_size) > len(seq.block_table)
        shared_tail = not needs_block and self.blocks[seq.block_table[-1]].ref_count > 1
        return len(self.free_queue) >= (needs_block or shared_tail)

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the sequence's newest token: a new block at a block boundary, or copy-on-write
        when the last block is shared (after fork). Returns (src, dst) block ids to copy, else None."""
        raise NotImplementedError("stage04: BlockManager.append_slot — see lab.ipynb §1")

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (parallel sampling): no copy until one of them
        writes into a shared block."""
        raise NotImplementedError("stage04: BlockManager.fork — see lab.ipynb §1")

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the hash of every full block whose K/V are now computed, so later requests can hit it."""
        if not self.enable_prefix_caching:
            return
        raise NotImplementedError("stage04: BlockManager.cache_blocks — see lab.ipynb §3")

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Blocks nobody owns go back to the queue: uncached ones at the
        head (reused first), cached ones at the tail in reverse order, so a chain's tail is evicted first."""
        raise NotImplementedError("stage04: BlockManager.free — see lab.ipynb §1")
