"""A live server for tests, notebooks and the load test: uvicorn on a free loopback port, and the
fault hook that makes a chosen request fail inside the engine (serve --fault-marker)."""

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
