"""What stage 04's server and stage 07's fleet share: the checks a request must pass before it costs
anything (the server, the engine, the router and a replica call the same function), a live server for
tests, notebooks and the load test (uvicorn on a free loopback port), the fault hook that makes a chosen
request fail inside the engine (serve --fault-marker), and the wait that cancels a request's work when
its client disconnects."""

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Collection, Iterable, Sequence

FAULT_MARKER = "<fault>"


class RequestRefused(ValueError):
    """A request no engine of this size can serve; `param` names the field (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_request(
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    max_model_len: int,
    vocab_size: int,
    logit_bias: Iterable[int] = (),
    n: int = 1,
    max_num_seqs: int | None = None,
    prompt_param: str = "prompt",
) -> None:
    """Raise RequestRefused, naming the field, for a request that could never run: an empty prompt, a
    token id outside [0, vocab_size) (the prompt's or logit_bias's), n sequences over the batch's
    max_num_seqs, or prompt + max_tokens over max_model_len. prompt_param is what the client sent the
    prompt as ("messages" for a chat). The same checks, and messages, wherever a request enters."""
    if not prompt_ids:
        raise RequestRefused(prompt_param, f"{prompt_param}: the prompt is empty; send at least one token")
    if bad := [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]:
        raise RequestRefused(
            prompt_param, f"{prompt_param}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    if bad := [t for t in logit_bias if not 0 <= t < vocab_size]:
        raise RequestRefused(
            "logit_bias", f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    if max_num_seqs is not None and n > max_num_seqs:
        raise RequestRefused(
            "n", f"n: {n} samples exceed max_num_seqs={max_num_seqs}, the batch they must share; send fewer"
        )
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestRefused(
            prompt_param,
            f"{prompt_param}: prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
            f"{max_model_len} tokens; shorten the prompt or lower max_tokens",
        )


def invalid_field(errors: list[dict], names: Collection[str]) -> tuple[str | None, dict]:
    """The error of a pydantic ValidationError (`e.errors()`) that a 400 reports, and OpenAI's `param` for it.

    The param is the error's location without the tags pydantic gives union branches (`str`,
    `list[...]`, `function-after[...]`): field names (any in `names`) and list indices, `messages.0.role`;
    an unknown field is named in full, `stream_options.continuous_usage_stats`. Where a field is a union
    (`stop`: a string or a list of them), the error comes from the branch whose shape the value has: a
    list holding "" is too short, not "not a valid string"."""
    first = errors[0]
    same_field = [x for x in errors if x["loc"][:1] == first["loc"][:1]]
    first = next((x for x in same_field if not x["type"].endswith("_type")), first)
    *path, last = first["loc"] or [None]
    if first["type"] != "extra_forbidden":
        path, last = [*path, last], None
    parts = [str(p) for p in path if isinstance(p, int) or p in names] + ([str(last)] if last is not None else [])
    return ".".join(parts) or None, first


def fail_on_marker(tokenizer, marker: str = FAULT_MARKER):
    """An LLMEngine.fault_hook: raise inside the engine step for each request whose prompt holds `marker`."""

    def hook(seq) -> None:
        if marker in tokenizer.decode(seq.token_ids[: seq.num_prompt_tokens]):
            raise RuntimeError(f"injected fault: the prompt holds {marker!r}")

    return hook


@contextlib.contextmanager
def serving(app, timeout: float = 30.0):
    """Run an ASGI app with uvicorn on a free 127.0.0.1 port in a thread; yields its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start within {timeout} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


async def until_disconnected(request, work):
    """Await `work`, or cancel it and return None if the client disconnects first (vLLM's
    with_cancellation): the body has been read, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None
