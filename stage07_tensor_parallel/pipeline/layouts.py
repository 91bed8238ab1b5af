"""Planning a model too big for one node: tensor parallel, pipeline parallel, or both (lab6.ipynb §6).

Part 1's cost model priced a decode step at tensor-parallel size tp. Here a layout is tp x pp GPUs: the
layers split into pp stages, each stage's weights split over tp GPUs. A decode step of `batch` sequences runs
as `microbatches` micro-batches through the stages (fill, steady, drain), so it pays the bubble; tensor
parallelism pays two all-reduces per layer; pipeline parallelism one send per stage boundary.
The figures are planning numbers (labkit.specs: Llama-3-70B, an H100), not measurements.
"""

from dataclasses import dataclass

from labkit.model import Config, num_params  # noqa: F401 (the TODOs use it)

# Nominal per-direction bandwidths with an assumed per-message latency: planning numbers, not measurements.
NVLINK = dict(link_bandwidth=450e9, link_latency=1e-6)  # NVLink 4 inside a node: 900 GB/s both directions
INFINIBAND = dict(link_bandwidth=50e9, link_latency=5e-6)  # one 400 Gb/s NDR port per GPU between nodes


@dataclass
class LayoutCost:
    """One decode step of a batch on a tp x pp layout."""

    step_s: float  # a decode step of every sequence: each sequence's time per token
    throughput: float  # tokens per second over the batch
    memory_bytes: float  # what one GPU holds: its weights and its KV cache
    bubble: float  # the idle fraction of the step's schedule


def layout_cost(
    config: Config,
    tp: int,
    pp: int,
    batch: int,
    microbatches: int,
    context: int,
    flops: float,
    hbm_bandwidth: float,
    tp_link: dict,
    pp_link: dict,
    dtype_bytes: int = 2,
) -> LayoutCost:
    """A decode step of `batch` sequences (each `context` tokens cached) on tp x pp identical GPUs.

    Per GPU, for one micro-batch of b = batch / microbatches sequences through one stage (L / pp layers):
      compute  FLOPs / flops: each of the b tokens multiplies through the GPU's share of the weights
               (num_params(config) / (tp * pp), the embedding and LM head spread with the rest) and, in each
               of the stage's layers, attends with num_attention_heads / tp heads over `context` positions
               (scores and weighted sum); a multiply-add is 2 FLOPs
      memory   bytes / hbm_bandwidth: the GPU's share of the weights, read once per micro-batch, and its KV
               (num_key_value_heads / tp heads, at least 1) of the b sequences in the stage's layers
      TP comm  two ring all-reduces per layer of b * hidden_size elements: 2 (tp - 1) steps of
               link_latency + (bytes / tp) / link_bandwidth each, on tp_link; 0 at tp == 1
      PP comm  one send of b * hidden_size elements to the next stage: link_latency + bytes / link_bandwidth
               on pp_link; 0 at pp == 1
    A slot is max(compute, memory) + TP comm + PP comm; the step is a fill/drain pass of microbatches + pp - 1
    slots. memory_bytes: every weight and the KV of the whole batch, each spread over the tp * pp GPUs (the KV
    heads replicated when tp exceeds them). Raises ValueError when microbatches does not divide batch or pp
    exceeds the layers.
    """
    raise NotImplementedError("stage07: layout_cost — see lab6.ipynb §6")
