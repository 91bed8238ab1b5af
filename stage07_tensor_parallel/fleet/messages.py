"""Every message between the router and its replicas, written down once (given code).

Three channels, one JSON object per message:

    router -> replica, on the replica's ROUTER socket      Hello, Generate, Abort, AskSnapshot, AskStats
    replica -> router, the replies on that same socket     HelloReply, Token, Error, Transfer, Snapshot, Stats
    replica -> every router, on the replica's PUB socket   CacheEvent ("stored" / "removed"), Heartbeat

`encode(message)` is the JSON object that goes on the wire; `decode_request`, `decode_reply` and
`decode_event` turn one back into its dataclass, or raise MessageError. A socket message names its
dataclass by its "type"; a PUB message by its "kind". Each channel has a table of its own because a
question and its answer share a type ("hello", "snapshot", "stats").

A field left out of a JSON object takes its default here, so a hand-written {"type": "stats"} is a message.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar


class MessageError(ValueError):
    """A JSON object that is no message of its channel (an unknown type, a missing field)."""


# --- router -> replica -------------------------------------------------------------------------------------


@dataclass
class Hello:
    """Who are you? (answered by HelloReply)"""

    type: ClassVar[str] = "hello"


@dataclass
class Generate:
    """Run a request and stream its tokens back (Token after each step that has one, or one Error).

    kv_to (a prefill replica): when it finishes, save its prompt's KV and send it to that rank.
    kv_from (a decode replica): first receive the prompt's KV from that rank, waiting at most `timeout`
    seconds, and answer with a Transfer before the tokens. fault: a test hook ("garble" sends a header no
    receiver accepts, "drop" sends nothing) that breaks this request's transfer.
    """

    type: ClassVar[str] = "generate"
    request_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float | None = None  # None or 0: greedy
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    kv_to: int | None = None
    kv_from: int | None = None
    timeout: float | None = None
    fault: str | None = None


@dataclass
class Abort:
    """Free the request's slots now; it ends with finish_reason "abort"."""

    type: ClassVar[str] = "abort"
    request_id: str


@dataclass
class AskSnapshot:
    """Send every page your cache holds (answered by Snapshot)."""

    type: ClassVar[str] = "snapshot"


@dataclass
class AskStats:
    """Send your engine's counters (answered by Stats)."""

    type: ClassVar[str] = "stats"


# --- replica -> router -------------------------------------------------------------------------------------


@dataclass
class HelloReply:
    type: ClassVar[str] = "hello"
    worker: str  # its name, unique in the fleet
    pub_port: int  # where its KV events and heartbeats are published
    page_size: int
    max_len: int  # prompt + max_tokens a request may reach there
    vocab_size: int
    role: str = "both"  # "prefill" and "decode" replicas form a disaggregated fleet
    rank: int | None = None  # its rank in the P/D group (torch.distributed)


@dataclass
class Token:
    type: ClassVar[str] = "token"
    request_id: str
    token_id: int | None  # None: a request that ended without one (aborted)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" once finished
    num_cached_tokens: int = 0  # prompt tokens its prefix cache served


@dataclass
class Error:
    type: ClassVar[str] = "error"
    request_id: str | None
    message: str
    status: int | None = None  # 400: the replica refused the request; 500: its engine failed


@dataclass
class Transfer:
    """A decode replica's word on a prompt's KV it was told to receive (kv_from)."""

    type: ClassVar[str] = "transfer"
    request_id: str
    ok: bool
    error: str | None = None
    broken: bool = False  # gloo closed the channel (a timed-out receive): send no more over this pair


@dataclass
class Snapshot:
    """The pages a replica's cache holds: exactly the effect of its events 1..seq."""

    type: ClassVar[str] = "snapshot"
    worker: str
    seq: int
    block_hashes: list[int]


@dataclass
class Stats:
    type: ClassVar[str] = "stats"
    worker: str
    stats: dict  # the engine's stats, "finish_reasons" and the KV transfer counters


# --- replica -> everyone (PUB) -----------------------------------------------------------------------------


@dataclass
class CacheEvent:
    """Pages that entered ("stored") or left ("removed") a replica's cache; seq counts 1, 2, 3, ..."""

    worker: str
    seq: int
    kind: str
    block_hashes: list[int]


@dataclass
class Heartbeat:
    """Sent every HEARTBEAT_S between two steps, with the last event's number: silence means dead or stuck,
    and a seq past the router's means it missed events."""

    kind: ClassVar[str] = "heartbeat"
    worker: str
    seq: int


REQUESTS = {m.type: m for m in (Hello, Generate, Abort, AskSnapshot, AskStats)}
REPLIES = {m.type: m for m in (HelloReply, Token, Error, Transfer, Snapshot, Stats)}


def encode(message) -> dict:
    """The JSON object of a message: its tag ("type", or "kind" on the PUB socket) and its fields."""
    tag = {"kind": message.kind} if isinstance(message, Heartbeat) else {}
    tag = {"type": message.type} if hasattr(type(message), "type") else tag
    return {**tag, **dataclasses.asdict(message)}


def _build(cls, body: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in body.items() if k in names})
    except TypeError as e:  # a required field is missing
        raise MessageError(f"a {cls.__name__} message needs {sorted(names)}: {e}") from None


def _decode(table: dict, body) -> object:
    if not isinstance(body, dict):
        raise MessageError(f"a message is a JSON object, not {type(body).__name__}")
    kind = body.get("type")
    if kind not in table:
        raise MessageError(f"unknown message type {kind!r}")
    return _build(table[kind], body)


def decode_request(body: dict):
    """What a replica reads on its ROUTER socket."""
    return _decode(REQUESTS, body)


def decode_reply(body: dict):
    """What a router reads from a replica's socket."""
    return _decode(REPLIES, body)


def decode_event(body: dict) -> CacheEvent | Heartbeat:
    """What a router reads from a replica's PUB socket."""
    return _build(Heartbeat if body.get("kind") == "heartbeat" else CacheEvent, body)
