"""MoEfication (Zhang et al., 2022): a dense model's MLPs cut into experts, with a router that picks
which experts a token needs (lab8.ipynb §4).

A SwiGLU MLP is a sum over its I intermediate neurons: down[:, i] · silu(gate_i x) · up_i x. Any
partition of the neurons into E groups turns it into E experts whose outputs add up to the MLP's,
so with every expert chosen (k = E, weights 1) the MoEfied model is the dense one. With k < E the
router must guess which groups matter for this token: neurons that fire together should share an
expert (clustering), and the router is fitted to predict each expert's contribution.

    moefy(model, num_experts=8, calibration=ids)    # every layer's MLP replaced, in place
    set_k(model, 2)                                 # 2 of 8 experts a token from now on
"""

import torch
from torch import nn

from labkit import eagle_data
from labkit.calibration import record_inputs

from .expert_parallel import capacity_keep
from .experts import grouped_experts


def balanced_clusters(w: torch.Tensor, num_experts: int, iters: int = 10, seed: int = 0) -> torch.Tensor:
    """Balanced k-means over the rows of w: neurons with similar input weights share an expert.

    w:        (I, D) float32, one row per intermediate neuron (the MLP's gate_proj weight)
    returns   labels (I,) int64 in [0, num_experts), each expert exactly I / num_experts neurons
              (I must divide), so the experts stack into (E, ...) tensors. Rows are L2-normalised
              first (a neuron's direction, not its scale, says which inputs fire it); centroids start
              at num_experts rows picked by `seed`. Each of `iters` rounds assigns every neuron under
              the size limit (each unassigned neuron proposes to its nearest centroid with room left,
              which accepts its closest proposers up to its room, until all are placed), then moves
              each centroid to its neurons' mean. On well-separated equal-size groups it
              recovers the groups.
    """
    I = w.shape[0]
    if I % num_experts:
        raise ValueError(f"{I} neurons do not split into {num_experts} equal experts")
    size = I // num_experts
    v = torch.nn.functional.normalize(w.float(), dim=1)
    g = torch.Generator().manual_seed(seed)
    centroids = v[torch.randperm(I, generator=g)[:num_experts]]
    for _ in range(iters):
        dist = torch.cdist(v, centroids)  # (I, E)
        labels = torch.full((I,), -1)
        room = torch.full((num_experts,), size)
        while (labels < 0).any():
            free = (labels < 0).nonzero().squeeze(1)
            choice = dist[free].masked_fill(room == 0, float("inf")).argmin(1)  # nearest centroid with room
            for e in choice.unique().tolist():
                proposers = free[choice == e]
                accepted = proposers[dist[proposers, e].argsort()[: int(room[e])]]
                labels[accepted], room[e] = e, room[e] - len(accepted)
        centroids = torch.stack([v[labels == e].mean(0) for e in range(num_experts)])
    return labels


def fit_router(x: torch.Tensor, target: torch.Tensor, ridge: float = 1e-2) -> torch.Tensor:
    """Least-squares router: the linear map from a token to its experts' contributions.

    x:       (N, D) float32 calibration inputs of the MLP
    target:  (N, E) float32 what each expert contributed to each token (the norm of its output)
    returns  (E, D) float32 router weight W minimising ||x Wᵀ - target||² + ridge · N · ||W||²,
             the closed-form ridge solution (solved in float64), so router scores x Wᵀ rank experts
             by predicted contribution.
    """
    x64, t64 = x.double(), target.double()
    gram = x64.T @ x64 + ridge * len(x) * torch.eye(x.shape[1], dtype=torch.float64)
    return torch.linalg.solve(gram, x64.T @ t64).T.float()


class MoEfiedMLP(nn.Module):
    """A dense SwiGLU MLP's neurons as E experts (gate_up (E, 2I/E, D), down (E, D, I/E)) behind a router.
    The k chosen experts are summed with weight 1: the router only selects. `load` counts each expert's
    tokens (since the last reset) and `last_idx` keeps the latest choices."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int):
        super().__init__()
        self.router, self.gate_up, self.down = nn.Parameter(router), nn.Parameter(gate_up), nn.Parameter(down)
        self.k = k
        self.register_buffer("load", torch.zeros(router.shape[0], dtype=torch.long), persistent=False)
        self.last_idx = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx = (x @ self.router.T).topk(self.k, dim=-1).indices
        self.load += torch.bincount(idx.flatten(), minlength=self.router.shape[0])
        self.last_idx = idx
        return grouped_experts(x, idx, torch.ones(idx.shape, dtype=x.dtype), self.gate_up, self.down).view(shape)


def expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Every expert's output norm on every token: x (N, D) -> (N, E), the router's regression target."""
    gate, up = torch.einsum("nd,efd->enf", x, gate_up).chunk(2, dim=-1)
    return torch.einsum("eni,edi->end", torch.nn.functional.silu(gate) * up, down).norm(dim=-1).T


@torch.no_grad()
def moefy(model, num_experts: int, calibration: torch.Tensor, k: int | None = None, seed: int = 0):
    """Replace every layer's MLP of a labkit Llama with a MoEfiedMLP of num_experts experts, in place.

    calibration: (B, T) int64 token ids whose MLP inputs the routers are fitted on. Returns the model."""
    layers = model.model.layers
    with record_inputs({str(i): layer.mlp for i, layer in enumerate(layers)}) as seen:
        model(calibration)
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        if mlp.gate_proj.bias is not None:
            raise ValueError("moefy takes bias-free SwiGLU MLPs (mlp_bias=False)")
        labels = balanced_clusters(mlp.gate_proj.weight, num_experts, seed=seed)
        perm = torch.argsort(labels, stable=True).view(num_experts, -1)  # (E, I/E) neurons of each expert
        gate_up = torch.cat([mlp.gate_proj.weight[perm], mlp.up_proj.weight[perm]], dim=1)  # (E, 2I/E, D)
        down = mlp.down_proj.weight[:, perm].permute(1, 0, 2).contiguous()  # (E, D, I/E)
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen[str(i)]])
        router = fit_router(x, expert_outputs(x, gate_up, down))
        layer.mlp = MoEfiedMLP(router, gate_up, down, k or num_experts)
    return model


def set_k(model, k: int) -> None:
    """Choose k experts a token in every MoEfied layer, and reset the load counters."""
    for layer in model.model.layers:
        layer.mlp.k = k
        layer.mlp.load.zero_()


def chat_ids(tokenizer, n_prompts: int, heldout: bool = False) -> torch.Tensor:
    """The course's chat prompts (labkit.eagle_data: training subjects, or held-out ones no training prompt
    names) as one (1, L) int64 stream: the routers' calibration set, and the traffic whose load is measured."""
    ids = [i for p in eagle_data.prompts(n_prompts, heldout=heldout) for i in tokenizer.encode(p).ids]
    return torch.tensor([ids])


def drop_rate(topk_idx: torch.Tensor, num_experts: int, capacity: int) -> float:
    """Fraction of (token, expert) pairs that capacity_keep would drop at this capacity."""
    return float((~capacity_keep(topk_idx, num_experts, capacity)).float().mean())
