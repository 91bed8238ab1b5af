"""A circuit breaker per replica: stop sending requests to a replica that keeps failing, and let it back
in only after one probe succeeds (Nygard, "Release It!"; Envoy's outlier detection and sgl-router's
circuit breaker do the same). lab3.ipynb §4.

    closed     requests flow; consecutive failures are counted, a success resets the count
    open       failure_threshold failures in a row: the replica is out of the policy's candidates
    half_open  cooldown seconds after it opened: one probe may go; its success closes the breaker,
               its failure opens it again for another cooldown

Time is a number the caller passes (`now`, in seconds): the router passes time.monotonic(), a test a
fake clock, so every transition is deterministic.
"""

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, cooldown: float = 5.0):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {failure_threshold}")
        if cooldown < 0:
            raise ValueError(f"cooldown must be >= 0 seconds, got {cooldown}")
        self.failure_threshold, self.cooldown = failure_threshold, cooldown
        self.state = CLOSED
        self.failures = 0  # consecutive failures while closed
        self.opened_at = 0.0  # when it last opened

    def allow(self, now: float) -> bool:
        """May a request (or, when the breaker is open, the probe) go to the replica at time `now`?
        closed: yes. open: no until `cooldown` has passed since it opened; then it turns half_open and
        says yes once (the caller sends the probe). half_open: no (the probe is out)."""
        raise NotImplementedError("stage07: CircuitBreaker.allow — see lab3.ipynb §4")

    def record_success(self, now: float) -> None:
        """A request (or the probe) succeeded: closed, with no failure counted."""
        raise NotImplementedError("stage07: CircuitBreaker.record_success — see lab3.ipynb §4")

    def record_failure(self, now: float) -> None:
        """A request (or the probe) failed. Half-open: open again. Closed: count it; the
        failure_threshold-th in a row opens the breaker. Open: nothing changes (its cooldown runs on)."""
        raise NotImplementedError("stage07: CircuitBreaker.record_failure — see lab3.ipynb §4")
