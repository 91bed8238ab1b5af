"""What the router keeps about each replica (Worker) and each open request (Flight) (given code).

router_state.py books a request on a replica (dispatch_to) and off it (release); migration.py moves a Flight
whose replica died, telling it with a Lost on its queue.
"""

import asyncio
import time
from dataclasses import dataclass, field

import zmq.asyncio

from .messages import encode
from .policies import RoutedRequest, WorkerState


@dataclass
class Lost:
    """What the watch tells a request whose replica died (never on the wire)."""

    worker: str


@dataclass
class Worker:
    address: str
    sock: zmq.asyncio.Socket
    state: WorkerState
    page_size: int = 16
    max_len: int = 0
    served: int = 0  # requests routed to it since the router started
    replies: dict[str, asyncio.Future] = field(default_factory=dict)  # "stats" -> the pending reply
    last_seen: float = field(default_factory=time.monotonic)  # when it last sent anything (heartbeats too)
    alive: bool = True  # heard from within dead_after seconds
    breaker: object = None  # a breaker.CircuitBreaker, or None (no breaker)
    role: str = "both"  # "prefill" replicas only compute prompts and send their KV to "decode" ones
    rank: int | None = None  # its rank in the P/D group (torch.distributed)

    async def send(self, message, flags: int = 0) -> None:
        await self.sock.send_json(encode(message), flags)


@dataclass
class Flight:
    """One open request: where it runs now and what it has received, so it can move to another replica.
    Its queue holds (message, the worker it came from, or None when the router itself put it there)."""

    rid: str
    prompt: list[int]
    max_tokens: int
    params: dict  # temperature, seed, stop_token_ids: sent again on a move
    session: str | None
    queue: asyncio.Queue
    worker: Worker | None = None
    routed: RoutedRequest | None = None  # what the policy saw when it placed the request on `worker`
    tokens: list[int] = field(default_factory=list)  # received so far, across replicas
    waiting_first: bool = False  # its prompt still counts in worker.state.queued_prefill_tokens
    ended: bool = False  # finished or refused on its replica: nothing to abort there
    booked: bool = False  # counted in its worker's WorkerState (dispatch_to until release)
    moves: int = 0
    pair: tuple[str, str] | None = None  # (prefill, decode) replica names while its KV transfer is pending
