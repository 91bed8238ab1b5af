"""One llama.cpp configuration in a process of its own, driven by labkit/bench/decode.py over a pipe.

    python labkit/bench/llamacpp_worker.py '{"gguf": path, "threads": 1, "mmap": true, "contexts": [128, 512]}'

Run as a script, not imported through labkit: nothing of torch (its OpenMP runtime, its threads) is in this
process, so llama.cpp's thread pool has the cores to itself, as in a user's `python -c "from llama_cpp import
Llama ..."`. It loads the GGUF with flash attention on (llama.cpp's own default on CPU; llama-cpp-python's
is off), fills the KV cache with max(contexts) tokens once, prints one JSON line (the build, the system info,
the pages its weights sit on), then answers one JSON line per request read from stdin:

    {"op": "decode", "context": 512, "steps": 10, "settle": 3} -> {"s": [seconds of each timed step]}
    {"op": "prefill", "tokens": 512, "repeats": 1}             -> {"s": [...]}  (an empty cache each time)
    {"op": "logits", "tokens": [...], "out": "x.npy"}          -> {"out": path} (every position's logits)

A decode step at context c keeps the cache's first c positions (llama-cpp-python's eval drops the rest) and
evaluates one token at position c: every step does the same work, as the course's steps do.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file runs as a script, outside labkit)


def page_report(gguf: str) -> dict:
    """Where this process's weights can sit, and how much of each on 2 MB pages: the GGUF's mapping (mmap:
    the file's page-cache pages; FilePmdMapped counts 2 MB ones) and each anonymous mapping of 16 MB or more
    (use_mmap=False reads the weights into one; buffers llama.cpp repacks tensors into, the KV caches and
    compute buffers are others; AnonHugePages counts 2 MB ones), as [MB, MB on 2 MB pages]."""
    report, kind, size = {"file": [0.0, 0.0], "anon": []}, None, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            kind = "file" if head[1] == str(Path(gguf).resolve()) else ("anon" if head[1] in ("", "[heap]") else None)
            continue
        field = re.match(r"^(\w+):\s+(\d+) kB", line)
        if kind is None or not field:
            continue
        mb = round(int(field[2]) / 1024, 1)
        if field[1] == "Size":
            size = mb
            if kind == "file":
                report["file"][0] += mb
            elif size >= 16:
                report["anon"].append([mb, 0.0])
        elif field[1] == "FilePmdMapped" and kind == "file":
            report["file"][1] += mb
        elif field[1] == "AnonHugePages" and kind == "anon" and size >= 16:
            report["anon"][-1][1] = mb
    return {"GGUF mapped [MB, on 2 MB pages]": report["file"], "anonymous >= 16 MB [MB, on 2 MB pages]": report["anon"]}


def pages_at(tensor) -> dict:
    """The mapping of this process that holds `tensor`'s bytes: its MB, and how many sit on 2 MB pages."""
    ptr, hit, out = tensor.data_ptr(), False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            hit = int(head[1], 16) <= ptr < int(head[2], 16)
        elif hit:
            field = re.match(r"^(Size|AnonHugePages):\s+(\d+) kB", line)
            if field:
                out[{"Size": "mapping_MB", "AnonHugePages": "2MB_pages_MB"}[field[1]]] = round(int(field[2]) / 1024, 1)
    return out


def build_info() -> dict:
    """The installed llama.cpp build (make llamacpp's record), the CPU's SIMD flags, the huge-page mode."""
    stamp = ROOT / ".venv" / ".llamacpp-build"
    build = json.loads(stamp.read_text()) if stamp.is_file() else {"kind": "unknown: not installed by make llamacpp"}
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    simd = sorted(f for f in flags if re.match(r"(avx|fma|f16c|amx|sse|ssse|bmi|vnni|vpclmul|gfni)", f))
    thp = {n: Path(f"/sys/kernel/mm/transparent_hugepage/{n}").read_text().strip() for n in ("enabled", "defrag")}
    return {**build, "cpu_simd_flags": simd, "transparent_hugepage": thp}


def describe_gguf(path: Path) -> dict:
    """MB of the file's tensors by type, and the LM head's type (token_embd where the embedding is tied)."""
    import gguf

    types, head = {}, None
    for t in gguf.GGUFReader(path).tensors:
        name = t.tensor_type.name
        types[name] = types.get(name, 0) + int(t.n_bytes)
        if t.name == "output.weight" or (t.name == "token_embd.weight" and head is None):
            head = name
    return {"MB": round(sum(types.values()) / 1e6, 1), "MB by type": {k: round(v / 1e6, 1) for k, v in types.items()},
            "LM head": head}  # fmt: skip


def gguf_files(folder: Path, tmp: Path) -> dict[str, Path]:
    """{"F32" | "Q8_0" | "Q4_1" | "Q4_0" [| "Q4_1 as shipped, LM head Q8_0"]: GGUF file} of the benchmark's
    model; {} (with the reason) without llama.cpp. Q4_1 and Q4_0 quantize every matrix, the LM head too, as
    the course's int4 does (llama.cpp's default keeps it at Q8_0 here: 576 columns are no K-quant's)."""
    try:
        import llama_cpp  # noqa: F401  (before the exports, which take a while)
    except ImportError as e:
        print(f"llama.cpp rows left out ({e}); `make llamacpp` installs llama.cpp")
        return {}
    from labkit.checkpoint import real_model_folder

    if folder == real_model_folder():  # stage 03's exporter writes byte-level BPE vocabularies only
        from labkit.gguf_model import installed_gguf

        src = shipped = installed_gguf()
    else:
        from labkit.impl import load

        try:
            src = load("stage03_quantization.gguf_export").export_gguf(folder, tmp / "exported.gguf", "F32")
        except (NotImplementedError, ValueError) as e:  # a learner's unwritten exporter, or a model it refuses
            print(f"llama.cpp rows of stage 03's exporter left out ({type(e).__name__}: {e})")
            return {}
    files = {mix: requantize(src, tmp / f"{mix}.gguf", mix) for mix in ("F32", "Q8_0", "Q4_1", "Q4_0")}
    if src != files["F32"] and folder == real_model_folder():
        files["Q4_1 as shipped, LM head Q8_0"] = shipped
    return files


def requantize(src: Path, out: Path, mix: str) -> Path:
    """llama.cpp's own quantizer from src to `mix`, every matrix (pure: the LM head too); a copy where the
    types agree. Q4_1 -> F32 or Q8_0 loses nothing: each block's values are d * q + m."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if mix == "F32" else f"LLAMA_FTYPE_MOSTLY_{mix}")
    params.allow_requantize, params.pure = True, True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {mix}")
    return out


class Worker:
    """This script run as a process of its own with one config; its first line (the build, the pages) is .info."""

    def __init__(self, cfg: dict):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # numpy's BLAS: no threads
        if cfg.get("huge"):  # malloc madvises its mmap'd chunks MADV_HUGEPAGE: 2 MB pages under THP "madvise"
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self.info = self.read()
        self.weight_bytes = int(describe_gguf(Path(cfg["gguf"]))["MB"] * 1e6)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited ({self.proc.wait()}); its error is above")
        return json.loads(line)

    def ask(self, **req) -> list[float]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.read()["s"]

    def decode_block(self, context: int):
        return lambda steps, settle: self.ask(op="decode", context=context, steps=steps, settle=settle)

    def prefill_block(self, tokens: int):
        return lambda steps, settle: self.ask(op="prefill", tokens=tokens, repeats=steps)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def kl_per_token(files: dict, mix: str, prompt: list[int], tokens: list[int], course_logits: list) -> dict:
    """The course's teacher-forced logits after each of `tokens` against llama.cpp's on the GGUF of the same
    precision (logits_all), KL(llama.cpp || course) per token; and KL(llama.cpp F32 || llama.cpp mix), what
    quantizing itself moves, for scale."""
    import tempfile

    import numpy as np
    import torch

    def logits(path) -> "torch.Tensor":
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "logits.npy")
            run = subprocess.run([sys.executable, __file__, json.dumps({"gguf": str(path), "threads": 1,
                                  "logits": prompt + tokens, "out": out})], capture_output=True, text=True)  # fmt: skip
            if run.returncode:
                raise RuntimeError(f"llama.cpp logits of {path}: {run.stderr[-2000:]}")
            return torch.from_numpy(np.load(out))[len(prompt) : len(prompt) + len(tokens)].double()

    def kl(p, q) -> "torch.Tensor":  # rows of logits -> KL(softmax(p) || softmax(q)) per row
        lp, lq = p.log_softmax(-1), q.log_softmax(-1)
        return (lp.exp() * (lp - lq)).sum(-1)

    ours, theirs = torch.stack(course_logits).double(), logits(files[mix])
    per_token = kl(theirs, ours)
    out = {"gguf": mix, "tokens": len(tokens), "mean": float(per_token.mean()), "max": float(per_token.max()),
           "same argmax": int((ours.argmax(-1) == theirs.argmax(-1)).sum())}  # fmt: skip
    if mix != "F32":  # recorded, not raised: on the tiny model the two are of a size (3e-5), both float noise
        out["llama.cpp F32 vs this GGUF, mean"] = float(kl(logits(files["F32"]), theirs).mean())
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


def load(cfg: dict, logits_all: bool = False):
    from llama_cpp import Llama

    batch = cfg.get("n_batch", 512)
    return Llama(cfg["gguf"], n_ctx=cfg.get("n_ctx", 0) + 256, n_threads=cfg["threads"],
                 n_threads_batch=cfg["threads"], n_batch=batch, n_ubatch=batch, flash_attn=True,
                 use_mmap=cfg.get("mmap", True), logits_all=logits_all, verbose=False)  # fmt: skip


class Cache:
    """A llama_context of its own on the loaded model (the weights are shared), its KV cache filled with
    `context` tokens once. A step evaluates one token at position `context` and drops it again, so every
    step attends over `context` keys: one filled cache for all contexts would not do, since llama.cpp
    attends over every cell in use and a step at 128 would drop positions 128 on that the next step at
    2048 needs."""

    def __init__(self, llm, context: int):
        from llama_cpp import _internals

        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        params.n_ctx = context + 256  # llama.cpp pads its KV view to 256 cells
        self.ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=llm.n_batch, embd=0, n_seq_max=1, verbose=False)
        for start in range(0, context, llm.n_batch):
            self.batch.set_batch([1] * min(llm.n_batch, context - start), n_past=start, logits_all=False)
            self.ctx.decode(self.batch)
        self.context = context

    def step(self, _=None) -> None:
        self.ctx.kv_cache_seq_rm(0, self.context, -1)  # the previous step's token
        self.batch.set_batch([1], n_past=self.context, logits_all=False)
        self.ctx.decode(self.batch)


def timed(fn, arg: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(arg)
        out.append(time.perf_counter() - t0)
    return out


def serve(llm, caches: dict) -> None:
    def prefill(tokens: int):
        llm.reset()  # an empty cache: the whole prompt is computed
        llm.eval([1] * tokens)

    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "decode":
            cache = caches[req["context"]]
            timed(cache.step, 0, req.get("settle", 0))
            out = timed(cache.step, 0, req["steps"])
        elif req["op"] == "prefill":
            out = timed(prefill, req["tokens"], req.get("repeats", 1))
        else:
            raise ValueError(f"unknown request {req}")
        print(json.dumps({"s": out}), flush=True)


def main(cfg: dict) -> None:
    import llama_cpp
    import numpy as np

    if "logits" in cfg:  # every position's logits of one token sequence, then exit
        llm = load({**cfg, "n_ctx": len(cfg["logits"])}, logits_all=True)
        llm.eval(cfg["logits"])
        np.save(cfg["out"], np.asarray(llm.scores[: len(cfg["logits"])], dtype=np.float32))
        print(json.dumps({"out": cfg["out"]}), flush=True)
        return
    llm = load(cfg)
    caches = {c: Cache(llm, c) for c in cfg.get("contexts", [])}  # before the page report: weights all read
    info = {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "torch_in_process": "torch" in sys.modules, "pages": page_report(cfg["gguf"])}  # fmt: skip
    print(json.dumps(info), flush=True)
    serve(llm, caches)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
