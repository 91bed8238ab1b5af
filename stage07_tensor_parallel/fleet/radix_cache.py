"""A radix tree over token ids that caches each cached prefix once: SGLang's RadixAttention.

Every node holds a run of tokens (`key`) and what the owner stores for each of them (`value`: the
engine's KV slot ids; the router stores the tokens themselves). A path from the root spells a
cached sequence; two sequences that share a prefix share the nodes of that prefix, so a new
request reuses the longest cached prefix of its prompt, whatever request put it there.

Running requests lock the path they read (`lock_ref`), so eviction never frees KV a request still
attends to. Eviction frees least-recently-used leaves first: a leaf is the end of one cached
sequence, and removing it keeps every other cached sequence whole. Recency is a logical clock
(bumped on every match and insert), so the same calls always give the same order.

With page_size P > 1 the tree works in whole pages: keys are cut to a multiple of P, children are
told apart by their first page, and matches stop at a page boundary (a page of KV is all or nothing).
"""

from dataclasses import dataclass, field


@dataclass(eq=False)  # nodes are compared by identity (dict keys, `is`), never by content
class TreeNode:
    """One run of tokens. children: first token (page_size 1) or first page (a tuple) -> child node."""

    key: list[int] = field(default_factory=list)
    value: list[int] = field(default_factory=list)
    parent: "TreeNode | None" = field(default=None, repr=False)
    children: dict = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # running requests whose path goes through this node
    last_access: int = 0  # the logical clock when a match or insert last went through this node


@dataclass
class Evicted:
    """One evicted node: key is every token from the root through it (to name its pages), value its own values."""

    key: list[int]
    value: list[int]


class RadixCache:
    """A prefix cache: match_prefix finds what is cached, insert adds to it, evict frees LRU leaves.

    Invariants the tests check: every cached sequence stays findable after any split; a node's
    lock_ref counts the locked nodes at or below it; evict never frees a node with lock_ref > 0;
    evictable_size() + protected_size() == total_size() == tokens in the tree.
    """

    def __init__(self, page_size: int = 1):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self.root = TreeNode()
        self.clock = 0

    # --- given plumbing ---

    def child_key(self, key: list[int]):
        """How a parent names the child whose key starts with `key`: its first token, or its first page."""
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def match_length(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of a and b, rounded down to a multiple of page_size."""
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n // self.page_size * self.page_size

    def tick(self) -> int:
        """Advance the logical clock; the new time stamps every node an access goes through."""
        self.clock += 1
        return self.clock

    def nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack += node.children.values()
        return out

    def total_size(self) -> int:
        """Tokens held in the tree."""
        return sum(len(n.key) for n in self.nodes())

    def protected_size(self) -> int:
        """Tokens on locked paths (eviction may not free them)."""
        return sum(len(n.key) for n in self.nodes() if n.lock_ref > 0)

    def evictable_size(self) -> int:
        """Tokens eviction may free (those on no locked path)."""
        return self.total_size() - self.protected_size()

    def full_key(self, node: TreeNode) -> list[int]:
        """Every token from the root through node."""
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    # --- the lab ---

    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        """The values of the longest cached prefix of key (a multiple of page_size long) and the node
        where that prefix ends (the root when nothing matches).

        A match that ends inside a node splits it, so the returned node ends exactly at the match.
        Every node on the path gets the current time (it was just used).
        """
        raise NotImplementedError("stage07: RadixCache.match_prefix — see lab2.ipynb §1")

    def insert(self, key: list[int], value: list[int] | None = None) -> int:
        """Cache key[: len(key) // page_size * page_size] with its values (value=None: the key itself).

        Returns how many leading tokens were cached already: their entries in `value` are duplicates
        the tree does not keep (the caller frees them). Every node on the path gets the current time.
        """
        value = list(key) if value is None else value
        if len(value) != len(key):
            raise ValueError(f"insert needs one value per token: got {len(key)} tokens and {len(value)} values")
        raise NotImplementedError("stage07: RadixCache.insert — see lab2.ipynb §1")

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut child after its first split_len tokens (0 < split_len < len(child.key)): a new node
        takes child's place under its parent with the head of key and value (and child's lock_ref and
        time), and child keeps the tail below it. Returns the new node."""
        raise NotImplementedError("stage07: RadixCache._split_node — see lab2.ipynb §1")

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock node and every ancestor: a running request reads this whole prefix."""
        raise NotImplementedError("stage07: RadixCache.inc_lock_ref — see lab2.ipynb §1")

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node) (the request finished or was aborted)."""
        raise NotImplementedError("stage07: RadixCache.dec_lock_ref — see lab2.ipynb §1")

    def evict(self, num_tokens: int) -> list[Evicted]:
        """Free least-recently-used unlocked leaves until at least num_tokens tokens are freed or
        nothing unlocked is left. A parent left without children becomes a leaf and may go next.
        Returns the evicted nodes in eviction order; never frees a locked node."""
        raise NotImplementedError("stage07: RadixCache.evict — see lab2.ipynb §1")
