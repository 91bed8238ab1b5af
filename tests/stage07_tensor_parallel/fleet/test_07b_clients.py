"""§3 of lab3.ipynb: what two widely used clients send, replayed against the fleet's router with the official
`openai` client: lm-evaluation-harness's generation (a prompt, temperature 0 and five stop strings) and
NVIDIA AIPerf's streaming chat (max_completion_tokens, stream_options.include_usage), the fields the
replicas cannot serve named in the 400, and /metrics. References: labkit.model's Llama decoding greedily
(fleet_helpers.greedy), cut at the first stop string by hand."""

import random

import httpx
import pytest
from fleet_helpers import greedy

import labkit
from labkit import checkpoint
from labkit.model import from_pretrained

pytestmark = [pytest.mark.dist, pytest.mark.in_process("the test reads the router's state in this process")]

PAGE = 4
VOCAB = checkpoint.load_tokenizer(labkit.TARGET).get_vocab_size()  # prompts that decode to text


@pytest.fixture(scope="module")
def fleet(cache_aware_fleet):
    """conftest's two replicas (page 4), shared with test_07b_fleet."""
    return cache_aware_fleet


@pytest.fixture(scope="module")
def client(fleet):
    from openai import OpenAI

    with OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model():
    return from_pretrained(labkit.TARGET).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return checkpoint.load_tokenizer(labkit.TARGET)


@pytest.mark.parametrize("seed", [0, 1])
def test_five_stop_strings_end_the_output_at_the_first_one_written(client, model, tokenizer, seed):
    """lm-eval's generate_until: a task's `until` strings and the EOS text, five in all, as `stop`; streamed
    and not, the output ends right before the first stop string the greedy text holds."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(6, 14))]
    full = tokenizer.decode(greedy(model, prompt, 24))
    start = rng.randrange(3, len(full) // 2)
    stops = ["\n\nQuestion:", "</s>", "<|im_end|>", "Q:", full[start : start + 3]]
    rng.shuffle(stops)
    want = full[: min(full.find(s) for s in stops if s in full)]
    body = dict(model="tiny-target", prompt=prompt, max_tokens=24, temperature=0, stop=stops, seed=1234)
    r = client.completions.create(**body, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop", (
        f"seed={seed}: stops {stops}: {r.choices[0].text!r} ({r.choices[0].finish_reason}), want {want!r} of {full!r}"
    )
    parts = client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].text for p in parts if p.choices) == want, f"seed={seed}: streamed != {want!r}"


def test_aiperf_streaming_chat_gets_its_usage_chunk_and_cached_tokens(fleet, client, model, tokenizer):
    """AIPerf's stock chat request: stream, stream_options.include_usage and max_completion_tokens. Sent twice,
    the second time its prompt's pages come from the replica's prefix cache, and cached_tokens says so."""
    rng = random.Random(7)
    content = " ".join(rng.choice(["fox", "river", "quiet", "night", "red", "small"]) for _ in range(30))
    ids = tokenizer.encode(f"user: {content}\nassistant:").ids  # the tiny target has no chat template
    out = greedy(model, ids, 6)
    eos = model.config.eos_token_id
    out = out[: out.index(eos) + 1] if eos in out else out  # the replica stops at EOS, which usage counts
    want = [t for t in out if t != eos]
    cached = []
    for _ in range(2):
        text, usage = "", []
        for chunk in client.chat.completions.create(
            model="tiny-target",
            messages=[{"role": "user", "content": content}],
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
        ):
            usage += [chunk.usage] if chunk.usage is not None else []
            text += "".join(c.delta.content or "" for c in chunk.choices)
        assert text == tokenizer.decode(want), f"{text!r} != greedy {tokenizer.decode(want)!r}"
        assert len(usage) == 1, f"include_usage: one usage chunk, got {usage}"
        u = usage[0]
        assert u.prompt_tokens == len(ids) and u.completion_tokens == len(out), f"{u}"
        cached.append(u.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and 0 < cached[1] < len(ids) and cached[1] % PAGE == 0, (
        f"a {len(ids)}-token prompt sent twice: cached_tokens {cached}; the second time whole pages of {PAGE} hit"
    )


@pytest.mark.parametrize(
    "path, body, param, why",
    [
        ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"continuous": True}},
         "stream_options.continuous", "implement"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {}},
         "structured_outputs", "implement"),
        ("/v1/completions", {"prompt": [5, 6], "echo": True, "max_tokens": 1}, "echo", "no prompt logprobs"),
        ("/v1/completions", {"prompt": [5, 6], "logprobs": 1}, "logprobs", "computes no logprobs"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", ""]}, "stop.4", "at least 1 character"),
        ("/v1/completions", {"prompt": [5, 10**6]}, "prompt", "vocabulary"),
        ("/v1/completions", {"prompt": [[5, 6], [7, 8]], "max_tokens": 1}, "prompt", "one per request"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens", "greater than"),
    ],
    ids=["stream_options", "structured_outputs", "echo", "logprobs", "stop", "vocabulary", "batch", "max_completion_tokens"],
)  # fmt: skip
def test_a_field_the_fleet_cannot_serve_is_named(fleet, path, body, param, why):
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        r = c.post(path, json=body)
        ok = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, f"{body}: the 400 must name {param!r}: {r.text}"
    assert why in err["message"], f"{body}: the message must say why ({why!r}): {err['message']!r}"
    assert ok.status_code == 200, f"the router keeps serving: {ok.text}"


def test_metrics_count_what_the_clients_saw(fleet):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(c) -> dict:
        return {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}

    def total(families, name, **labels) -> float:
        samples = families[name].samples if name in families else []
        return sum(s.value for s in samples if s.name.endswith("_total") and labels.items() <= s.labels.items())

    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        before = scrape(c)
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": [9, 8, 7, 6], "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200, r.text
        after = scrape(c)
    for name in ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:num_requests_running"]:
        assert name in after, f"/metrics lacks {name}: {sorted(after)}"
    grew = {n: total(after, n) - total(before, n) for n in ("vllm:generation_tokens", "vllm:prompt_tokens")}
    assert grew == {"vllm:generation_tokens": 15, "vllm:prompt_tokens": 12}, f"3 requests of 4 + 5 tokens: {grew}"
    done = total(after, "vllm:request_success", finished_reason="length") - total(
        before, "vllm:request_success", finished_reason="length"
    )
    assert done == 3, f"3 requests ran to max_tokens: {done}"
    healthy = [s.value for s in after["fleet_replicas"].samples if s.labels["state"] == "healthy"]
    assert healthy == [2], f"both replicas are healthy: {healthy}"
