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
    raise NotImplementedError("stage07: check_partition — see lab6.ipynb §1")


def balanced_partition(costs: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Split units with costs (n,) into num_stages contiguous non-empty ranges [(start, end), ...] tiling 0 .. n
    so that the largest stage's total cost is as small as any such split can make it (a split check_partition
    accepts). Raises ValueError when num_stages < 1 or num_stages > n (a stage would be empty)."""
    raise NotImplementedError("stage07: balanced_partition — see lab6.ipynb §1")
