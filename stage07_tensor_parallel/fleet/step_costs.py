"""What the simulator (simulator.py) charges for an engine step and for a KV transfer, both measured on this
machine: `measure_step_costs` times ReplicaEngine.step, `StepCost.fit` fits a cost per step from the batch's
shape, `Transfer.fit` a latency plus bytes over a bandwidth."""

import gc
import time
from dataclasses import astuple, dataclass

import numpy as np

from labkit import paged

from .loadgen import prompt_tokens
from .replica_engine import EngineRequest, ReplicaEngine


@dataclass
class StepCost:
    """Seconds of one engine step. labkit.paged.forward packs the batch: the new tokens of all its sequences
    (a prefill chunk's, and one per decode) go through the weights as one matrix, and each sequence reads its
    own keys. A step over B sequences, sequence i computing T_i new tokens and reaching context L_i, costs about

        base + per_sequence * B + per_token * sum(T_i) + per_key * sum(L_i) + per_score * sum(T_i * L_i)

    fixed overhead, per-sequence bookkeeping and sampling, the weights' work on the new tokens, the gather of
    the paged keys and values, and the attention scores."""

    base: float
    per_sequence: float
    per_token: float
    per_key: float
    per_score: float

    def __call__(self, batch_size: int, tokens: int, context: int) -> float:
        """A step over batch_size alike sequences, each computing `tokens` new tokens up to `context`."""
        return self.ragged([(tokens, context)] * batch_size)

    def ragged(self, batch: list[tuple[int, int]]) -> float:
        """A step over sequences of (new tokens T_i, context L_i)."""
        return float(np.dot(astuple(self), terms(batch)))

    @classmethod
    def fit(cls, samples: list[tuple[list[tuple[int, int]], float]]) -> "StepCost":
        """Non-negative least squares over (batch, seconds) samples (measure_step_costs), on relative error
        (each row divided by its time), so short decode steps count as much as long prefills."""
        from scipy.optimize import nnls

        features = np.array([terms(batch) for batch, _ in samples])
        seconds = np.array([s for _, s in samples])
        coef, _ = nnls(features / seconds[:, None], np.ones_like(seconds))
        return cls(*map(float, coef))


def terms(batch: list[tuple[int, int]]) -> list[float]:
    """StepCost's terms of a batch of (new tokens, context): 1, B, sum T, sum L, sum T*L."""
    return [1.0, len(batch), sum(t for t, _ in batch), sum(c for _, c in batch), sum(t * c for t, c in batch)]


def measure_step_costs(model, *, waves=(1, 2, 4, 8, 16), page_size: int = 16, seed: int = 0) -> list[tuple]:
    """Time every step of a ReplicaEngine serving waves of trace requests (1, 2, 4, ... at once, so decode
    batches, prefill chunks and mixes of both occur) on this machine: [(batch, seconds)], a batch being its
    sequences' (new tokens, context). The batch's shape is read by wrapping labkit.paged.forward for the duration."""
    from .loadgen import conversation_trace

    shapes = []
    forward = paged.forward

    def recording(model_, store, seq_ids, chunks):
        shapes.append([(len(c), store.length(s) + len(c)) for s, c in zip(seq_ids, chunks, strict=True)])
        return forward(model_, store, seq_ids, chunks)

    trace = conversation_trace(sum(waves), 1.0, block_size=page_size, vocab_size=model.config.vocab_size, seed=seed)
    engine = ReplicaEngine(model, num_slots=8192, page_size=page_size, prefix_cache="none", max_num_seqs=16)
    samples, pending = [], iter(enumerate(trace))
    paged.forward, enabled = recording, gc.isenabled()
    gc.disable()  # a collection inside one timed step would read as a slow step
    try:
        for wave in waves:
            for _ in range(wave):
                i, r = next(pending)
                engine.add_request(
                    EngineRequest(str(i), prompt_tokens(r, page_size, model.config.vocab_size), r.output_length)
                )
            while engine.has_work():
                before = len(shapes)
                t0 = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t0
                if len(shapes) > before:
                    samples.append((shapes[-1], seconds))
    finally:
        paged.forward = forward
        if enabled:
            gc.enable()
    return samples


@dataclass
class Transfer:
    """Seconds to move a prompt's KV from a prefill to a decode replica: latency + tokens x bytes_per_token /
    bytes_per_second (fit it with `Transfer.fit` to measured (bytes, seconds) pairs)."""

    latency: float
    bytes_per_second: float
    bytes_per_token: int

    def __call__(self, tokens: int) -> float:
        return self.latency + tokens * self.bytes_per_token / self.bytes_per_second

    @classmethod
    def fit(cls, samples: list[tuple[int, float]], bytes_per_token: int) -> "Transfer":
        """Least squares of seconds on bytes, slope and intercept kept non-negative."""
        from scipy.optimize import nnls

        nbytes, seconds = (np.array(x, dtype=np.float64) for x in zip(*samples, strict=True))
        (latency, per_byte), _ = nnls(np.stack([np.ones_like(nbytes), nbytes], axis=1), seconds)
        return cls(float(latency), 1 / max(float(per_byte), 1e-15), bytes_per_token)
