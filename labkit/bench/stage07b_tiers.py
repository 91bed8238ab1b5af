"""Stage 07 part 2 benchmark (lab 5): moving KV. Two parts, both measured on this machine.

    make bench STAGE=07b_tiers            (LABS_IMPL=solution; IMPL=student runs your connector and tiers)

(a) P/D transfer: two gloo ranks on loopback run kv_connector.prefill_decode; per prompt length, the
    bytes sent (checked against prompt tokens x kv_bytes_per_token) and the median time to save and
    send (rank 0) and to receive and load (rank 1), each measured after a barrier.
(b) The tiered cache, LMCache's two cases in one sweep: sessions each re-ask questions about their own
    document, served one request at a time; the working set is sessions x document tokens. Across pool
    sizes (ReplicaEngine num_slots) three engines serve the same requests: no tiers, a RAM tier large
    enough for everything, and a disk-only tier (ram_bytes=0). Where the pool holds the working set the
    tiers never run (overhead only); where it does not, evicted pages come back from the tiers instead
    of being computed again. Figures: hit rate (prompt tokens served from the pool or the tiers) and
    median TTFT (add_request to the first token). Every engine must emit the same greedy tokens.
"""

import statistics
import tempfile
import time

import torch

from labkit import bench, plot
from labkit.bench import floors
from labkit.checkpoint import model_folder
from labkit.device import pin_threads
from labkit.distributed import launch
from labkit.impl import current
from labkit.quality import heldout


def transfer(folder, config, lengths: list[int], repeats: int, kv) -> list[dict]:
    tokens = heldout(bench.tokenizer(), n_tokens=8192, seq=1024).flatten().tolist()
    prompts = [tokens[r * 7 + n : r * 7 + 2 * n] for n in lengths for r in range(repeats)]  # distinct per repeat
    sent, received = launch(kv.prefill_decode, 2, folder, prompts, 4, timeout=300)
    per_token = kv.kv_bytes_per_token(config, torch.float32)
    rows = []
    for i, n in enumerate(lengths):
        s, r = sent[i * repeats : (i + 1) * repeats], received[i * repeats : (i + 1) * repeats]
        if any(x["error"] for x in r) or any(x["bytes"] != n * per_token for x in s):
            raise AssertionError(f"{n}-token prompts: a transfer failed or moved the wrong bytes: {s} {r}")
        rows.append({
            "part": "transfer", "prompt_tokens": n, "bytes": s[0]["bytes"],
            "send_ms": statistics.median(x["seconds"] for x in s) * 1e3,
            "recv_load_ms": statistics.median(x["seconds"] for x in r) * 1e3,
            "decode_prompt_tokens_computed": r[0]["computed"],
            # floor: the KV bytes read once and written once at the streaming rate (loopback moves them in memory)
            **floors.row(statistics.median(x["seconds"] for x in s), bytes=2 * s[0]["bytes"], name="send"),
            **floors.row(statistics.median(x["seconds"] for x in r), bytes=2 * s[0]["bytes"], name="recv_load"),
        })  # fmt: skip
    return rows


def serve(engine, eng, requests, answer):
    ttft, out = [], []
    for i, prompt in enumerate(requests):
        t0 = time.perf_counter()
        engine.add_request(eng.EngineRequest(f"r{i}", prompt, answer))
        tokens = []
        while engine.has_work():
            for o in engine.step():
                if not tokens:
                    ttft.append(time.perf_counter() - t0)
                tokens.append(o.token_id)
        out.append(tokens)
    return ttft, out


def tier_rows(eng, tiers, model, pools, requests, answer: int, working_set: int, shortest: int) -> list[dict]:
    """Per pool size and tier setup (none, RAM, disk): the requests served one at a time by a ReplicaEngine,
    its hit rate, tokens loaded from a tier, prompt tokens computed and median TTFT; every engine's greedy
    tokens must equal the first's."""
    rows = []
    reference = None
    for pool in pools:
        for variant in ("no tiers", "RAM tier", "disk tier"):
            warm = eng.ReplicaEngine(model, num_slots=pool, page_size=16, max_num_batched_tokens=512)
            serve(warm, eng, requests[:1], answer)  # first-call costs out of the TTFTs
            with tempfile.TemporaryDirectory() as folder:
                store = None
                if variant != "no tiers":
                    store = tiers.TieredKVStore(ram_bytes=2**30 if variant == "RAM tier" else 0, disk_dir=folder)
                engine = eng.ReplicaEngine(
                    model, num_slots=pool, page_size=16, kv_tiers=store, max_num_batched_tokens=512
                )
                ttft, out = serve(engine, eng, requests, answer)
            reference = reference or out
            if out != reference:
                raise AssertionError(f"pool {pool}, {variant}: greedy tokens differ from the first engine's")
            s = engine.stats
            # floor of a TTFT: what a request whose prompt is all cached still does, one step reading the
            # weights and its prompt's K/V (the median request's own prefill is not counted here, so the rows
            # that recompute their prompts sit far above it)
            ttft_floor = floors.row(statistics.median(ttft), bytes=floors.decode_bytes(model, shortest), name="ttft")
            rows.append({
                "part": "tiers", "pool_slots": pool, "working_set_tokens": working_set, "variant": variant,
                "hit_rate": s["cached_tokens"] / s["prompt_tokens"],
                "tier_loaded_tokens": s["tier_loaded_tokens"],
                "prefill_tokens_computed": s["prefill_tokens_computed"],
                "median_ttft_ms": statistics.median(ttft) * 1e3, **ttft_floor,
            })  # fmt: skip
    return rows


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)
    eng, kv, tiers = bench.stages("stage07_tensor_parallel.fleet", "replica_engine", "kv_connector", "kv_tiers")
    model, which = bench.model()
    lengths, transfer_repeats = ([64, 512], 3) if quick else ([64, 256, 512, 960], 7)
    sessions, document, question, rounds, answer = (4, 192, 16, 2, 4) if quick else (8, 256, 16, 3, 4)
    pools = [512, 4096] if quick else [512, 1024, 2048, 4096]
    rows = transfer(model_folder(), model.config, lengths, transfer_repeats, kv)

    tokens = heldout(bench.tokenizer(), n_tokens=8192, seq=512).flatten().tolist()
    docs = [tokens[s * document : (s + 1) * document] for s in range(sessions)]
    it = iter(tokens[sessions * document :])
    requests = [docs[s] + [next(it) for _ in range(question)] for _ in range(rounds) for s in range(sessions)]
    working_set, shortest = sessions * (document + question), min(map(len, requests))
    rows += tier_rows(eng, tiers, model, pools, requests, answer, working_set, shortest)
    title = (
        f"stage 07b: moving KV, {which}, impl={current()}; (a) P/D over gloo on loopback, median of {transfer_repeats}; "
        f"(b) {sessions} sessions x {rounds} rounds, {document}-token documents, {question}-token questions, one at a time"
    )
    print(bench.table([r for r in rows if r["part"] == "transfer"], title=title))
    print(bench.table([r for r in rows if r["part"] == "tiers"]))
    t = {(r["pool_slots"], r["variant"]): r for r in rows if r["part"] == "tiers"}
    small, big = pools[0], pools[-1]
    figures = {
        "model": which, "page_size": 16, "sessions": sessions, "document_tokens": document, "rounds": rounds,
        "working_set_tokens": working_set, "pools": pools,
        "ttft_ram_over_none_small_pool": t[(small, "RAM tier")]["median_ttft_ms"] / t[(small, "no tiers")]["median_ttft_ms"],
        "ttft_disk_over_none_small_pool": t[(small, "disk tier")]["median_ttft_ms"] / t[(small, "no tiers")]["median_ttft_ms"],
        "ttft_ram_over_none_big_pool": t[(big, "RAM tier")]["median_ttft_ms"] / t[(big, "no tiers")]["median_ttft_ms"],
    }  # fmt: skip
    bench.show_figures(figures, [k for k in figures if k.startswith("ttft")])
    return bench.Result(rows, figures, plot_tiers(rows, pools))


def plot_tiers(rows: list[dict], pools: list[int]):
    plt = plot.setup()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    tr = [r for r in rows if r["part"] == "transfer"]
    axes[0].plot([r["prompt_tokens"] for r in tr], [r["send_ms"] for r in tr], "o-", label="save + send (rank 0)")
    axes[0].plot(
        [r["prompt_tokens"] for r in tr], [r["recv_load_ms"] for r in tr], "s-", label="receive + load (rank 1)"
    )
    axes[0].set(xlabel="prompt tokens", ylabel="ms per request", title="P/D transfer over gloo (measured)")
    axes[0].legend()
    for variant, marker in (("no tiers", "o"), ("RAM tier", "s"), ("disk tier", "^")):
        vs = [r for r in rows if r["part"] == "tiers" and r["variant"] == variant]
        axes[1].plot(pools, [r["hit_rate"] for r in vs], marker + "-", label=variant)
        axes[2].plot(pools, [r["median_ttft_ms"] for r in vs], marker + "-", label=variant)
    ws = next(r["working_set_tokens"] for r in rows if r["part"] == "tiers")
    for ax, label in ((axes[1], "hit rate"), (axes[2], "median TTFT (ms)")):
        ax.axvline(ws, color="gray", linestyle=":", label="working set")
        ax.set(xscale="log", xlabel="pool slots (tokens)", ylabel=label)
        ax.set_xticks(pools, [str(p) for p in pools], minor=False)
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    return fig
