"""Admission control: answer 429 at once when no replica can give a new request its first token within
the TTFT SLO, instead of queueing it without bound. lab3.ipynb §5.

A queue only adds waiting: once every replica is busy past the SLO, a request accepted now misses it
anyway, and makes every request behind it later still. Refusing it early keeps the accepted ones inside
the SLO and tells the client (Retry-After) when the queue should have drained.

The estimate is linear in what the router already counts per replica (policies.WorkerState): the
prompt tokens it sent whose first token has not come back (prefill still to do), and the requests in
flight (each adds its decode to every step the new prompt waits through). The two costs are measured on the replica's machine (lab3 §5
times a ReplicaEngine) or given.
"""

from .policies import WorkerState


class AdmissionControl:
    def __init__(self, ttft_slo: float, prefill_s_per_token: float, decode_s_per_request: float = 0.0):
        if ttft_slo <= 0:
            raise ValueError(f"ttft_slo must be a positive number of seconds, got {ttft_slo}")
        if prefill_s_per_token < 0 or decode_s_per_request < 0:
            raise ValueError(
                f"costs must be >= 0 seconds, got prefill_s_per_token={prefill_s_per_token}, "
                f"decode_s_per_request={decode_s_per_request}"
            )
        self.ttft_slo = ttft_slo
        self.prefill_s_per_token, self.decode_s_per_request = prefill_s_per_token, decode_s_per_request

    def estimate_ttft(self, worker: WorkerState, prompt_tokens: int) -> float:
        """Seconds until a prompt of `prompt_tokens` sent to this replica now gets its first token:
        (worker.queued_prefill_tokens + prompt_tokens) x prefill_s_per_token
        + worker.outstanding x decode_s_per_request."""
        raise NotImplementedError("stage07: AdmissionControl.estimate_ttft — see lab3.ipynb §5")

    def decide(self, workers: list[WorkerState], prompt_tokens: int) -> tuple[bool, float]:
        """(admit, the lowest estimate over the healthy `workers`): admit when some worker's estimate is
        within ttft_slo. No worker at all: (False, inf)."""
        raise NotImplementedError("stage07: AdmissionControl.decide — see lab3.ipynb §5")
