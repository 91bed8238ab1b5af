"""A live server for tests, notebooks and the load test: uvicorn on a free loopback port, the fault
hook that makes a chosen request fail inside the engine (serve --fault-marker), and the wait that
cancels a request's work when its client disconnects (stage 04's server and stage 07's router)."""

import asyncio
import contextlib
import socket
import threading
import time

FAULT_MARKER = "<fault>"


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
