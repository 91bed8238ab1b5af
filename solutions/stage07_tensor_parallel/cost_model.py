"""How much tensor parallelism communicates, and an alpha-beta model of a decode step's time.

Counting: every collective in a TP forward pass carries activations, never weights; lab.ipynb §6
counts them from the layer placement of §5.

Timing a decode step (batch sequences, one new token each) on one of `tp` identical devices:

    compute = FLOPs / flops            memory = bytes read from HBM / hbm_bandwidth
    comm    = Σ over collectives of the alpha-beta cost (alpha = link_latency, beta = link_bandwidth)
    total   = max(compute, memory) + comm     (the collectives sit on the critical path)

lab.ipynb §7 derives each term, the ring collectives' costs included, from what moves where.
"""

from __future__ import annotations  # signatures name StepTime, not the module it came from

from dataclasses import dataclass

from labkit.model import Config

from .tp_model import local_head_counts

# Nominal per-direction link bandwidths with an assumed per-step latency: planning numbers, not
# measurements. The model and GPU figures they go with are labkit.specs' LLAMA3_70B and H100.
NVLINK = dict(link_bandwidth=450e9, link_latency=1e-6)  # NVLink 4: 900 GB/s both directions
PCIE = dict(link_bandwidth=64e9, link_latency=4e-6)  # PCIe 5.0 x16


@dataclass
class StepTime:
    """Seconds of one decode step on one rank, split by what limits it."""

    compute: float
    memory: float
    comm: float

    @property
    def total(self) -> float:
        return max(self.compute, self.memory) + self.comm


def comm_bytes_per_token(config: Config, world_size: int, dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank contributes to collectives per token in a full forward pass.

    returns {"all_reduce": bytes summed over every all-reduce of the pass (embedding and layers),
             "all_gather": bytes this rank adds to the all-gather of the logits}, for elements of
    dtype_bytes each; both 0 when world_size == 1, where no collective runs. lab.ipynb §6 derives
    the counts from the layer placement.
    """
    if world_size == 1:
        return {"all_reduce": 0, "all_gather": 0}
    return {
        "all_reduce": (2 * config.num_hidden_layers + 1) * config.hidden_size * dtype_bytes,
        "all_gather": config.vocab_size // world_size * dtype_bytes,
    }


def weights_per_rank(config: Config, tp: int) -> int:
    """Weight elements one rank streams from memory per decode step: its slice of every linear
    layer and of the LM head (the embedding lookup reads only a few rows; norms are negligible).
    KV projections count this rank's (possibly replicated) KV heads."""
    heads, kv_heads = local_head_counts(config, tp)
    attn = config.hidden_size * config.head_dim * 2 * (heads + kv_heads)  # q, o and k, v
    mlp = 3 * config.hidden_size * config.intermediate_size // tp
    return config.num_hidden_layers * (attn + mlp) + config.vocab_size * config.hidden_size // tp


def tp_step_time(
    config: Config,
    tp: int,
    batch: int,
    link_bandwidth: float,
    link_latency: float,
    flops: float,
    hbm_bandwidth: float,
    context: int = 0,
    dtype_bytes: int = 2,
) -> StepTime:
    """Alpha-beta/roofline estimate of one decode step at tensor-parallel size tp (lab.ipynb §7 derives it).

    Per rank, with W = weights_per_rank(config, tp) and (h, kv) = local_head_counts(config, tp):
      compute  the step's FLOPs / flops: every one of the `batch` new tokens multiplies through W
               weights, and in every layer attends with h query heads over `context` cached
               positions (scores, then the weighted sum of values); a multiply-add is 2 FLOPs
      memory   the bytes streamed from HBM / hbm_bandwidth: the W weights once, and the K and V of
               this rank's kv heads for every cached position of every sequence in every layer
      comm     the ring all-reduces and the ring all-gather of one forward pass (§6's counts,
               `batch` tokens wide), each step of a ring costing link_latency + bytes / link_bandwidth;
               0 at tp == 1
    Every element is dtype_bytes wide; link_bandwidth in bytes/s, link_latency in s, flops in
    FLOP/s, hbm_bandwidth in bytes/s.
    """
    heads, kv_heads = local_head_counts(config, tp)
    W, L, d = weights_per_rank(config, tp), config.num_hidden_layers, config.head_dim
    compute = (2 * batch * W + 4 * batch * context * L * heads * d) / flops
    memory = (W + 2 * batch * context * L * kv_heads * d) * dtype_bytes / hbm_bandwidth
    comm = 0.0
    if tp > 1:
        m = batch * config.hidden_size * dtype_bytes
        all_reduce = 2 * (tp - 1) * link_latency + 2 * (tp - 1) / tp * m / link_bandwidth
        shard = batch * config.vocab_size // tp * dtype_bytes
        all_gather = (tp - 1) * link_latency + (tp - 1) * shard / link_bandwidth
        comm = (2 * L + 1) * all_reduce + all_gather
    return StepTime(compute=compute, memory=memory, comm=comm)
