"""Load for a serving benchmark: open-loop arrivals, and conversation traces with prefix structure.

    poisson_arrivals, gamma_arrivals   when requests arrive (seconds), whatever the server does (open loop)
    block_hash_ids                     a prompt as Mooncake-style hash ids of fixed-size token blocks
    conversation_trace                 a synthetic trace: multi-turn sessions behind a few shared system prompts
    write_trace, read_trace            the trace as JSON lines, one request a line (Mooncake's fields)
    prompt_tokens                      token ids with a request's prefix structure, rebuilt from its hash ids

lab4.ipynb §1 says why a benchmark sends on a clock instead of waiting for answers.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class TraceRequest:
    """One request of a trace. Two requests whose hash_ids agree on their first k ids share their first
    k blocks of prompt tokens (block_size tokens each; the last block of a prompt may be partial)."""

    timestamp: float  # seconds after the trace's start
    input_length: int  # prompt tokens
    output_length: int  # tokens to generate
    hash_ids: list[int]  # one id per block of the prompt, ceil(input_length / block_size) of them
    session_id: int | None = None  # the conversation it belongs to (None: unknown, as in Mooncake's files)
    turn: int = 0  # 0 for a session's first request


def _check_rate(rate: float, n: int) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    if n < 0:
        raise ValueError(f"n must be a count of requests (>= 0), got {n!r}")


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """Arrival times (seconds, (n,) float64, non-decreasing) of the first n requests of a Poisson process of
    `rate` requests per second that starts at time 0: the gaps between successive arrivals (the first one
    after 0 included) are independent and exponential with mean 1 / rate. Draws from
    np.random.default_rng(seed), so one seed always gives the same times."""
    _check_rate(rate, n)
    raise NotImplementedError("stage07: poisson_arrivals — see lab4.ipynb §1")


def gamma_arrivals(rate: float, burstiness: float, n: int, seed: int) -> np.ndarray:
    """Like poisson_arrivals, with gamma-distributed gaps of mean 1 / rate (vLLM's `--burstiness`): the
    gaps' squared coefficient of variation is 1 / burstiness, so burstiness 1 is Poisson, below 1 the
    arrivals come in bursts, above 1 they are more regular. Draws from np.random.default_rng(seed)."""
    _check_rate(rate, n)
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive (1 is Poisson), got {burstiness!r}")
    raise NotImplementedError("stage07: gamma_arrivals — see lab4.ipynb §1")


def block_hash_ids(tokens: list[int], block_size: int, table: dict) -> list[int]:
    """The hash ids of a prompt's blocks: tokens[0:block_size], tokens[block_size:2 * block_size], ...,
    the last block partial when block_size does not divide len(tokens).

    A block's id names the block's tokens AND everything before it, so equal ids mean equal prefixes.
    `table` (shared by every prompt of a trace, updated in place) maps (the previous block's id, or -1 for
    the first block; the block's tokens as a tuple) to its id; a key not yet in it gets the next unused
    id, len(table), so ids run 0, 1, 2, ... in order of first appearance, as in Mooncake's traces.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size!r}")
    raise NotImplementedError("stage07: block_hash_ids — see lab4.ipynb §1")


def conversation_trace(
    num_requests: int,
    rate: float,
    *,
    burstiness: float = 1.0,
    system_prompts: int = 4,
    system_length: int = 96,
    max_turns: int = 4,
    new_session_prob: float = 0.35,
    user_length: tuple[int, int] = (8, 48),
    output_length: tuple[int, int] = (8, 48),
    block_size: int = 16,
    vocab_size: int = 2048,
    seed: int = 0,
) -> list[TraceRequest]:
    """A synthetic trace with the shape of published conversation traces (Mooncake's, ShareGPT-style chats).

    Requests arrive at `rate` per second (gamma_arrivals with `burstiness`). Each arrival starts a new
    session with probability new_session_prob (always when none is open), else continues a random open
    session. A session opens with one of `system_prompts` shared system prompts (system_length tokens;
    0 prompts: none) and lasts 1..max_turns turns; each turn's prompt is the previous turn's prompt, its
    answer and a new user message (user_length tokens, uniform in the closed range), and asks for
    output_length tokens (uniform). system_prompts=0, max_turns=1 gives a trace without reuse.

    Token ids are drawn at random and kept only as hash ids (block_hash_ids); the answer's tokens stand in
    for what the model will say. Turns are placed on the arrival clock, not after their previous answer:
    a replay is open loop, as a recorded trace is.
    """
    if num_requests < 0 or max_turns < 1 or not 0 < new_session_prob <= 1:
        raise ValueError("conversation_trace needs num_requests >= 0, max_turns >= 1 and 0 < new_session_prob <= 1")
    rng = np.random.default_rng(seed)
    times = gamma_arrivals(rate, burstiness, num_requests, seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(vocab_size, size=n).tolist()

    systems = [tokens(system_length) for _ in range(system_prompts)]
    table, open_sessions, trace, started = {}, [], [], 0
    for t in times:
        if not open_sessions or rng.random() < new_session_prob:
            history = list(systems[rng.integers(system_prompts)]) if system_prompts else []
            session = {"id": started, "turn": 0, "history": history, "turns": int(rng.integers(1, max_turns + 1))}
            open_sessions.append(session)
            started += 1
        else:
            session = open_sessions[rng.integers(len(open_sessions))]
        prompt = session["history"] + tokens(int(rng.integers(user_length[0], user_length[1] + 1)))
        out = int(rng.integers(output_length[0], output_length[1] + 1))
        ids = block_hash_ids(prompt, block_size, table)
        trace.append(TraceRequest(float(t), len(prompt), out, ids, session["id"], session["turn"]))
        session["history"] = prompt + tokens(out)
        session["turn"] += 1
        if session["turn"] == session["turns"]:
            open_sessions.remove(session)
    return trace


def write_trace(path: str | Path, trace: list[TraceRequest]) -> None:
    """One JSON object a line: Mooncake's timestamp (milliseconds), input_length, output_length, hash_ids,
    plus session_id and turn."""
    with open(path, "w") as f:
        for r in trace:
            line = {"timestamp": r.timestamp * 1e3, "input_length": r.input_length, "output_length": r.output_length,
                    "hash_ids": r.hash_ids, "session_id": r.session_id, "turn": r.turn}  # fmt: skip
            f.write(json.dumps(line) + "\n")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a JSON-lines trace (write_trace's, or a Mooncake trace file: session_id and turn
    are optional). A line without a required field gets a ValueError naming the line and the field."""
    trace = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in r]
        if missing:
            raise ValueError(f"{path}:{number}: a trace line needs {missing}; it has {sorted(r)}")
        trace.append(TraceRequest(r["timestamp"] / 1e3, r["input_length"], r["output_length"], list(r["hash_ids"]),
                                  r.get("session_id"), r.get("turn", 0)))  # fmt: skip
    return trace


def prompt_tokens(request: TraceRequest, block_size: int, vocab_size: int) -> list[int]:
    """input_length token ids in which block i is drawn from a generator seeded with hash_ids[i], so two
    requests sharing their first k hash ids share their first k blocks of tokens: what a replay sends
    when the trace kept only ids (the tokens differ from the originals; the reuse is the same)."""
    if len(request.hash_ids) * block_size < request.input_length:
        raise ValueError(
            f"{len(request.hash_ids)} hash ids of {block_size} tokens cannot cover {request.input_length} "
            "prompt tokens: is block_size the trace's?"
        )
    blocks = [np.random.default_rng(h).integers(vocab_size, size=block_size).tolist() for h in request.hash_ids]
    return [t for block in blocks for t in block][: request.input_length]
