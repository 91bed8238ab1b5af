"""One replica of the fleet as its own OS process: a ReplicaEngine behind two zmq sockets (given code).

    python -m stage07_tensor_parallel.fleet.replica --model FOLDER --name w0 --host 0.0.0.0 --port 5555 --pub-port 5556

It prints one JSON line, {"worker", "port", "pub_port"} (port 0 picks a free one), then serves until it
is killed, or until the process that started it (--parent-pid) is gone. The messages it reads and sends
are messages.py's: on its ROUTER socket (a router's DEALER connects; replies go back to the socket that
asked) Hello -> HelloReply, Generate -> a Token after each step that has one (or an Error if the engine
refuses it), Abort, AskSnapshot -> Snapshot, AskStats -> Stats (the engine's stats, "finish_reasons" and
the KV transfer counters below); on its PUB socket a CacheEvent for each change to its cache, numbered 1,
2, 3, ..., and every HEARTBEAT_S, between two steps, a Heartbeat with the last event's number, so a router
that lost the latest events (or just started) sees the gap, and one that hears nothing for a while knows
the replica is dead or stuck (the router moves its requests). A snapshot is taken between two steps, so it
holds exactly the effect of events 1..seq.

Roles (prefill/decode disaggregation, lab5.ipynb §2). `--role both` (the default) serves whole requests.
With `--dist-init tcp://HOST:PORT --dist-rank R --dist-world N` the replica joins a torch.distributed group
(gloo) with the fleet's other prefill and decode replicas, and Generate's kv_to and kv_from apply: a
prefill replica saves its finished prompt's KV (save_kv) and sends it to rank kv_to; a decode replica first
receives it from rank kv_from and loads it (load_kv), so the prompt hits the prefix cache and only its last
token is computed, and answers with a Transfer before the tokens. A transfer that fails (timeout, bad
header, checksum) is answered by computing the prompt here; Transfer.broken means gloo closed the channel
(a timed-out receive) and the router sends no more transfers over that pair. Counters in Stats:
kv_bytes_sent, kv_transfers_sent (prefill side), kv_bytes_received, kv_transfers_loaded,
kv_transfer_failures (decode side). A prefill replica whose save_kv fails sends a header no receiver
accepts, so its peer recomputes at once instead of waiting.
"""

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import torch
import zmq

from labkit import checkpoint
from labkit.model import from_pretrained

from .kv_connector import HEADER, TransferError, load_kv, recv_kv, save_kv, send_kv
from .messages import (
    Abort,
    AskSnapshot,
    AskStats,
    CacheEvent,
    Error,
    Generate,
    Heartbeat,
    Hello,
    HelloReply,
    MessageError,
    Snapshot,
    Stats,
    Token,
    Transfer,
    decode_request,
    encode,
)
from .replica_engine import EngineRequest, KVEvent, ReplicaEngine

HEARTBEAT_S = 0.5
TRANSFER_TIMEOUT_S = 10.0  # a decode replica's wait for a prompt's KV before it computes the prompt itself


class Replica:
    """The engine and its sockets; run() is the serving loop (one thread: the engine is not thread-safe)."""

    def __init__(self, engine: ReplicaEngine, name: str, page_size: int, host: str, port: int, pub_port: int,
                 role: str = "both", rank: int | None = None):  # fmt: skip
        self.engine, self.name, self.page_size = engine, name, page_size
        self.role, self.rank = role, rank
        self.sends: dict[str, tuple[int, list[int], str | None]] = {}  # request id -> (peer rank, prompt, fault)
        self.transfers: Counter = Counter()  # kv_bytes_sent, kv_transfers_sent, kv_bytes_received, ...
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
        self.pub.send_json(encode(CacheEvent(self.name, self.seq, event.kind, event.block_hashes)))

    def reply(self, identity: bytes, message) -> None:
        self.sock.send_multipart([identity, json.dumps(encode(message)).encode()])

    def handle(self, identity: bytes, body: dict) -> None:
        try:
            msg = decode_request(body)
        except MessageError as e:
            if body.get("type") == "generate":  # a request this replica cannot run: its client hears why
                self.reply(identity, Error(str(body.get("request_id")), str(e), status=400))
            else:
                self.reply(identity, Error(None, str(e)))
            return
        if isinstance(msg, Generate):
            self.start(identity, msg)
        elif isinstance(msg, Abort):
            self.engine.abort(str(msg.request_id))
        elif isinstance(msg, AskSnapshot):
            self.reply(identity, Snapshot(self.name, self.seq, sorted(self.engine.cached_block_hashes())))
        elif isinstance(msg, AskStats):
            stats = {**self.engine.stats, **self.transfers, "finish_reasons": dict(self.finish_reasons)}
            self.reply(identity, Stats(self.name, stats))
        elif isinstance(msg, Hello):
            limit = min(self.engine.store.num_blocks, self.engine.model.config.max_position_embeddings)
            self.reply(identity, HelloReply(self.name, self.pub_port, self.page_size, limit,
                                            self.engine.model.config.vocab_size, self.role, self.rank))  # fmt: skip

    def start(self, identity: bytes, msg: Generate) -> None:
        rid = str(msg.request_id)
        if msg.kv_from is not None:
            self.receive(identity, rid, msg)
        try:
            self.engine.add_request(
                EngineRequest(
                    request_id=rid,
                    prompt=msg.prompt,
                    max_tokens=msg.max_tokens,
                    temperature=float(msg.temperature or 0.0),
                    seed=msg.seed,
                    stop_token_ids=tuple(msg.stop_token_ids or ()),
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            self.reply(identity, Error(rid, str(e), status=400))
            return
        self.owner[rid] = identity
        if msg.kv_to is not None:
            self.sends[rid] = (int(msg.kv_to), list(msg.prompt), msg.fault)

    def step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 — the process must outlive one bad step; every client hears of it
            for rid, identity in list(self.owner.items()):
                self.engine.abort(rid)
                self.reply(identity, Error(rid, f"the engine failed: {e}", status=500))
            self.owner.clear()
            self.sends.clear()  # their prefills failed: the router has the decode side compute the prompts
            self.engine.step()  # reports the aborts, which nobody awaits any more
            return
        for out in outs:
            if out.finished:
                self.finish_reasons[out.finish_reason] += 1
            identity = self.owner.get(out.request_id)
            if identity is None:
                continue  # aborted: its client has gone
            self.reply(identity, Token(out.request_id, out.token_id, out.finished, out.finish_reason,
                                       out.num_cached_tokens))  # fmt: skip
            if out.finished:
                del self.owner[out.request_id]
            if out.finished and out.request_id in self.sends:
                self.send(out.request_id, out.finish_reason)

    def send(self, rid: str, finish_reason: str) -> None:
        """Ship a finished prefill's KV to its decode replica (the router told that one to receive it exactly
        when this request finished with stop or length). Blocks until the peer has it: a transfer is a
        few milliseconds here, and the engine must not change the slots while they are copied out."""
        peer, prompt, fault = self.sends.pop(rid)
        if finish_reason not in ("stop", "length"):
            return  # aborted or failed: the router tells the decode side to compute the prompt
        try:
            payload = save_kv(self.engine, prompt) if fault is None else None
        except Exception:  # noqa: BLE001 — e.g. an unfinished save_kv: the peer must not wait for nothing
            payload = None
        try:
            if payload is not None:
                self.transfers["kv_bytes_sent"] += send_kv(payload, peer)
                self.transfers["kv_transfers_sent"] += 1
            elif fault != "drop":  # a header with the wrong magic: the receiver refuses it and recomputes
                torch.distributed.send(torch.zeros(HEADER, dtype=torch.int64), peer)
        except Exception:  # noqa: BLE001 — a dead or timed-out peer: the decode side recomputes
            self.transfers["kv_send_failures"] += 1

    def receive(self, identity: bytes, rid: str, msg: Generate) -> None:
        """Receive and load a prompt's KV from rank msg.kv_from before the request is added; on any
        failure the request simply computes its prompt (whatever load_kv cached stays valid: it is keyed
        by tokens)."""
        ok, error, broken = False, None, False
        try:
            timeout = TRANSFER_TIMEOUT_S if msg.timeout is None else msg.timeout
            payload = recv_kv(int(msg.kv_from), self.engine.model.config, timeout)
            self.transfers["kv_bytes_received"] += payload.nbytes
            load_kv(self.engine, payload)
            ok = payload.token_ids == list(msg.prompt)[: len(payload.token_ids)]
            error = None if ok else "the KV that arrived belongs to another prompt"
        except TransferError as e:  # a bad header or checksum leaves the channel open; a failed wait closes it
            error = str(e)
            broken = not error.startswith("malformed") and "checksum" not in error
        except Exception as e:  # noqa: BLE001 — e.g. an unfinished load_kv: recompute rather than fail
            error = f"{type(e).__name__}: {e}"
        self.transfers["kv_transfers_loaded" if ok else "kv_transfer_failures"] += 1
        self.reply(identity, Transfer(rid, ok, error, broken))

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
                        body = json.loads(payload)
                    except ValueError:
                        self.reply(identity, Error(None, "not JSON"))
                        continue
                    self.handle(identity, body if isinstance(body, dict) else {"type": None})
            if self.engine.has_work():
                self.step()
            if time.monotonic() - last_beat >= HEARTBEAT_S:  # busy or idle: the router reads silence as death
                self.pub.send_json(encode(Heartbeat(self.name, self.seq)))
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
    ap.add_argument("--role", default="both", choices=["both", "prefill", "decode"], help="what this replica serves")
    ap.add_argument("--dist-init", default=None, help="tcp://HOST:PORT of the P/D group's rank 0 (gloo)")
    ap.add_argument("--dist-rank", type=int, default=None, help="this replica's rank in the P/D group")
    ap.add_argument("--dist-world", type=int, default=None, help="how many replicas the P/D group has")
    args = ap.parse_args(argv)
    if args.role != "both" and args.dist_init is None:
        ap.error(f"--role {args.role} needs --dist-init, --dist-rank and --dist-world (the P/D group)")
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    torch.set_num_threads(1)  # several replicas share this machine's cores
    settings = json.loads(args.engine)
    model = from_pretrained(args.model or checkpoint.model_folder()).float().eval()
    engine = ReplicaEngine(model, **settings)
    if args.dist_init is not None:  # every replica of the group joins here, before any says it is ready
        torch.distributed.init_process_group(
            "gloo", init_method=args.dist_init, rank=args.dist_rank, world_size=args.dist_world,
            timeout=timedelta(seconds=TRANSFER_TIMEOUT_S * 3),  # a send to a dead peer fails, not hangs
        )  # fmt: skip
    replica = Replica(engine, args.name, settings.get("page_size", 16), args.host, args.port, args.pub_port,
                      args.role, args.dist_rank)  # fmt: skip
    print(json.dumps({"worker": args.name, "port": replica.port, "pub_port": replica.pub_port}), flush=True)
    replica.run()


if __name__ == "__main__":
    main(sys.argv[1:])
