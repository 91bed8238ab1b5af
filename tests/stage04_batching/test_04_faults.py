"""The server survives every request: one request's fault ends that request only, a dead engine loop
answers everyone 503 at once, /health tells the truth, and clients that leave stop costing anything.
A real uvicorn on loopback; faults are injected with the engine's fault_hook and monkeypatching."""

import asyncio
import json
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from stage04_helpers import PROMPT, LiveServer, make_model, wait_blocks_free

from labkit.serving import FAULT_MARKER, fail_on_marker
from labkit.testing import FP32_MARGIN, assert_decisive, greedy_logits


@pytest.fixture
def server(impl, tokenizer):
    s = LiveServer(impl, tokenizer, max_waiting=64, request_timeout=30.0)
    yield s
    s.close()


async def _post(c: httpx.AsyncClient, body: dict) -> tuple[int, dict | list]:
    """(status, JSON body) of a plain request, or (status, [events]) of a streaming one."""
    if not body.get("stream"):
        r = await c.post("/v1/completions", json=body)
        return r.status_code, r.json()
    events = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return r.status_code, events


def _text(status, got) -> str:
    if isinstance(got, list):
        return "".join(e["choices"][0]["text"] for e in got if isinstance(e, dict) and "choices" in e)
    return got["choices"][0]["text"]


def _error(status, got) -> dict | None:
    """The OpenAI error of a response: its body's, or a stream's error event (before [DONE])."""
    if isinstance(got, list):
        errors = [e["error"] for e in got if isinstance(e, dict) and "error" in e]
        return errors[0] if errors and got[-1] == "[DONE]" else None
    return got.get("error")


def _run(server, bodies: list[dict], timeout: float = 30) -> list:
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=timeout) as c:
            return await asyncio.gather(*(_post(c, b) for b in bodies))

    return asyncio.run(main())


def _still_serving(server, seed: int = 0) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200, f"seed={seed}: /health must be 200 again"
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, f"seed={seed}: next request: {r.text}"
    assert wait_blocks_free(server.engine) == 0, f"seed={seed}: KV blocks still in use after the faults"


def _engine_module(server):
    return sys.modules[type(server.engine).__module__]


@pytest.mark.parametrize("where", ["forward", "sampling"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_request_failing_inside_the_step_fails_alone(impl, server, tokenizer, monkeypatch, where, seed):
    if where == "forward":  # the hook raises before the batch's forward pass: the engine isolates it
        server.engine.fault_hook = fail_on_marker(tokenizer)
    else:
        real = _engine_module(server).sample

        def sample(logits, params, generator=None):
            if params.seed == 666:
                raise FloatingPointError("injected: sampling blew up")
            return real(logits, params, generator)

        monkeypatch.setattr(_engine_module(server), "sample", sample)
    poison = {"prompt": f"{FAULT_MARKER} {PROMPT}", "max_tokens": 30, "temperature": 0.7, "seed": 666}
    bystanders = [
        {"prompt": PROMPT + " a dog", "max_tokens": 20, "temperature": 0.8, "seed": seed, "stream": True},
        {"prompt": "The little bird", "max_tokens": 24, "temperature": 0.8, "seed": seed + 10},
        {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True},
    ]
    results = _run(server, [poison, {**poison, "stream": True}, *bystanders])
    for (status, got), stream in zip(results[:2], ["plain", "stream"], strict=True):
        err = _error(status, got)
        expected = 200 if stream == "stream" else 500
        assert status == expected and err, f"seed={seed} {where}: the {stream} poison request: {status} {got}"
        assert err["type"] == "server_error" and err["message"], f"seed={seed}: an OpenAI error says why: {err}"
    Params = impl("stage04_batching.sequence").SamplingParams
    for body, (status, got) in zip(bystanders, results[2:], strict=True):
        params = Params(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed"))
        alone = server.offline.generate([body["prompt"]], params)[0]
        if body["temperature"] == 0:  # the batch rounds otherwise: the greedy text is exact only where it leads
            ids = tokenizer.encode(body["prompt"]).ids
            want = server.model.generate(ids, body["max_tokens"])  # labkit's contiguous cache, not the engine
            logits = greedy_logits(server.model, ids, want)
            assert_decisive(want, logits, FP32_MARGIN, f"seed={seed}: {body}")
            assert alone.token_ids == want, (
                f"seed={seed}: the engine alone gives {alone.token_ids}, the model's greedy tokens are {want}"
            )
        offline = alone.text
        assert status == 200 and _error(status, got) is None, f"seed={seed} {where}: bystander {body}: {got}"
        assert _text(status, got) == offline, f"seed={seed} {where}: a bystander's text changed: {body}"
    server.engine.fault_hook = None
    _still_serving(server, seed)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    counts = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert counts.get("error") == 2, f"seed={seed} {where}: /metrics must count the 2 failed requests once: {counts}"


def test_add_request_refusals_are_400_and_crashes_500(server, tokenizer, monkeypatch):
    real = server.engine.add_request

    def add_request(prompt, params=None, request_id=None):
        text = tokenizer.decode(prompt)
        if "<bad-input>" in text:
            raise ValueError("injected: the engine refuses this prompt")
        if "<crash>" in text:
            raise RuntimeError("injected: add_request crashed")
        return real(prompt, params, request_id)

    monkeypatch.setattr(server.engine, "add_request", add_request)
    bodies = [
        {"prompt": "<bad-input> x", "max_tokens": 4},
        {"prompt": "<crash> x", "max_tokens": 4, "stream": True},
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True},
    ]
    (bad_status, bad), (crash_status, crash), (ok_status, ok) = _run(server, bodies)
    assert bad_status == 400 and "refuses" in _error(bad_status, bad)["message"], f"a ValueError is a 400: {bad}"
    err = _error(crash_status, crash)
    assert err and err["code"] == 500 and "crashed" in err["message"], f"anything else is a 500: {crash}"
    assert ok_status == 200 and _error(ok_status, ok) is None, f"the bystander must finish: {ok}"
    _still_serving(server)


def test_a_batch_that_fails_whole_fails_fast_and_the_next_one_runs(server):
    def broken(seq):
        raise RuntimeError("injected: the model is broken")

    server.engine.fault_hook = broken
    bodies = [{"prompt": PROMPT + "!" * i, "max_tokens": 10, "stream": i % 2 == 1} for i in range(4)]
    results = _run(server, bodies)
    for body, (status, got) in zip(bodies, results, strict=True):
        err = _error(status, got)
        # The reason itself, not the 504 of the 30 s request timeout: the batch failed when it failed.
        assert err and "the model is broken" in err["message"], f"{body}: every request fails with the reason: {got}"
    server.engine.fault_hook = None
    _still_serving(server)


def _slow(seconds: float):
    def hook(seq):
        time.sleep(seconds)

    return hook


def test_a_killed_loop_answers_every_request_503_at_once_and_restarts(server):
    server.engine.fault_hook = _slow(0.01)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200, "/health is 200 before the fault"
    real = server.engine.scheduler.schedule
    calls = []

    def schedule():
        calls.append(1)
        if len(calls) == 12:  # well inside the requests below, after the loop has made progress
            raise RuntimeError("injected: the scheduler crashed")
        return real()

    server.engine.scheduler.schedule = schedule
    bodies = [{"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": i % 2 == 0} for i in range(4)]
    results = _run(server, bodies)
    for body, (status, got) in zip(bodies, results, strict=True):
        err = _error(status, got)
        # A 503 naming the crash, not the 504 of the request timeout: every request in flight heard of it.
        assert err and err["code"] == 503 and "scheduler crashed" in err["message"], f"{body}: {status} {got}"
    server.engine.fault_hook = None
    _still_serving(server)


def test_a_loop_that_cannot_restart_stays_visibly_unhealthy(server, monkeypatch):
    def crash():
        raise RuntimeError("injected: the scheduler crashed")

    def cannot_abort():
        raise RuntimeError("injected: abort failed")

    monkeypatch.setattr(server.engine.scheduler, "schedule", crash)
    monkeypatch.setattr(server.engine, "abort_all", cannot_abort)
    status, got = _run(server, [{"prompt": PROMPT, "max_tokens": 5}])[0]
    assert status == 503 and "scheduler crashed" in got["error"]["message"], f"the request in flight: {got}"
    with httpx.Client(base_url=server.url, timeout=30) as c:
        health = c.get("/health")
        after = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
    assert health.status_code == 503 and "abort failed" in health.json()["reason"], f"/health: {health.text}"
    assert after.status_code == 503, f"a new request is refused at once while the engine is down: {after.text}"


def test_health_reports_a_stalled_engine_step(impl, tokenizer):
    server = LiveServer(impl, tokenizer, stall_timeout=0.3)
    try:
        server.engine.fault_hook = _slow(3.0)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}) as r:
                deadline = time.time() + 2.5  # the first step stays inside the 3 s hook until then
                while (stalled := c.get("/health")).status_code == 200 and time.time() < deadline:
                    time.sleep(0.05)
                r.read()
            server.engine.fault_hook = None
            wait_blocks_free(server.engine)
            healthy = c.get("/health")
        assert stalled.status_code == 503 and "running" in stalled.json()["reason"], f"stalled: {stalled.text}"
        assert healthy.status_code == 200, f"once steps progress again /health is 200: {healthy.text}"
    finally:
        server.close()


def test_non_streaming_clients_that_leave_abort_their_requests(server):
    server.engine.fault_hook = _slow(0.005)  # 8 requests x 200 tokens would take at least 8 s to run out
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def leave(c):
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/completions", json=body, timeout=0.3)

    async def main():
        async with httpx.AsyncClient(base_url=server.url) as c:
            await asyncio.gather(*(leave(c) for _ in range(8)))

    asyncio.run(main())
    used = wait_blocks_free(server.engine, seconds=2.0)
    assert used == 0 and not server.engine.has_unfinished_requests(), (
        f"8 non-streaming clients left; 2 s later {used} KV blocks are still in use"
    )
    with httpx.Client(base_url=server.url, timeout=30) as c:
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    counts = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    tokens = sum(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))
    assert counts.get("abort") == 8, f"each of the 8 requests must be aborted, not run out: {counts}"
    assert tokens < 8 * 200, f"{tokens} tokens were generated for clients that had left"
    server.engine.fault_hook = None
    _still_serving(server)


def _counts(server) -> tuple[dict, float]:
    """(requests by status, generated tokens) from the server's /metrics."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    counts = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    tokens = sum(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))
    return counts, tokens


def test_streaming_clients_that_leave_after_one_chunk_abort_their_requests(server):
    server.engine.fault_hook = _slow(0.005)  # 8 requests x 200 tokens would take at least 8 s to run out
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}

    async def leave(c):
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then the client closes the connection

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            await asyncio.gather(*(leave(c) for _ in range(8)))

    asyncio.run(main())
    used = wait_blocks_free(server.engine, seconds=2.0)
    counts, tokens = _counts(server)
    assert used == 0 and counts.get("abort") == 8, (
        f"8 streaming clients left after one chunk; 2 s later {used} KV blocks in use, requests by status {counts}: "
        "stream_events must abort the request when its client goes"
    )
    assert tokens < 8 * 200, f"{tokens} tokens were generated for clients that had left"
    server.engine.fault_hook = None
    _still_serving(server)


def test_a_stream_ends_with_the_finish_reason_even_when_its_last_output_adds_no_text(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        plain = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0}).json()
    text = plain["choices"][0]["text"]
    stop = text[12:15]  # mid-text: its first characters are held back, then cut, so the last output adds nothing
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [stop]}
    ((status, events),) = _run(server, [{**body, "stream": True}])
    chunks = [e for e in events if isinstance(e, dict)]
    reasons = [e["choices"][0]["finish_reason"] for e in chunks]
    assert status == 200 and events[-1] == "[DONE]", f"stop={stop!r}: the stream must end with [DONE]: {events[-3:]}"
    assert reasons[-1] == "stop" and reasons.count(None) == len(reasons) - 1, (
        f"stop={stop!r}: exactly one chunk, the last, carries the finish reason, even with no new text; got {reasons}"
    )
    assert _text(status, events) == text[: text.index(stop)], f"stop={stop!r}: streamed text"


@pytest.mark.parametrize("max_waiting", [1, 3])
def test_submit_admits_exactly_max_waiting_requests(impl, tokenizer, max_waiting):
    core_mod, engine_mod, seq_mod = (impl(f"stage04_batching.{m}") for m in ("async_engine", "engine", "sequence"))
    engine = engine_mod.LLMEngine(make_model(3, vocab_size=tokenizer.get_vocab_size()), tokenizer, num_blocks=16)

    async def main():  # no loop task: every submit stays waiting
        core = core_mod.AsyncEngine(engine, max_waiting=max_waiting)
        for _ in range(max_waiting):
            core.submit([1, 2, 3], seq_mod.SamplingParams(max_tokens=2))
        with pytest.raises(core_mod.QueueFull):
            core.submit([1, 2, 3], seq_mod.SamplingParams(max_tokens=2))

    asyncio.run(main())


def test_finished_requests_leave_no_queue_behind(server):
    bodies = [
        {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream} for stream in (False, True, False)
    ]
    results = _run(server, bodies)
    assert all(status == 200 for status, _ in results), results
    assert wait_blocks_free(server.engine) == 0
    assert server.core.queues == {}, (
        f"{len(server.core.queues)} queues of finished requests are still held: the loop must drop a request's "
        "queue once its last output is on it"
    )


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x \\udfff"}]}', "messages.0.content"),
        ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
        ("/v1/completions", b'{"prompt": "x", "temperature": 1e-40}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 0}', "top_p"),
        ("/v1/completions", b'{"prompt": "x", "top_k": -1}', "top_k"),
        ("/v1/completions", b'{"prompt": "x", "seed": 1180591620717411303424}', "seed"),
        ("/v1/completions", b'{"prompt": "x", "stop": ""}', "stop"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["a", "b", "c", "d", ""]}', "stop.4"),
        ("/v1/completions", b'{"prompt": "x", "n": 0}', "n"),
        ("/v1/completions", b'{"prompt": "x", "n": 9}', "n"),  # more than the server's max_num_seqs (8)
        ("/v1/completions", b'{"prompt": "x", "best_of": 2}', "best_of"),  # not implemented: never ignored
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": []}', "tools"),
        ("/v1/completions", b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty"),
        ("/v1/completions", b'{"prompt": "x", "frequency_penalty": -3}', "frequency_penalty"),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias"),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"100000": 1}}', "logit_bias"),
        ("/v1/completions", b'{"prompt": "x", "logprobs": 21}', "logprobs"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),  # only with echo
        ("/v1/completions", b'{"prompt": []}', "prompt"),
        ("/v1/completions", b'{"prompt": [5, 100000]}', "prompt"),
        (
            "/v1/completions",
            b'{"prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": true}}',
            "stream_options.continuous_usage_stats",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
            "top_logprobs",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith("/") else None,
)
def test_every_field_is_checked_against_its_real_domain(server, path, body, param):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, f"{body!r}: expected 400, got {r.status_code} {r.text}"
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], f"{body!r}: the error must name {param!r}: {err}"
    _still_serving(server)


def test_a_body_larger_than_the_context_is_refused_before_parsing(server, monkeypatch):
    def no_parsing(*args, **kwargs):
        raise AssertionError("the body was parsed")

    monkeypatch.setattr(json, "loads", no_parsing)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", content=b'{"prompt": "' + b"word " * 200_000 + b'"}')
    monkeypatch.undo()
    assert r.status_code == 413 and r.json()["error"]["message"], f"a 1 MB body: {r.status_code} {r.text[:200]}"
    _still_serving(server)


@pytest.mark.parametrize("body", [b"[" * 20_000, b'{"prompt": ' + b"[" * 20_000, b"\xff\xfe not utf-8"])
def test_malformed_json_is_a_400_not_a_crash(server, body):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"], f"{body[:20]!r}...: {r.status_code} {r.text[:200]}"
    _still_serving(server)
