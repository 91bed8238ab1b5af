"""Stage 05 at the course's real model's attention shapes (SmolLM2-135M-Instruct, `make setup`).

    make bench STAGE=05_real [QUICK=1]     (IMPL=student measures your own tiled attention)

stage05.py's CPU measurement at the shapes of one SmolLM2 layer instead of one toy head: 9 query
heads sharing 3 KV heads (GQA 3:1) of head_dim 64, causal, float32, 256×256 tiles. The naive
version holds every query head's T × T scores (the KV heads repeated to 9 first); the tiled one
holds a tile per head and the running statistics. Bytes, not seconds: the GPU rows stay in
stage05.py, which times the Triton kernel where there is a GPU.
"""

from labkit import bench, plot
from labkit.checkpoint import read_config, require_real_model

from .stage05 import FLOOR_NOTE, cpu_memory


def main(quick: bool = False) -> bench.Result:
    c = read_config(require_real_model())
    H, H_kv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    lengths = [512, 1024] if quick else [512, 1024, 2048, 4096]
    rows = cpu_memory(lengths, head_dim=D, heads=H, kv_heads=H_kv, causal=True)
    shape = f"B=1, H={H}, H_kv={H_kv}, D={D}, causal, float32, tiles 256×256"
    print(bench.table(rows, f"CPU: peak memory of one SmolLM2 attention call ({shape})"))

    plt = plot.setup()
    fig, ax = plt.subplots()
    Ts = [r["T"] for r in rows]
    ax.loglog(Ts, [r["naive MiB"] for r in rows], "o-", label=f"naive ({H} heads' T×T scores)")
    ax.loglog(Ts, [r["tiled MiB"] for r in rows], "o-", label="tiled (256×256 tiles)")
    for r in rows:
        ax.annotate(f"{r['naive/tiled']:.0f}×", (r["T"], r["naive MiB"]), textcoords="offset points", xytext=(-8, 6))
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak MiB of tensors created")
    ax.set_title(f"SmolLM2 attention memory on the CPU ({H} q heads, {H_kv} KV heads, D={D})")
    ax.legend()
    return bench.Result(
        rows,
        {"model": require_real_model().name, "heads": H, "kv_heads": H_kv, "head_dim": D, "floor": FLOOR_NOTE},
        fig,
    )
