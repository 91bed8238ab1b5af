"""What the router does when a replica falls silent (given code; RouterState in router_state.py mixes it in).

A replica that sends nothing (not even its heartbeat) for `dead_after` seconds is dead: it leaves the
policy's candidates, and each of its requests moves to a healthy replica as its prompt plus the tokens
already received, with max_tokens reduced by as many, so a greedy stream goes on as if nothing happened (a
sampled one goes on correctly but differently); with no healthy replica left the client gets an error,
never a hang. Each silent check is a failure for the replica's circuit breaker (when the router has
breakers); a replica heard from again is alive, and back in the candidates once its breaker's probe (a
stats request) has closed the breaker.
"""

import asyncio
import contextlib
import logging
import time

import zmq

from .books import Flight, Lost, Worker
from .messages import Abort

log = logging.getLogger(__name__)


class Migration:
    """Failure detection and moving requests, for RouterState: it reads the state's workers, flights,
    prefills, tasks, dead_after, probe_timeout and moved, and calls its route, release and stats."""

    def candidates(self, exclude: Worker | None = None) -> list[Worker]:
        """The workers a request may go to: alive, and with a closed breaker. A breaker whose cooldown has
        passed lets its probe go here (a stats request), never a client's request."""
        out, now = [], time.monotonic()
        for w in self.workers.values():
            if not w.alive or w is exclude:
                continue
            if w.breaker is None:
                out.append(w)
            elif w.breaker.allow(now):
                if w.breaker.state == "closed":
                    out.append(w)
                else:  # it just turned half-open
                    self.tasks.append(asyncio.ensure_future(self.probe(w)))
        return out

    async def probe(self, worker: Worker) -> None:
        try:
            await self.stats(worker, self.probe_timeout)
        except TimeoutError:
            worker.breaker.record_failure(time.monotonic())
        else:
            worker.breaker.record_success(time.monotonic())

    def failed(self, worker: Worker) -> None:
        if worker.breaker is not None:
            worker.breaker.record_failure(time.monotonic())

    async def watch(self, period: float = 0.1) -> None:
        """Every `period`: a replica silent for dead_after seconds is dead (its requests are told to move)
        and each such check is a failure for its breaker; one heard from again is alive (and back in the
        candidates once its breaker's probe has closed it); breakers due for a probe get it."""
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for name, w in self.workers.items():
                silent = now - w.last_seen > self.dead_after
                if silent:
                    self.failed(w)  # each check counts: the breaker opens, and its probes tell when it is back
                if w.alive and silent:
                    log.warning("replica %s (%s) sent nothing for %.1f s: dead", name, w.address, self.dead_after)
                    w.alive = False
                    for worker, future in self.prefills.values():
                        if worker is w and not future.done():
                            future.set_result(Lost(name))
                    for flight in self.flights.values():
                        if flight.worker is w:
                            flight.queue.put_nowait((Lost(name), None))
                elif not w.alive and not silent:
                    log.warning("replica %s (%s) is back", name, w.address)
                    w.alive = True
            self.tasks = [t for t in self.tasks if not t.done()]
            self.candidates()

    async def move(self, flight: Flight) -> bool:
        """Its replica died: continue it elsewhere from the tokens received so far."""
        old = flight.worker
        self.release(flight)
        with contextlib.suppress(zmq.Again):  # a stuck replica that wakes up must not finish it too
            await old.send(Abort(flight.rid), zmq.NOBLOCK)
        if not await self.route(flight, exclude=old):
            flight.ended = True  # nothing runs it any more
            return False
        flight.moves += 1
        self.moved += 1
        log.warning("request %s moved from %s to %s after %d tokens", flight.rid, old.state.name,
                    flight.worker.state.name, len(flight.tokens))  # fmt: skip
        return True
