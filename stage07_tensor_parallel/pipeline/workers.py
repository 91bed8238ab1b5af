"""What the handout and the benchmark run on every rank of a pipeline (labkit.distributed.launch starts
module-level functions only, so a notebook's own functions cannot be launched).

    from labkit.distributed import launch
    per_rank = launch(workers.pipeline_run, 2, folder, bounds, prompt, 8, [[p] * m for m in (1, 2, 4, 8)])
"""

import torch
import torch.distributed as dist

from labkit.model import from_pretrained

from . import generate, schedule, stage


def load_stage(folder: str, bounds: list[tuple[int, int]]) -> stage.PipelineStage:
    """This rank's stage of the model in `folder`: bounds[rank] of its units (partition.py)."""
    # from_pretrained builds a random Llama first and overwrites every weight: skip that init (seconds at 135 M)
    torch.nn.Linear.reset_parameters = torch.nn.Embedding.reset_parameters = lambda self: None
    return stage.PipelineStage(from_pretrained(folder), bounds, dist.get_rank())


def pipeline_run(folder, bounds, prompt: list[int], new_tokens: int, runs: list[list[list[int]]], repeats: int = 1):
    """Greedy decoding of `prompt`, then each run of micro-batches (a list of prompts) `repeats` times.
    Returns {"tokens": the new tokens (first and last stage), "runs": [[{busy_s, wall_s}, ...] per repeat] per run,
    "params": this stage's parameter count}."""
    s = load_stage(folder, bounds)
    out = {"tokens": generate.pipeline_generate(s, prompt, new_tokens, timeout_s=120)} if new_tokens else {}
    out["runs"] = []
    for prompts in runs:
        timed = [schedule.run_microbatches(s, prompts, timeout_s=120) for _ in range(repeats + 1)][1:]  # one warm-up
        out["runs"].append([{"busy_s": t["busy_s"], "wall_s": t["wall_s"]} for t in timed])
    out["params"] = sum(p.numel() for p in s.parameters())
    return out
