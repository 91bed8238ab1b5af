"""Stage 07 part 2 benchmark: what routing changes in a fleet of 4 replica processes on this machine.

    make bench STAGE=07b_fleet          (LABS_IMPL=solution; IMPL=student runs your own policies)

Everything here is counted, not timed: the prefill tokens the replicas computed (their own counters)
and the requests each replica served, per policy, on three workloads sent through the router by 8
concurrent clients:

    shared prefix  4 system prompts of 256 tokens, each request one of them + a 32-token question
    skewed         the same, but 80 % of the requests share one system prompt (a hot prefix)
    zero reuse     every prompt is 288 fresh random tokens: no cache can help, and cache-aware shows it

Two cores cannot show a fleet's speed-up (four replicas share them), so no throughput is claimed;
F3's simulator (lab4) replays measured step costs for that. Each policy runs on the same fleet with
fresh prompts of the same shapes (the replicas' caches keep earlier runs' prompts, which later runs never
match), and a fresh policy object.
"""

import concurrent.futures
import random
import time

import httpx

from labkit import bench, checkpoint, plot
from labkit.bench import floors
from labkit.impl import load
from labkit.model import Config

# (label, policy, options); sgl-router's default balance_abs_threshold (64) never trips with 8 clients, so
# cache-aware also runs with a threshold scaled to this fleet
POLICIES = [
    ("round_robin", "round_robin", {}),
    ("least_outstanding", "least_outstanding", {}),
    ("power_of_two", "power_of_two", {}),
    ("session_affinity", "session_affinity", {}),
    ("cache_aware", "cache_aware", {}),
    ("cache_aware_abs4", "cache_aware", {"balance_abs_threshold": 4}),
    ("kv_aware", "kv_aware", {}),
]
REPLICAS, PAGE, SYSTEM, QUESTION, NEW = 4, 16, 256, 32, 4


def workload(kind: str, n: int, vocab: int, rng: random.Random) -> list[tuple[str, list[int]]]:
    """(session id, prompt) pairs. A session is a (system prompt, client) pair, so session affinity
    can keep a system prompt's requests together only as far as sessions do."""
    if kind == "zero_reuse":
        return [(f"s{i}", [rng.randrange(3, vocab) for _ in range(SYSTEM + QUESTION)]) for i in range(n)]
    systems = [[rng.randrange(3, vocab) for _ in range(SYSTEM)] for _ in range(4)]
    out = []
    for i in range(n):
        k = (0 if rng.random() < 0.8 else rng.randrange(1, 4)) if kind == "skewed" else rng.randrange(4)
        out.append((f"s{k}-{i % 8}", systems[k] + [rng.randrange(3, vocab) for _ in range(QUESTION)]))
    return out


def run(fleet, router_mod, policy: str, options: dict, requests) -> dict:
    """Send `requests` through the router with 8 clients at once; counters before and after."""
    state = fleet.router
    state.policy = router_mod.make_policy(policy, state.index, state.page_size, **options)
    before = fleet.wait_idle()
    served0 = [w.served for w in state.workers.values()]

    def send(item):
        session, prompt = item
        body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "user": session}
        r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(send, requests))
    seconds = time.perf_counter() - start
    after = fleet.wait_idle()
    computed = [a["prefill_tokens_computed"] - b["prefill_tokens_computed"] for a, b in zip(after, before, strict=True)]
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before, strict=True))
    served = [w.served - s for w, s in zip(state.workers.values(), served0, strict=True)]
    return dict(
        prefill_tokens=sum(computed), prompt_tokens=prompt, hit_rate=round(1 - sum(computed) / prompt, 3),
        requests_per_replica=served, prefill_per_replica=computed, seconds=round(seconds, 2),
    )  # fmt: skip


def main(quick: bool = False) -> bench.Result:
    fleet_mod, router_mod = load("stage07_tensor_parallel.fleet.launch"), load("stage07_tensor_parallel.fleet.router")
    folder = checkpoint.model_folder()
    vocab = checkpoint.load_tokenizer(folder).get_vocab_size()
    n = 32 if quick else 96
    rows = []
    settings = dict(num_slots=8192, page_size=PAGE, max_num_batched_tokens=512)
    with fleet_mod.Fleet(folder, replicas=REPLICAS, policy="round_robin", **settings) as fleet:
        for kind in ("shared_prefix", "skewed", "zero_reuse"):
            for i, (label, policy, options) in enumerate(POLICIES):
                rng = random.Random(f"{kind}-{i}")  # same shapes, fresh prompts per run
                requests = workload(kind, n, vocab, rng)
                row = dict(workload=kind, policy=label, **run(fleet, router_mod, policy, options, requests))
                print(row, flush=True)
                rows.append(row)
    rr = {r["workload"]: r["prefill_tokens"] for r in rows if r["policy"] == "round_robin"}
    config = Config.from_hf(checkpoint.read_config(folder))
    for r in rows:
        r["prefill_vs_round_robin"] = round(r["prefill_tokens"] / rr[r["workload"]], 3)
        # floor of the wall time (not a claim, see the note): the model work the fleet did, every computed
        # prompt token and every answer token through the matrices (attention to one key each, a lower bound),
        # at this process's GEMM rate (both cores)
        # (the LM head only where a token is sampled)
        flops = r["prefill_tokens"] * floors.forward_flops(config, 1, logits=0) + n * NEW * floors.forward_flops(
            config, 1
        )
        r.update(floors.row(r["seconds"], flops=flops))
    figures = dict(
        model=folder.name, replicas=REPLICAS, requests_per_workload=n, page_size=PAGE, clients=8,
        system_prompt_tokens=SYSTEM, question_tokens=QUESTION, max_tokens=NEW,
        note="counted, not timed: prefill tokens from the replicas' own counters; 2 cores cannot show fleet "
        "speed-ups (seconds are wall time of 4 replicas sharing 2 cores, not a throughput claim)",
    )  # fmt: skip
    return bench.Result(rows, figures, plot_rows(rows))


def plot_rows(rows):
    plt = plot.setup()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    kinds = ["shared_prefix", "skewed", "zero_reuse"]
    width = 0.8 / len(POLICIES)
    for j, (policy, _, _) in enumerate(POLICIES):
        ys = [
            next(r["prefill_vs_round_robin"] for r in rows if r["workload"] == k and r["policy"] == policy)
            for k in kinds
        ]
        ax1.bar([i + j * width for i in range(len(kinds))], ys, width, label=policy)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))], kinds)
    ax1.set_ylabel("prefill tokens computed / round-robin's")
    ax1.set_title(f"prefill computed by {REPLICAS} replicas (counted)")
    skew = [r for r in rows if r["workload"] == "skewed"]
    for j, r in enumerate(skew):
        ax2.bar([i + j * width for i in range(REPLICAS)], r["requests_per_replica"], width, label=r["policy"])
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(REPLICAS)], [f"replica {i}" for i in range(REPLICAS)])
    ax2.set_ylabel("requests served")
    ax2.set_title("balance on the skewed workload (80 % one prefix)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
