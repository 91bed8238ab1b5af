"""The OpenAI-compatible server, end to end: a real uvicorn on a free loopback port, real HTTP clients."""

import asyncio
import json
import random

import httpx
import pytest
from stage04_helpers import PROMPT, LiveServer, wait_blocks_free


@pytest.fixture(scope="module")
def server(impl, tokenizer):
    s = LiveServer(impl, tokenizer, max_waiting=64, request_timeout=30.0)
    yield s
    s.close()


def _sse(response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_text_equals_non_streamed_equals_offline_engine(impl, server, seed):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": seed}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        plain = c.post("/v1/completions", json=body)
        assert plain.status_code == 200, f"seed={seed}: {plain.text}"
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream"), "streams are server-sent events"
            events = _sse(r)
    assert events[-1] == "[DONE]", f"seed={seed}: a stream ends with data: [DONE]"
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    params = impl("stage04_batching.sequence").SamplingParams(max_tokens=24, temperature=0.8, seed=seed)
    offline = server.offline.generate([PROMPT], params)[0]
    text = plain.json()["choices"][0]["text"]
    assert streamed == text == offline.text, (
        f"seed={seed}: streamed {streamed!r}, plain {text!r}, offline {offline.text!r}"
    )
    assert events[-2]["choices"][0]["finish_reason"] == plain.json()["choices"][0]["finish_reason"]
    usage = plain.json()["usage"]
    assert usage["completion_tokens"] == len(offline.token_ids), f"seed={seed}: usage counts output tokens"


def test_openai_client_works_for_both_endpoints_streaming_and_not(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["test-model"]
    done = client.completions.create(model="test-model", prompt=PROMPT, max_tokens=12, temperature=0)
    parts = client.completions.create(model="test-model", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in parts) == done.choices[0].text, "streamed completion == plain"
    assert done.usage.completion_tokens >= 1 and done.choices[0].finish_reason in ("stop", "length")
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(model="test-model", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    streamed = "".join(p.choices[0].delta.content or "" for p in stream)
    assert streamed == chat.choices[0].message.content, "streamed chat == plain chat"
    assert chat.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
        ({"max_tokens": 5}, 400, "prompt"),
        ({"prompt": "word " * 300, "max_tokens": 5}, 400, "prompt"),
    ],
    ids=["max_tokens", "temperature", "missing-prompt", "too-long"],
)
def test_bad_requests_get_openai_style_errors(server, body, status, field):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json=body)
        ok = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == status, f"{body}: expected {status}, got {r.status_code} {r.text}"
    err = r.json()["error"]
    assert err["param"] == field and err["message"], f"{body}: the error must name {field!r}, got {err}"
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None, "the server keeps serving"


def test_invalid_json_is_a_400(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        ok = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 400 and "error" in r.json(), f"invalid JSON: got {r.status_code} {r.text}"
    assert ok.status_code == 200, "the server keeps serving"


def test_metrics_carry_vllms_names_and_count(server):
    """/metrics under vLLM's names, each series labelled with the served model, as dashboards query them."""
    from prometheus_client.parser import text_string_to_metric_families

    prompt = [5 + i % 50 for i in range(40)]  # 2 full blocks of 16 before the last token; no other test sends it
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").json()["status"] == "ok"
        before = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        for _ in range(2):
            c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    for name in [
        "vllm:request_success",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ]:
        assert name in families, f"/metrics lacks {name}; has {sorted(families)}"
        labels = {s.labels.get("model_name") for s in families[name].samples}
        assert labels == {"test-model"}, f"{name}: every series is labelled model_name=test-model, got {labels}"

    def total(fams, name: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name.endswith("_total")) if name in fams else 0.0

    grew = {
        n: total(families, n) - total(before, n)
        for n in ("vllm:generation_tokens", "vllm:prompt_tokens", "vllm:prefix_cache_hits")
    }
    assert grew == {"vllm:generation_tokens": 10, "vllm:prompt_tokens": 80, "vllm:prefix_cache_hits": 32}, (
        f"two 40-token requests of 5 tokens, the second reading 2 blocks of 16 from the prefix cache: {grew}"
    )
    stops = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert stops.get("length", 0) >= 2, f"requests that ran to max_tokens are counted as length: {stops}"


def test_queue_limit_answers_429_not_timeouts(impl, tokenizer):
    server = LiveServer(impl, tokenizer, max_waiting=2, request_timeout=30.0)
    try:
        body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0}
        # At most 2 requests may wait for admission; a burst of 24 overflows that at once.

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(24)))

        codes = [r.status_code for r in asyncio.run(burst())]
        refused = [r for r in codes if r == 429]
        assert refused, f"24 simultaneous requests with room for 8 running + 2 waiting must see 429s, got {codes}"
        assert set(codes) <= {200, 429}, f"only successes and 429s expected, got {codes}"
        assert codes.count(200) >= 2, f"the admitted requests must complete, got {codes}"
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, "once the queue drains requests are admitted again"
        assert wait_blocks_free(server.engine) == 0, "all blocks free after the burst"
    finally:
        server.close()


@pytest.mark.slow
def test_clients_disconnecting_mid_stream_leave_no_blocks_in_use(server):
    rng = random.Random(0)
    cuts = [rng.randint(0, 12) for _ in range(200)]
    statuses = []

    async def client(c, cut):
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen > cut:
                    break  # leaving the context closes the connection mid-stream

    async def main():
        limits = httpx.Limits(max_connections=50)
        timeout = httpx.Timeout(30, pool=180)  # 200 clients queue for 50 connections; slow on a loaded machine
        async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as c:
            await asyncio.wait_for(
                asyncio.gather(*(client(c, cut) for cut in cuts)), 180
            )  # a bound on a loaded machine, not a speed claim

    asyncio.run(main())
    assert statuses == [200] * 200, f"every client should have been streaming, got {set(statuses)}"
    used = wait_blocks_free(server.engine)
    assert used == 0, f"200 clients disconnected at random points; {used} KV blocks are still in use"
    assert not server.engine.has_unfinished_requests(), "every abandoned request must be aborted"


def test_chat_uses_the_checkpoints_chat_template(impl, tokenizer, tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    protocol = impl("stage04_batching.protocol")
    assert protocol.load_chat_template(tmp_path.parent) is None, "a folder without a template falls back"
    server = LiveServer(impl, tokenizer, chat_template=protocol.load_chat_template(tmp_path))
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "temperature": 0})
        rendered = "<s>[system] Be brief.\n[user] Tell me a story.\n[assistant]"
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered).ids), (
            f"the prompt must be the template's rendering {rendered!r}"
        )
    finally:
        server.close()
