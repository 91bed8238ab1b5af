"""The requests two widely used clients send, replayed with the official `openai` client: lm-evaluation-harness
(`local-completions`: a batch of token-id prompts with echo, max_tokens 1 and logprobs 1 to score them; text
prompts with five stop strings to generate) and NVIDIA AIPerf (streaming chat with max_completion_tokens and
stream_options.include_usage, reading usage.prompt_tokens_details.cached_tokens). References: the model's own
logits (a contiguous forward pass) and greedy or seeded decoding that recomputes the whole sequence."""

import random

import httpx
import pytest
import torch
from stage04_helpers import LiveServer, model_logprobs, random_prompts, reference_decode, wait_blocks_free

from labkit.testing import FP32_MARGIN, assert_decisive


@pytest.fixture(scope="module")
def server(impl, tokenizer):
    s = LiveServer(impl, tokenizer, max_waiting=64, request_timeout=30.0)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _prompts(seed: int, tokenizer, count: int, lo: int, hi: int) -> list[list[int]]:
    return random_prompts(seed, count, lo, hi, vocab_size=tokenizer.get_vocab_size())


def _greedy_text(server, tokenizer, prompt: list[int], n: int, eos: bool = True) -> str:
    """What greedy decoding writes in n tokens, up to the model's EOS (which the server stops at unless
    eos=False). The server batches and pages, so its sums round otherwise: each reference token must lead
    by more than FP32_MARGIN for an exact comparison of text to be sound (assert_decisive)."""
    seen = []
    out = reference_decode(server.model, prompt, n, seen=seen)
    stop = server.model.config.eos_token_id
    if eos and stop in out:
        out = out[: out.index(stop) + 1]  # the EOS too: where the server stops must be decisive as well
    assert_decisive(out, torch.stack(seen), FP32_MARGIN, f"the greedy reference after {prompt}")
    return tokenizer.decode(out[:-1] if eos and stop in out else out)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_batch_of_token_id_prompts_scores_each_prompt(server, client, seed, tokenizer):
    """lm-eval's loglikelihood request at --batch_size 4: prompt [[ids], [ids], [ids], [ids]], echo, max_tokens 1,
    logprobs 1, temperature 0. One choice per prompt, in order; each echoes its prompt's logprobs."""
    prompts = _prompts(seed, tokenizer, 4, 5, 40)
    r = client.completions.create(
        model="test-model", prompt=prompts, echo=True, max_tokens=1, logprobs=1, temperature=0, seed=1234
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3], f"seed={seed}: one choice per prompt: {r.choices}"
    for c in r.choices:
        ids = prompts[c.index]
        ref = model_logprobs(server.model, ids)
        lp = c.logprobs.token_logprobs
        assert len(lp) == len(ids) + 1 and lp[0] is None, f"seed={seed} prompt {c.index}: the prompt, then 1 token"
        want = [ref[t, ids[t + 1]].item() for t in range(len(ids) - 1)] + [ref[-1].max().item()]
        err = max(abs(g - w) for g, w in zip(lp[1:], want, strict=True))
        assert err < 1e-4, f"seed={seed} prompt {c.index}: logprobs {lp[1:]} != forward pass {want} (|d| {err:.2g})"
        assert c.text.startswith(tokenizer.decode(ids)), f"seed={seed} prompt {c.index}: echo returns its prompt"
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 4, f"seed={seed}: {r.usage}"
    assert wait_blocks_free(server.engine) == 0, f"seed={seed}: every prompt's blocks come back"


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_text_prompts_with_n_numbers_choices_prompt_by_prompt(server, client, tokenizer, stream):
    """vLLM's numbering: choice p * n + i is sample i of prompt p (sample i drawn as seed + i draws it)."""
    texts = ["Once upon a time", "The little fox", "In the quiet river"]
    body = dict(model="test-model", prompt=texts, n=2, max_tokens=5, temperature=1.0, seed=11)
    got: dict[int, str] = {}
    usage = []
    if stream:
        for chunk in client.completions.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        ):
            usage += [chunk.usage] if chunk.usage is not None else []
            for c in chunk.choices:
                got[c.index] = got.get(c.index, "") + c.text
        assert len(usage) == 1, f"stream={stream}: one usage chunk for the whole batch, got {len(usage)}"
    else:
        r = client.completions.create(**body, extra_body={"ignore_eos": True})
        got, usage = {c.index: c.text for c in r.choices}, [r.usage]
    assert sorted(got) == list(range(6)), f"stream={stream}: 3 prompts x n=2 are choices 0..5, got {sorted(got)}"
    for p, text in enumerate(texts):
        ids = tokenizer.encode(text).ids
        for i in range(2):
            want = reference_decode(server.model, ids, 5, generator=torch.Generator().manual_seed(11 + i))
            assert got[p * 2 + i] == tokenizer.decode(want), (
                f"stream={stream}: choice {p * 2 + i} must be sample {i} of prompt {p} ({text!r}): "
                f"{got[p * 2 + i]!r} vs {tokenizer.decode(want)!r}"
            )
    prompt_tokens = sum(len(tokenizer.encode(t).ids) for t in texts)
    assert usage[0].prompt_tokens == prompt_tokens and usage[0].completion_tokens == 30, f"stream={stream}: {usage}"


def test_a_batch_naming_a_bad_prompt_names_it(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": [[5, 6], [7, 100000]], "max_tokens": 1})
        ok = c.post("/v1/completions", json={"prompt": [[5, 6], [7, 8]], "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt.1", f"the second prompt's token id is bad: {r.text}"
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, f"the same batch, fixed: {ok.text}"
    assert wait_blocks_free(server.engine) == 0 and not server.engine.has_unfinished_requests(), "nothing is left"


@pytest.mark.parametrize("seed", [0, 1])
def test_five_stop_strings_stop_at_the_first_one_written(server, client, tokenizer, seed):
    """lm-eval's generate_until: a task's `until` strings plus the EOS text, five or more, as `stop`."""
    (prompt,) = _prompts(seed, tokenizer, 1, 6, 12)
    full = _greedy_text(server, tokenizer, prompt, 24)
    assert len(full) >= 8, f"seed={seed}: the reference output {full!r} is too short to hold a stop string"
    rng = random.Random(seed)
    start = rng.randrange(2, len(full) - 3)
    stops = ["\n\nQuestion:", "</s>", "<|im_end|>", "Q:", full[start : start + 2]]
    rng.shuffle(stops)
    r = client.completions.create(model="test-model", prompt=prompt, max_tokens=24, temperature=0, stop=stops)
    want = full[: min(full.find(s) for s in stops if s in full)]
    assert r.choices[0].text == want, f"seed={seed}: stops {stops}: {r.choices[0].text!r}, want {want!r} of {full!r}"
    assert r.choices[0].finish_reason == "stop", f"seed={seed}: {r.choices[0].finish_reason}"


def test_a_bad_stop_list_is_refused_for_its_real_reason(server):
    """`stop` is a string or a list of them: a list holding an empty string is refused for that, not as
    "not a valid string" (the union's first branch)."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "stop": ["a", "b", "c", "d", ""]})
        ok = c.post("/v1/completions", json={"prompt": "x", "stop": ["a", "b", "c", "d", "e"], "max_tokens": 2})
    err = r.json()["error"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None, f"five stop strings: {ok.text}"
    assert r.status_code == 400 and err["param"] == "stop.4", f"the fifth stop string: {r.status_code} {r.text}"
    assert "at least 1 character" in err["message"], f"the real reason is the empty string: {err['message']!r}"


def test_aiperf_streaming_chat_reports_usage_and_cached_tokens(server, client, tokenizer):
    """AIPerf's stock chat request: stream, stream_options.include_usage, max_completion_tokens. The second time
    the same conversation comes, its prompt's full blocks (all but the block holding the last token) come
    from the prefix cache, and usage.prompt_tokens_details.cached_tokens says how many."""
    rng = random.Random(3)
    words = " ".join(rng.choice(["fox", "river", "quiet", "night", "red", "small", "loved"]) for _ in range(40))
    messages = [{"role": "user", "content": words}]
    prompt = tokenizer.encode(f"user: {words}\nassistant:").ids  # no chat template: role lines
    block = server.engine.config.block_size
    cached, texts = [], []
    for _ in range(2):
        text, usage = "", []
        for chunk in client.chat.completions.create(
            model="test-model",
            messages=messages,
            max_completion_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            extra_body={"ignore_eos": True},
        ):
            usage += [chunk.usage] if chunk.usage is not None else []
            text += "".join(c.delta.content or "" for c in chunk.choices)
        assert len(usage) == 1, f"include_usage: one usage chunk, got {usage}"
        assert usage[0].prompt_tokens == len(prompt) and usage[0].completion_tokens == 7, f"{usage[0]}"
        cached.append(usage[0].prompt_tokens_details.cached_tokens)
        texts.append(text)
    assert cached == [0, (len(prompt) - 1) // block * block], (
        f"a {len(prompt)}-token prompt sent twice: cached_tokens {cached}; the second time every full block "
        f"of {block} before the last token is a hit"
    )
    want = _greedy_text(server, tokenizer, prompt, 7, eos=False)  # ignore_eos
    assert texts[0] == texts[1] == want, f"a hit changes nothing: {texts}, greedy {want!r}"
