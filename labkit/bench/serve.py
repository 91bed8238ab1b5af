"""`make serve` beside llama.cpp's own server, on SmolLM2-135M-Instruct, each at its default threads.

    make bench STAGE=serve [QUICK=1]     (builds llama-server once: make llama-server)

A. Serving: the course's server (stage 04's engine, its linear layers through labkit.cpu_kernels; float32,
   --quantization q8_0 and q4_0) and llama-server (native build, -np 8 -t 2 -fa on) at the same precisions (GGUF
   F32, Q8_0 and Q4_0, from the GGUF the course's model is converted from) each serve the same chats through the same
   OpenAI-compatible load generator (labkit.bench.loadtest: streamed /v1/completions, greedy, EOS ignored) at
   1, 4 and 8 concurrent chats. Each runs at its defaults: make serve's engine on every core, llama-server on
   THREADS (-t, its default: the physical cores); one more row is make serve --threads 1, the event loop and
   the clients then a core of their own. Every server runs in its own process and all stay up for the whole run; the
   variants take turns within each repeat so the shared machine's load falls on all alike; medians of repeats.
   Each row's floor: the weights' bytes (at the row's precision) over the measured bandwidth per decode step,
   shared by the chats in a step.
B. The engine's step, in process (no HTTP): where a step's time goes (forward, attention inside it, sampling,
   scheduling, detokenization, the rest) at 1 and 8 chats on THREADS threads, with each layer's modules and with
   fast_paged's fused layers, and the step against its floor; beside a served token's TPOT at the same threads,
   what the server adds.
"""

import asyncio
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from labkit import bench, plot
from labkit.bench import floors, loadtest
from labkit.checkpoint import load_tokenizer, require_real_model

from .llamacpp_worker import requantize
from .stage04_real import QUESTIONS, chat

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SERVER = ROOT / ".venv" / "llama-server" / "build" / "bin" / "llama-server"
THREADS = int(os.environ.get("SERVE_THREADS", "2"))  # llama-server's threads (the 2), the in-process step's
BYTES_PER_WEIGHT = {"none": 4.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # float32; per 32 weights, codes and a float16 scale


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{proc.args[0]} not ready in {timeout} s: {log.read_text()[-2000:]}")


def start_servers(tmp: Path, ggufs: dict[str, Path]) -> dict[str, tuple[str, subprocess.Popen, Path]]:
    """{name: (url, process, log)}: the course's server per quantization, llama-server per GGUF type."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each server at its own default
    folder = require_real_model()
    module = ("solutions." if os.environ.get("LABS_IMPL") == "solution" else "") + "stage04_batching.serve"
    serve = [sys.executable, "-m", module, "--model", str(folder)]
    cmds = {f"make serve ({q})": [*serve, "--quantization", q] for q in ("none", "q8_0", "q4_0")}
    cmds["make serve (none, --threads 1)"] = [*serve, "--threads", "1"]  # the event loop and clients get a core
    for mix, path in ggufs.items():
        cmds[f"llama-server {mix}"] = [str(LLAMA_SERVER), "-m", str(path), "-np", "8", "-t", str(THREADS),
                                       "-fa", "on", "-c", "8192", "--host", "127.0.0.1"]  # fmt: skip
    servers = {}
    for name, cmd in cmds.items():
        port, log = free_port(), tmp / f"{len(servers)}.log"
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        servers[name] = (f"http://127.0.0.1:{port}", proc, log)
        wait_ready(servers[name][0], proc, log)
    return servers


def workload(n: int, max_tokens: int) -> list[dict]:
    """n streamed greedy completions of the eight chats, in SmolLM2's chat template, EOS ignored."""
    return [{"prompt": chat(QUESTIONS[i % len(QUESTIONS)]), "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}} for i in range(n)]  # fmt: skip


def serving(ggufs: dict[str, Path], repeats: int, max_tokens: int) -> tuple[list[dict], dict]:
    """Part A: rows of every server at 1, 4 and 8 chats (medians over repeats), and llama-server's system info."""
    from labkit.model import num_params

    with tempfile.TemporaryDirectory() as tmp:
        servers = start_servers(Path(tmp), ggufs)
        try:
            runs: dict[tuple[str, int], list[dict]] = {}
            for _ in range(repeats):
                for conc in (1, 4, 8):
                    for name, (url, _, _) in servers.items():
                        body = workload(max(conc, 4), max_tokens)
                        try:
                            result = asyncio.run(loadtest.run(url, body, conc))
                        except httpx.HTTPError as e:  # a dropped connection fails the run, not the benchmark
                            result = {"failed": len(body), "error": f"{type(e).__name__}: {e}"}
                        runs.setdefault((name, conc), []).append(result)
            log = next((v[2].read_text() for k, v in servers.items() if k.startswith("llama-server")), "")
        finally:
            for _, proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    info = {"llama_server_system_info": re.findall(r"system[_ ]info:.*", log, re.IGNORECASE)[:1],
            "llama_server_build": re.findall(r"build: .*", log)[:1],
            "commands": {name: " ".join(Path(a).name if a.startswith("/") else a for a in proc.args)
                         for name, (_, proc, _) in servers.items()}}  # fmt: skip
    config = json.loads((require_real_model() / "config.json").read_text())
    from labkit.model import Config

    params = num_params(Config.from_hf(config))
    rows = []
    for (name, conc), runs_of_row in runs.items():
        results = [r for r in runs_of_row if "tokens_per_s" in r] or [{"tokens_per_s": float("nan")}]
        precision = next((q for q in ("q8_0", "q4_0") if q in name.lower()), "none")
        tps = statistics.median(r["tokens_per_s"] for r in results)
        # one decode step of `conc` chats reads the weights once: conc tokens per weight read at best
        floor = floors.row(conc / tps, bytes=params * BYTES_PER_WEIGHT[precision])
        rows.append({"server": name, "chats": conc, "tokens/s": round(tps, 1),
                     "TTFT p50 ms": round(statistics.median(r.get("ttft_p50_ms", float("nan")) for r in results), 1),
                     "TPOT p50 ms": round(statistics.median(r.get("tpot_p50_ms", float("nan")) for r in results), 1),
                     "failed": sum(r["failed"] for r in runs_of_row), "repeats": len(results),
                     "error": next((r["error"] for r in runs_of_row if r.get("error")), ""),  # why, if any failed
                     **{f"step {k}": v for k, v in floor.items()}})  # fmt: skip
    return rows, info


class Timers:
    """Seconds spent inside each wrapped callable, summed (a callable inside another is counted in both)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)


# in process: PyTorch alone, the kernels under each layer's modules, the kernels with the layers fused
VARIANTS = [
    ("torch", "none", True),
    ("cpp", "none", False),
    ("cpp", "none", True),
    ("cpp", "q8_0", False),
    ("cpp", "q8_0", True),
    ("cpp", "q4_0", True),
]


def step_breakdown(model, tok, chats: int, kernels: str, quantization: str, tokens: int, fused: bool = True) -> dict:
    """Part B: ms per decode step of `chats` chats in process, split by where it goes (medians are not
    possible per part: the parts are summed over the decode steps, then divided by their count). fused=False
    runs every layer's modules (the engine before fast_paged.FusedLayer) on the same kernels."""
    from labkit.impl import load

    eng_mod, seq_mod = load("stage04_batching.engine"), load("stage04_batching.sequence")
    engine = eng_mod.LLMEngine(model, tok, num_blocks=256, max_num_seqs=8, kernels=kernels, quantization=quantization)
    for layer in engine.model.model.layers if not fused else ():
        layer.fused = None
    params = seq_mod.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(chats):
        engine.add_request(chat(QUESTIONS[i % len(QUESTIONS)]), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
        engine.step()  # the prefills, untimed
    timers = Timers()
    saved, detokenize = {a: getattr(eng_mod, a) for a in ("paged_attention", "sample")}, seq_mod.Sequence.detokenize
    timers.wrap(eng_mod, "paged_attention", "attention")
    timers.wrap(eng_mod, "sample", "sampling")
    timers.wrap(seq_mod.Sequence, "detokenize", "detokenization")  # a method of each sequence (sequence.py)
    for attr, name in (("_forward", "forward"), ("_schedule", "scheduling")):
        timers.wrap(engine, attr, name)
    steps, t0 = 0, time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    finally:
        for attr, fn in saved.items():
            setattr(eng_mod, attr, fn)
        seq_mod.Sequence.detokenize = detokenize
    total = time.perf_counter() - t0
    ms = {k: round(v / steps * 1e3, 3) for k, v in timers.seconds.items()}
    outside = ms.get("scheduling", 0) + ms.get("sampling", 0) + ms.get("detokenization", 0)
    other = total / steps * 1e3 - ms.get("forward", 0) - outside
    step_ms = total / steps * 1e3
    layers = "fused" if any(getattr(lay, "fused", None) for lay in engine.model.model.layers) else "modules"
    row = {"chats": chats, "kernels": kernels, "quantization": quantization, "layers": layers, "step ms": round(step_ms, 2), **{f"{k} ms": v for k, v in ms.items()},
           "bookkeeping ms": round(other, 3), "outside forward %": round(100 * (step_ms - ms.get("forward", 0)) / step_ms, 1)}  # fmt: skip
    return {**row, **floors.row(step_ms / 1e3, bytes=floors.weight_bytes(model) * BYTES_PER_WEIGHT[quantization] / 4)}


def step_rows(model, tok, quick: bool) -> list[dict]:
    """Part B's rows: every VARIANT at 1 and 8 chats on THREADS threads (make serve's default on a machine of
    THREADS cores, so that a served token's TPOT splits into this step and what the server adds); per variant
    the repeat whose step time is the median (the lower middle of an even count), whole."""
    steps, repeats = [], 1 if quick else 2
    for _ in range(repeats):  # interleaved: each repeat runs every variant once
        for chats in (1, 8):
            for kernels, q, fused in VARIANTS:
                steps.append(step_breakdown(model, tok, chats, kernels, q, 16 if quick else 24, fused))
    key = lambda r: (r["chats"], r["kernels"], r["quantization"], r["layers"])  # noqa: E731
    return [sorted((r for r in steps if key(r) == k), key=lambda r: r["step ms"])[(repeats - 1) // 2]
            for k in sorted({key(r) for r in steps})]  # fmt: skip


def main(quick: bool = False) -> bench.Result:
    torch.set_num_threads(THREADS)
    from labkit.gguf_model import installed_gguf
    from labkit.model import from_pretrained

    model, tok = from_pretrained(require_real_model()), load_tokenizer(require_real_model())
    figures = {"threads": THREADS, "step_breakdown": step_rows(model, tok, quick),
               "load_average_before_A": list(os.getloadavg())}  # fmt: skip
    if not LLAMA_SERVER.is_file():
        print(f"llama-server rows left out: {LLAMA_SERVER} is not built (make llama-server)")
        ggufs, tmp = {}, None
    else:
        tmp = tempfile.TemporaryDirectory()
        src = installed_gguf()
        ggufs = {mix: requantize(src, Path(tmp.name) / f"{mix}.gguf", mix) for mix in ("F32", "Q8_0", "Q4_0")}
        import llama_cpp  # this llama-server prints no system info: the same llama.cpp's, built by make llamacpp

        figures["llama_print_system_info"] = llama_cpp.llama_print_system_info().decode()
        stamp = ROOT / ".venv" / ".llamacpp-build"  # make llamacpp's record: the sdist's version, vendored commit
        figures["llama_cpp_sdist"] = json.loads(stamp.read_text()) if stamp.is_file() else "unknown"
        figures["llama_cpp_build"] = {"cmake": "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF",
                                      "version": subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True,
                                                                text=True).stderr.strip().splitlines()[-2:]}  # fmt: skip
    del model
    rows, info = serving(ggufs, 1 if quick else 2, 16 if quick else 24)
    figures.update(info, load_average_after_A=list(os.getloadavg()))
    if tmp is not None:
        tmp.cleanup()
    return bench.Result(rows, figures, _plot(rows))


def _plot(rows: list[dict]):
    plt = plot.setup()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        ax.plot([r["chats"] for r in mine], [r["tokens/s"] for r in mine], marker="o", label=name)
    ax.set(xlabel="concurrent chats", ylabel="generated tokens/s (all chats)", title="SmolLM2-135M, 2 cores")
    ax.legend()
    return fig
