"""A fleet on this machine: N replica processes and the router in front of them (given code).

    with Fleet(labkit.TARGET, replicas=4, policy="cache_aware", num_slots=512) as fleet:
        openai.OpenAI(base_url=fleet.url + "/v1", api_key="none").completions.create(...)
        fleet.stats()         # per replica: the engine's stats (prefill_tokens_computed, slots_in_use, ...)

    python -m stage07_tensor_parallel.fleet --replicas 4 --policy cache_aware --port 8000
    python -m stage07_tensor_parallel.fleet --prefill 1 --decode 1      # disaggregated (lab5.ipynb §2)

Each replica is `python -m <this package>.replica` in its own process (so the learner's or the reference
code, whichever this module was loaded from), one torch thread each; they exit with this process. The
router runs in this process, on a free port (labkit.serving). On other machines, start replica.py there
and point router.py's CLI at their addresses instead.

With prefill=P and decode=D (both at least 1) the fleet is P prefill replicas (w0 ...) and D decode
replicas after them, instead of `replicas` whole ones; they form one torch.distributed group (gloo, a free
port on this machine as its rendezvous, rank = the replica's number) over which the prompts' KV moves.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from labkit import ROOT, checkpoint
from labkit.serving import serving

from .router import POLICIES, chat_template, create_app


class Fleet:
    """Start the replicas and the router on enter; stop both on exit. engine_settings go to each ReplicaEngine;
    breaker, admission and dead_after to the router (create_app)."""

    def __init__(
        self,
        model_folder=None,
        replicas: int = 4,
        policy: str = "cache_aware",
        *,
        policy_options: dict | None = None,
        drop_events: float = 0.0,
        start_timeout: float = 60.0,
        breaker=None,
        admission=None,
        dead_after: float = 3.0,
        prefill: int = 0,
        decode: int = 0,
        **engine_settings,
    ):
        if prefill or decode:
            if prefill < 1 or decode < 1:
                raise ValueError(
                    f"a disaggregated fleet needs prefill >= 1 and decode >= 1, got {prefill} and {decode}"
                )
            replicas = prefill + decode
        if replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got replicas={replicas}")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; pick one of {', '.join(POLICIES)}")
        self.folder = Path(model_folder or checkpoint.model_folder())
        self.n, self.policy, self.policy_options = replicas, policy, policy_options
        self.roles = ["prefill"] * prefill + ["decode"] * decode if prefill else ["both"] * replicas
        self.drop_events, self.start_timeout, self.engine_settings = drop_events, start_timeout, engine_settings
        self.router_faults = {"breaker": breaker, "admission": admission, "dead_after": dead_after}  # router.py
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []

    def start_replicas(self) -> None:
        package = __spec__.parent  # this module's package, also under python -m
        # the folder this package was imported from (the course, or a copy holding a submission), and labkit's
        base = Path(sys.modules[package.split(".")[0]].__file__).parent.parent
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(base), str(ROOT)])),
        }
        group = []
        if "prefill" in self.roles:  # the P/D group's rendezvous: a port free now (rank 0 binds it)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                group = ["--dist-init", f"tcp://127.0.0.1:{s.getsockname()[1]}", "--dist-world", str(self.n)]
        for i in range(self.n):
            cmd = [sys.executable, "-m", f"{package}.replica", "--model", str(self.folder), "--name", f"w{i}",
                   "--engine", json.dumps(self.engine_settings), "--parent-pid", str(os.getpid())]  # fmt: skip
            if group:
                cmd += ["--role", self.roles[i], "--dist-rank", str(i), *group]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True, cwd=base))
        for proc in self.procs:  # each prints its ports once its model is loaded
            line = self._first_line(proc)
            self.addresses.append(f"tcp://127.0.0.1:{json.loads(line)['port']}")

    def _first_line(self, proc: subprocess.Popen) -> str:
        result = []
        reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.start_timeout)
        if not result or not result[0]:
            name = proc.args[proc.args.index("--name") + 1]
            if result:  # it printed nothing and exited: broken, and its own output says why
                why = f"replica {name} exited with code {proc.wait(1)}; run its command by hand to see why"
            else:  # still loading: N replicas load N models at once, and a busy machine takes longer
                why = (f"replica {name} has not finished loading its model after {self.start_timeout:g} s; the "
                       f"machine may just be slow or busy (the replicas load at once): give it longer with "
                       f"--start-timeout (Fleet(start_timeout=...)), or start fewer replicas. Its command")  # fmt: skip
            raise RuntimeError(f"{why}: {' '.join(proc.args)}")
        return result[0]

    def __enter__(self) -> "Fleet":
        try:
            self.start_replicas()
            config = checkpoint.read_config(self.folder)
            self.app = create_app(
                self.addresses, checkpoint.load_tokenizer(self.folder), policy=self.policy,
                policy_options=self.policy_options, render_chat=chat_template(self.folder),
                eos_token_id=config.get("eos_token_id"), model_name=self.folder.name, drop_events=self.drop_events,
                **self.router_faults,
            )  # fmt: skip
            self._serving = serving(self.app, timeout=self.start_timeout)
            self.url = self._serving.__enter__()
        except BaseException:
            self.stop_replicas()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._serving.__exit__(*exc)
        finally:
            self.stop_replicas()

    def stop_replicas(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self.procs = []

    @property
    def router(self):
        """The router's state (its workers, KV index and policy), for inspection."""
        return self.app.state.fleet

    def ask(self, i: int, msg: dict, timeout: float = 10.0) -> dict:
        """Send replica i one control message ({"type": "stats"} or {"type": "snapshot"}) and return its reply."""
        with zmq.Context.instance().socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.addresses[i])
            sock.send_json(msg)
            if not sock.poll(timeout * 1000):
                raise TimeoutError(f"replica {i} ({self.addresses[i]}) did not answer {msg} within {timeout} s")
            return sock.recv_json()

    def stats(self) -> list[dict]:
        """Each live replica's engine stats, asked directly (not through the router); a killed one is left out."""
        return [self.ask(i, {"type": "stats"})["stats"] for i in range(self.n) if self.procs[i].poll() is None]

    def kill(self, name: str) -> None:
        """kill -9 the replica called `name` (w0, w1, ...): a crash, for lab3 §4 and its tests."""
        proc = self.procs[int(name.removeprefix("w"))]
        proc.kill()
        proc.wait()

    def wait_idle(self, timeout: float = 30.0) -> list[dict]:
        """Stats once no replica runs or queues a request (aborts reach a replica a moment after a client leaves)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="N replicas of a model behind one OpenAI-compatible router.")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policy", default="cache_aware", choices=sorted(POLICIES))
    ap.add_argument("--model", default=None, help="model folder (default: $MODEL, else the tiny target)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--engine", default="{}", help='ReplicaEngine settings as JSON, e.g. {"num_slots": 512}')
    ap.add_argument("--dead-after", type=float, default=3.0, help="seconds of silence after which a replica is dead")
    ap.add_argument("--prefill", type=int, default=0, help="prefill replicas (with --decode: disaggregated)")
    ap.add_argument("--decode", type=int, default=0, help="decode replicas (with --prefill: disaggregated)")
    ap.add_argument("--start-timeout", type=float, default=60.0,
                    help="seconds each replica may take to load its model (longer on a busy machine)")  # fmt: skip
    args = ap.parse_args(argv)
    fleet = Fleet(args.model, args.replicas, args.policy, prefill=args.prefill, decode=args.decode,
                  start_timeout=args.start_timeout, **json.loads(args.engine))  # fmt: skip
    import uvicorn

    fleet.start_replicas()
    try:
        config = checkpoint.read_config(fleet.folder)
        app = create_app(
            fleet.addresses, checkpoint.load_tokenizer(fleet.folder), policy=args.policy,
            render_chat=chat_template(fleet.folder), eos_token_id=config.get("eos_token_id"),
            model_name=fleet.folder.name, dead_after=args.dead_after,
        )  # fmt: skip
        roles = ", ".join(f"{a} ({r})" for a, r in zip(fleet.addresses, fleet.roles, strict=True))
        print(f"{fleet.n} replicas at {roles}; router on http://127.0.0.1:{args.port}")
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        fleet.stop_replicas()


if __name__ == "__main__":
    main()
