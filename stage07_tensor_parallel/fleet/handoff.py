"""The prefill/decode hand-off (lab5.ipynb §2), the router's side of it (given code).

When some replicas say hello with role "prefill", the router runs each new request in two legs: the
least-busy prefill replica computes the prompt (max_tokens 1) and, as it finishes, sends the prompt's KV
over torch.distributed to the decode replica the policy picked; that replica is told to receive it
(Generate.kv_from), loads it into its prefix cache and streams the whole answer (the prefill's one token
is computed again there from the cached prompt, as vLLM's P/D proxy does). The transfer is honest about
failure: a decode replica that gets a bad, short or late payload computes the prompt itself, and a pair
whose gloo channel closed (a timed-out receive) gets no more transfers: its requests go straight to
decode. A request that moves off a dead replica is recomputed, not transferred. The state this reads and
writes lives on the RouterState (router_state.py): `prefills`, `broken_pairs`, `transfers`,
`transfer_timeout`, and `transfer_faults`, a test hook whose entries ("garble": a header no receiver
accepts, "drop": nothing sent) each break the next transfer.
"""

import asyncio
import contextlib
import dataclasses
import logging

import zmq

from .messages import Abort, Generate, Token, Transfer

log = logging.getLogger(__name__)


async def prefill_leg(router, flight, prefill: list, decode, msg: Generate, timeout: float = 60.0) -> None:
    """Run the prompt on a prefill replica, which then sends its KV to `decode`; on success tell the
    decode side to receive it (msg.kv_from). Whatever fails here, `decode` computes the prompt."""
    worker = min(prefill, key=lambda w: w.state.outstanding)
    if (worker.state.name, decode.state.name) in router.broken_pairs:
        return
    future = asyncio.get_running_loop().create_future()
    router.prefills[flight.rid] = (worker, future)
    worker.state.outstanding += 1
    fault = router.transfer_faults.pop(0) if router.transfer_faults else None
    reply = None
    try:
        await worker.send(dataclasses.replace(msg, max_tokens=1, kv_to=decode.rank, fault=fault))
        reply = await asyncio.wait_for(future, timeout)
    except TimeoutError:
        with contextlib.suppress(zmq.Again):
            await worker.send(Abort(flight.rid), zmq.NOBLOCK)
    finally:
        router.prefills.pop(flight.rid, None)
        worker.state.outstanding -= 1
    # the prefill replica sends exactly when its request finished this way: the decode side must receive
    if isinstance(reply, Token) and reply.finished and reply.finish_reason in ("stop", "length"):
        msg.kv_from, msg.timeout = worker.rank, router.transfer_timeout
        flight.pair = (worker.state.name, decode.state.name)


def on_transfer(router, msg: Transfer) -> None:
    """A decode replica's word on a transfer: count it, and stop using a pair whose channel closed."""
    flight = router.flights.get(msg.request_id)
    router.transfers["ok" if msg.ok else "failed"] += 1
    if not msg.ok:
        log.warning("KV transfer for %s failed, decode computes the prompt: %s", msg.request_id, msg.error)
    if msg.broken and flight is not None and flight.pair is not None:
        router.broken_pairs.add(flight.pair)
