"""Which units of the model each pipeline stage holds: a contiguous split balanced by measured cost.

A Llama of L decoder layers is L + 2 units, in order: the token embedding (unit 0), the layers
(units 1 .. L) and the final norm with the LM head (unit L + 1). Stage s holds the contiguous units
[start, end) of bounds[s]; the first stage holds unit 0, the last unit L + 1. A pipeline runs at the pace
of its slowest stage, so the split minimises the largest stage's cost, and the costs are measured, not
assumed: on SmolLM2 the LM head (49,152 x 576 weights) costs as much as several layers. lab6.ipynb §1.
"""

import torch

from labkit.model import Llama
from labkit.timing import measure


@torch.no_grad()
def measure_costs(model: Llama, tokens: int = 1, repeats: int = 5) -> list[float]:
    """Seconds each of the model's L + 2 units takes on one sequence of `tokens` positions (median of
    `repeats`), in unit order: the embedding, every layer, the final norm and LM head."""
    ids = torch.ones(1, tokens, dtype=torch.long)
    x, cos, sin, mask = model.layer_inputs(ids)
    costs = [measure(lambda: model.model.embed_tokens(ids), repeats).median]
    for layer in model.model.layers:
        costs.append(measure(lambda layer=layer: layer(x, cos, sin, mask), repeats).median)
    costs.append(measure(lambda: model.lm_head(model.model.norm(x[:, -1:])), repeats).median)
    return costs


def check_partition(bounds: list[tuple[int, int]], num_units: int, num_stages: int) -> None:
    """Raise ValueError unless `bounds` is num_stages non-empty ranges (start, end) that tile 0 .. num_units
    in order: the first starts at 0, each starts where the previous ended, the last ends at num_units.
    The message names the stage at fault and what it should have been (a gap, an overlap, an empty stage,
    the wrong number of stages), so a wrong partition never reaches a process group."""
    if len(bounds) != num_stages:
        raise ValueError(f"the partition has {len(bounds)} stages, the pipeline {num_stages}: one range per stage")
    expected_start = 0
    for s, (start, end) in enumerate(bounds):
        if start != expected_start:
            what = "a gap" if start > expected_start else "an overlap"
            raise ValueError(
                f"stage {s} starts at unit {start}, not {expected_start}: {what} in the partition {bounds}"
            )
        if end <= start:
            raise ValueError(f"stage {s} is empty or reversed ({start}, {end}): every stage needs at least one unit")
        expected_start = end
    if expected_start != num_units:
        raise ValueError(f"the partition {bounds} ends at unit {expected_start}; the model has {num_units} units")


def balanced_partition(costs: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Split units with costs (n,) into num_stages contiguous non-empty ranges [(start, end), ...] tiling 0 .. n
    so that the largest stage's total cost is as small as any such split can make it (a split check_partition
    accepts). Raises ValueError when num_stages < 1 or num_stages > n (a stage would be empty)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} units into {num_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest largest-stage cost of splitting the first i units into k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds, end = [], n
    for k in range(num_stages, 0, -1):
        bounds.append((cut[k][end], end))
        end = cut[k][end]
    return bounds[::-1]
