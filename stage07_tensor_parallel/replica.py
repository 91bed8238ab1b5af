"""One replica of the fleet as its own OS process: a ReplicaEngine behind two zmq sockets (given code).

    python -m stage07_tensor_parallel.replica --model FOLDER --name w0 --host 0.0.0.0 --port 5555 --pub-port 5556

It prints one JSON line, {"worker", "port", "pub_port"} (port 0 picks a free one), then serves until it
is killed, or until the process that started it (--parent-pid) is gone. Every message is one JSON object.

ROUTER socket (a router's DEALER connects; replies go back to the socket that asked):
    {"type": "hello"}                    -> {"type": "hello", "worker", "pub_port", "page_size", "max_len", "vocab_size"}
    {"type": "generate", "request_id", "prompt": [ids], "max_tokens", "temperature", "seed", "stop_token_ids"}
                                         -> {"type": "token", "request_id", "token_id", "finished",
                                             "finish_reason", "num_cached_tokens"} after each step that has one,
                                            or {"type": "error", "request_id", "message"} if the engine refuses it
    {"type": "abort", "request_id"}      frees the request's slots now; it ends with finish_reason "abort"
    {"type": "snapshot"}                 -> {"type": "snapshot", "worker", "seq", "block_hashes"}
    {"type": "stats"}                    -> {"type": "stats", "worker", "stats": engine.stats + "finish_reasons"}

PUB socket: KV events {"worker", "seq", "kind": "stored" | "removed", "block_hashes"}, seq 1, 2, 3, ...;
and every HEARTBEAT_S, between two steps, {"worker", "seq", "kind": "heartbeat"} with the last event's number,
so a router that lost the latest events (or just started) sees the gap, and one that hears nothing for a
while knows the replica is dead or stuck (router.py migrates its requests). A snapshot is taken between two steps,
so it holds exactly the effect of events 1..seq.
"""

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter

import torch
import zmq

from labkit import checkpoint
from labkit.model import from_pretrained

from .replica_engine import EngineRequest, KVEvent, ReplicaEngine

HEARTBEAT_S = 0.5


class Replica:
    """The engine and its sockets; run() is the serving loop (one thread: the engine is not thread-safe)."""

    def __init__(self, engine: ReplicaEngine, name: str, page_size: int, host: str, port: int, pub_port: int):
        self.engine, self.name, self.page_size = engine, name, page_size
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = self._bind(self.sock, host, port)
        self.pub_port = self._bind(self.pub, host, pub_port)
        self.seq = 0  # the number of the last KV event published
        self.owner: dict[str, bytes] = {}  # request id -> the identity of the socket that sent it
        self.finish_reasons: Counter = Counter()  # how requests ended: stop, length, abort, error
        engine.on_kv_event = self.publish

    @staticmethod
    def _bind(sock, host: str, port: int) -> int:
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{host}")

    def publish(self, event: KVEvent) -> None:
        self.seq += 1
        self.pub.send_json(
            {"worker": self.name, "seq": self.seq, "kind": event.kind, "block_hashes": event.block_hashes}
        )

    def reply(self, identity: bytes, body: dict) -> None:
        self.sock.send_multipart([identity, json.dumps(body).encode()])

    def handle(self, identity: bytes, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "generate":
            rid = str(msg.get("request_id"))
            try:
                self.engine.add_request(
                    EngineRequest(
                        request_id=rid,
                        prompt=msg["prompt"],
                        max_tokens=msg["max_tokens"],
                        temperature=float(msg.get("temperature") or 0.0),
                        seed=msg.get("seed"),
                        stop_token_ids=tuple(msg.get("stop_token_ids") or ()),
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                self.reply(identity, {"type": "error", "request_id": rid, "status": 400, "message": str(e)})
                return
            self.owner[rid] = identity
        elif kind == "abort":
            self.engine.abort(str(msg.get("request_id")))
        elif kind == "snapshot":
            hashes = sorted(self.engine.cached_block_hashes())
            self.reply(identity, {"type": "snapshot", "worker": self.name, "seq": self.seq, "block_hashes": hashes})
        elif kind == "stats":
            stats = {**self.engine.stats, "finish_reasons": dict(self.finish_reasons)}
            self.reply(identity, {"type": "stats", "worker": self.name, "stats": stats})
        elif kind == "hello":
            limit = min(self.engine.store.num_blocks, self.engine.model.config.max_position_embeddings)
            body = {"type": "hello", "worker": self.name, "pub_port": self.pub_port, "page_size": self.page_size}
            self.reply(identity, {**body, "max_len": limit, "vocab_size": self.engine.model.config.vocab_size})
        else:
            self.reply(identity, {"type": "error", "request_id": None, "message": f"unknown message type {kind!r}"})

    def step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 — the process must outlive one bad step; every client hears of it
            for rid, identity in list(self.owner.items()):
                self.engine.abort(rid)
                body = {"type": "error", "request_id": rid, "status": 500, "message": f"the engine failed: {e}"}
                self.reply(identity, body)
            self.owner.clear()
            self.engine.step()  # reports the aborts, which nobody awaits any more
            return
        for out in outs:
            if out.finished:
                self.finish_reasons[out.finish_reason] += 1
            identity = self.owner.get(out.request_id)
            if identity is None:
                continue  # aborted: its client has gone
            body = {
                "type": "token",
                "request_id": out.request_id,
                "token_id": out.token_id,
                "finished": out.finished,
                "finish_reason": out.finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
            }
            self.reply(identity, body)
            if out.finished:
                del self.owner[out.request_id]

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        last_beat = 0.0
        while True:
            busy = self.engine.has_work()
            if poller.poll(0 if busy else int(HEARTBEAT_S * 1000)):
                while True:  # everything that arrived, then one step
                    try:
                        identity, payload = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = json.loads(payload)
                    except ValueError:
                        self.reply(identity, {"type": "error", "request_id": None, "message": "not JSON"})
                        continue
                    self.handle(identity, msg)
            if self.engine.has_work():
                self.step()
            if time.monotonic() - last_beat >= HEARTBEAT_S:  # busy or idle: the router reads silence as death
                self.pub.send_json({"worker": self.name, "seq": self.seq, "kind": "heartbeat"})
                last_beat = time.monotonic()


def exit_with_parent(parent: int) -> None:
    """Exit once `parent` is gone (a killed fleet cannot send the replicas anything)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: $MODEL, else the tiny target)")
    ap.add_argument("--name", default="w0", help="the worker's name in KV events (unique in the fleet)")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: reachable from other machines)")
    ap.add_argument("--port", type=int, default=0, help="the ROUTER socket's port (0: a free one)")
    ap.add_argument("--pub-port", type=int, default=0, help="the PUB socket's port (0: a free one)")
    ap.add_argument("--engine", default="{}", help='ReplicaEngine settings as JSON, e.g. {"num_slots": 512}')
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = ap.parse_args(argv)
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    torch.set_num_threads(1)  # several replicas share this machine's cores
    settings = json.loads(args.engine)
    model = from_pretrained(args.model or checkpoint.model_folder()).float().eval()
    engine = ReplicaEngine(model, **settings)
    replica = Replica(engine, args.name, settings.get("page_size", 16), args.host, args.port, args.pub_port)
    print(json.dumps({"worker": args.name, "port": replica.port, "pub_port": replica.pub_port}), flush=True)
    replica.run()


if __name__ == "__main__":
    main(sys.argv[1:])
