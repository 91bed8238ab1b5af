"""Random Medusa trees and oracle heads for the stage-06 part-2 Medusa tests."""

import torch


def random_paths(seed: int, depth: int, n: int, max_rank: int = 3) -> list[tuple[int, ...]]:
    """n distinct tree paths (tuples of top-k ranks, every prefix included, at most `depth` long),
    in node order: shorter first, then lexicographic."""
    g = torch.Generator().manual_seed(seed)
    paths: set[tuple[int, ...]] = set()
    while len(paths) < n:
        nodes = [(), *sorted(p for p in paths if len(p) < depth)]
        parent = nodes[int(torch.randint(0, len(nodes), (1,), generator=g))]
        paths.add((*parent, int(torch.randint(0, max_rank + 1, (1,), generator=g))))
    return sorted(paths, key=lambda p: (len(p), p))


class OracleHeads:
    """Heads that know the target's greedy continuation `full` (prompt + its greedy tokens).

    Given a hidden state, they find its position t among `hidden` (the target's final normed hidden
    states over `full`, nearest neighbour), and head k puts full[t + k + 1] at rank ranks[k - 1](t):
    0 = its argmax, a rank past the tree = a miss. Other tokens get seeded random order."""

    def __init__(self, full: list[int], hidden: torch.Tensor, vocab_size: int, num_heads: int, rank_of, seed: int):
        self.full, self.hidden, self.V, self.K, self.rank_of = full, hidden, vocab_size, num_heads, rank_of
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        t = int((self.hidden - h.float()).norm(dim=-1).argmin())
        logits = torch.empty(self.K, self.V)
        for k in range(1, self.K + 1):
            order = torch.randperm(self.V, generator=self.g).tolist()
            if t + k + 1 < len(self.full):
                right = self.full[t + k + 1]
                order.remove(right)
                order.insert(self.rank_of(t, k), right)
            logits[k - 1, order] = -torch.arange(self.V, dtype=torch.float32)
        return logits
