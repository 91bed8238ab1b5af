"""Greedy decoding through a pipeline of processes: stage s on rank s, activations sent stage to stage.

One token's journey: the first stage embeds it and runs its layers, sends the hidden state (1, T, hidden) to
rank 1, which runs its layers and sends on, ... the last stage computes the logits, picks the token and sends
it back to rank 0, which embeds it for the next step. Every stage keeps the KV cache of its own layers. Every
transfer waits at most timeout_s (labkit.distributed.wait), so a stage that dies is an error, not a hang.
lab6.ipynb §3.
"""

import torch

from labkit import distributed  # noqa: F401 (the TODOs use it)

from .stage import PipelineStage


@torch.no_grad()
def pipeline_generate(
    stage: PipelineStage, prompt: list[int], max_new_tokens: int, timeout_s: float = 30.0
) -> list[int]:
    """Greedy decoding of max_new_tokens tokens after `prompt` with this rank's `stage` (rank == stage.index in a
    process group of stage.num_stages ranks; every rank gets the same prompt and calls this).

    Step 0 runs the whole prompt (T = len(prompt)), each later step the one token chosen last (T = 1), at the
    next position, through every stage in rank order with each stage's own KV cache (stage.new_cache): rank s
    receives (1, T, hidden) float32 from rank s - 1 (stage.hidden_shape) and sends its output to rank s + 1;
    the last stage picks the argmax of the last position's logits and sends it to rank 0 as a (1,) int64
    tensor. Every send and receive goes through labkit.distributed (isend, recv, wait) with timeout_s, so a
    peer that dies or stalls raises PeerLost. Returns the new tokens on the first and the last stage (the ones
    that see them; one process holds both when there is one stage) and [] on the others. Greedy tokens equal
    the unsplit model's generate(prompt, max_new_tokens, stop_at_eos=False).
    """
    raise NotImplementedError("stage07: pipeline_generate — see lab6.ipynb §3")
