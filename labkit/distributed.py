"""Start a torch.distributed process group from Python, and fail fast when a rank fails.

Stage 07 runs real processes: `launch(fn, world_size, *args)` spawns one process per rank, joins
them to a gloo (CPU) or NCCL (GPU) group and returns what `fn(*args)` returned on every rank.

    results = launch(my_worker, 2, state_dict, ids)   # results[r] is rank r's return value

Three things make it safe to call from tests and notebooks:
- no port collisions: the parent binds the rendezvous store to port 0 and keeps it bound, so the
  OS picks a free port and nobody can take it between choosing and using it;
- no hangs: if a rank raises, the parent re-raises its traceback at once and kills the other
  ranks (which may be blocked in a collective waiting for it); a global timeout covers the rest;
- readable failures: `report("step")` in a worker records how far each rank got, and the
  timeout error lists it.

`fn` must be a module-level function (the children import it by module name, or by file path
for a test file pytest imported under another name). `init_from_env()` is the torchrun side.

Point-to-point transfers (pipeline stages, a ring of KV blocks) go through `isend`/`irecv` and `wait`, which
bounds every wait by a timeout and turns gloo's error into `PeerLost`, naming the peer and the transfer.
"""

import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from .device import has_gpu, pin_threads

HOST = "127.0.0.1"
_QUEUE = None  # set in each child: where results, errors and progress go
_RANK = 0


class RankFailed(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


class PeerLost(RuntimeError):
    """A send or receive did not complete: the peer died (gloo saw its connection close) or did not answer in time."""


def isend(tensor: torch.Tensor, dst: int):
    """Start sending `tensor` to rank dst; keep the returned work (and the tensor) until `wait` says it is done."""
    try:
        return dist.isend(tensor.contiguous(), dst)
    except RuntimeError as e:  # gloo raises at once when it already knows the peer is gone
        raise _lost(e, f"a send to rank {dst}", "at once") from e


def irecv(tensor: torch.Tensor, src: int):
    """Start receiving into `tensor` (its shape and dtype must be the sender's) from rank src."""
    try:
        return dist.irecv(tensor, src)
    except RuntimeError as e:
        raise _lost(e, f"a receive from rank {src}", "at once") from e


def wait(work, timeout_s: float, what: str) -> None:
    """Wait for a transfer `isend`/`irecv` started; PeerLost after timeout_s or when the peer is gone.
    `what` names the transfer for the error ("stage 1's activation from rank 0")."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise _lost(e, what, f"within {timeout_s:g} s") from e


def _lost(error: RuntimeError, what: str, when: str) -> PeerLost:
    cause = str(error).split("] ", 1)[-1].split(". ", 1)[0]  # gloo's reason without its source path
    return PeerLost(
        f"rank {dist.get_rank()}: {what} did not complete {when} ({cause}); "
        "did that rank die, or fall behind by more than the timeout?"
    )


def recv(shape: tuple[int, ...], src: int, timeout_s: float, what: str, dtype=torch.float32) -> torch.Tensor:
    """Receive a tensor of a shape both sides know from rank src, waiting at most timeout_s (PeerLost otherwise)."""
    buf = torch.empty(shape, dtype=dtype)
    wait(irecv(buf, src), timeout_s, what)
    return buf


def backend() -> str:
    """NCCL when every rank can have its own GPU, gloo (CPU) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return "nccl" if has_gpu() and torch.cuda.device_count() >= world else "gloo"


def init_from_env(timeout_s: float = 60.0) -> torch.device:
    """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); a plain
    `python -m ...` run is a world of one and starts no group. Returns this rank's device."""
    if "RANK" not in os.environ:
        return torch.device("cpu")
    name = backend()
    dist.init_process_group(name, timeout=timedelta(seconds=timeout_s))
    if name == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def report(step: str) -> None:
    """Record that this rank reached `step` (shown if the group later times out)."""
    if _QUEUE is not None:
        _QUEUE.put((_RANK, "progress", step))


def launch(fn, world_size: int, *args, timeout: float = 120.0, threads: int | None = None) -> list:
    """Run fn(*args) on `world_size` gloo ranks; return the list of their results, by rank.

    Raises RankFailed with the first failing rank's traceback (the others are killed), or
    TimeoutError naming the ranks that did not finish and the last step each reported.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    target = (fn.__module__, getattr(fn, "__code__", None) and fn.__code__.co_filename, fn.__qualname__)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")  # fork would copy the parent's OpenMP and gloo state
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, store.port, target, args, q, threads, timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    progress = {r: "starting" for r in range(world_size)}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, kind, payload = q.get(timeout=0.2)
            except queue_lib.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = {r: progress[r] for r in range(world_size) if r not in results}
                    raise TimeoutError(
                        f"ranks {sorted(missing)} did not finish within {timeout:.0f} s; last step per rank: {missing}"
                    ) from None
                continue
            if kind == "progress":
                progress[rank] = payload
            elif kind == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            else:
                results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
    return [results[r] for r in range(world_size)]


def _resolve(module: str, file: str | None, qualname: str):
    try:
        if module == "__main__":
            raise ModuleNotFoundError(module)
        obj = importlib.import_module(module)
    except ModuleNotFoundError:
        if not file:
            raise
        spec = importlib.util.spec_from_file_location(f"_launched_{module}", file)
        obj = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(obj)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _child(rank, world_size, port, target, args, q, threads, timeout):
    global _QUEUE, _RANK
    _QUEUE, _RANK = q, rank
    try:
        pin_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=HOST, MASTER_PORT=str(port))
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = _resolve(*target)(*args)
        q.put((rank, "ok", pickle.dumps(result)))  # plain pickle: no shared-memory handles to outlive us
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
