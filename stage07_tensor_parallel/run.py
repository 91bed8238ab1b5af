"""Generate text from the tiny target with tensor parallelism (given, no TODO).

    torchrun --nproc-per-node 2 -m stage07_tensor_parallel.run --prompt "Once upon a time"
    python -m stage07_tensor_parallel.run            # a world of one, no process group

torchrun starts one process per rank; each loads the checkpoint, keeps its shard and runs the
same greedy loop. Logits are gathered whole on every rank, so all ranks choose the same token
and stay in step without any extra broadcast. gloo on the CPU, NCCL when each rank has a GPU.
"""

import argparse
import time

import torch
import torch.distributed as dist

import labkit
from labkit import distributed
from labkit.checkpoint import load_tokenizer
from labkit.model import from_pretrained

from . import collectives
from .tp_model import TPLlama, shard_state_dict


@torch.no_grad()
def generate(
    model_path: str = str(labkit.TARGET), prompt: str = "Once upon a time", max_new_tokens: int = 40, check: bool = True
) -> dict:
    """Run on every rank of a group (or alone): greedy-decode `prompt` with this rank's shard.

    Returns the text, the new token ids, the median seconds per decoded token, the collectives
    one decode step made, and (check=True) whether the unsharded model produces the same tokens.
    """
    on_gpu = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    rank, world = collectives.rank(), collectives.world_size()
    full = from_pretrained(model_path)  # every rank reads the whole file; a big model would read only its slices
    model = TPLlama(full.config)
    model.load_state_dict(shard_state_dict(full.state_dict(), rank, world, full.config))
    model.to(device)
    tokenizer = load_tokenizer(model_path)
    ids = [full.config.bos_token_id, *tokenizer.encode(prompt).ids]

    cache = model.new_cache(1, len(ids) + max_new_tokens)
    logits = model(torch.tensor([ids], device=device), cache)
    out, step_times, step_stats = [], [], None
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token == full.config.eos_token_id:
            break
        collectives.STATS.reset()
        t0 = time.perf_counter()
        logits = model(torch.tensor([[token]], device=device), cache)
        step_times.append(time.perf_counter() - t0)
        step_stats = step_stats or dict(vars(collectives.STATS))
    result = {
        "rank": rank,
        "world_size": world,
        "text": tokenizer.decode(out),
        "tokens": out,
        "seconds_per_token": sorted(step_times)[len(step_times) // 2] if step_times else float("nan"),
        "comm_per_step": step_stats or dict(vars(collectives.STATS)),
        "params_per_rank": sum(p.numel() for p in model.parameters()),
        "params_full": full.num_params(),
    }
    if check:
        result["matches_unsharded"] = full.generate(ids, max_new_tokens) == out
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Tensor-parallel greedy generation (run through torchrun).")
    ap.add_argument("--model", default=str(labkit.TARGET), help="a Llama-family HF folder")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    distributed.init_from_env()
    r = generate(args.model, args.prompt, args.max_new_tokens)
    if r["rank"] == 0:
        s = r["comm_per_step"]
        print(f"TP={r['world_size']} ({distributed.backend() if r['world_size'] > 1 else 'single process'})")
        print(f"{args.prompt}{r['text']}")
        print(
            f"{r['seconds_per_token'] * 1e3:.2f} ms/token; per decode step {s['all_reduce_calls']} all-reduces "
            f"({s['all_reduce_bytes']} B) and {s['all_gather_calls']} all-gather ({s['all_gather_bytes']} B) per rank; "
            f"rank 0 holds {r['params_per_rank']:,} of {r['params_full']:,} parameters; "
            f"same tokens as the unsharded model: {r['matches_unsharded']}"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
