"""§5 of lab2.ipynb: constrained decoding inside the engine and the OpenAI server.

References: the `jsonschema` package validates every output; the unconstrained distribution comes from
labkit's contiguous-cache model (checked against Hugging Face by tests/meta); Python's `re` checks
guided_regex outputs.
"""

import json
import random
import re
from importlib.util import find_spec

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from stage04_helpers import PROMPT, LiveServer, make_model

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer"},
            "pet": {"enum": ["cat", "dog", "owl"]},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "owner": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        },
        "required": ["ok", "tags"],
    },
]


@pytest.mark.parametrize("case", range(len(SCHEMAS)))
def test_every_sampled_generation_is_valid_against_its_schema(impl, tokenizer, case):
    """N requests, in one batch with unconstrained ones, sampled at temperature 1 from a random model
    (which knows nothing of JSON): every guided output is schema-valid and ends by itself."""
    engine_mod, sequence, structured = (impl(f"stage04_batching.{m}") for m in ("engine", "sequence", "structured"))
    schema = SCHEMAS[case]
    model = make_model(case, vocab_size=tokenizer.get_vocab_size())
    engine = engine_mod.LLMEngine(model, tokenizer, num_blocks=96, max_num_seqs=8)
    pattern = structured.schema_to_regex(schema)
    N = 12
    params = [sequence.SamplingParams(max_tokens=160, temperature=1.0, seed=i, guided_regex=pattern) for i in range(N)]
    params += [sequence.SamplingParams(max_tokens=8, temperature=1.0, seed=i) for i in range(4)]
    outs = engine.generate([PROMPT] * len(params), params)
    for i, out in enumerate(outs[:N]):
        assert out.finish_reason == "stop", f"case={case} seed={i}: a complete match ends the request: {out.text!r}"
        assert out.token_ids[-1] != model.config.eos_token_id or out.text, f"case={case} seed={i}"
        try:
            jsonschema.validate(json.loads(out.text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"case={case} seed={i}: {out.text!r} is not valid: {e}") from None
    free = [o.text for o in outs[N:]]
    assert not all(t.startswith("{") for t in free), f"case={case}: unconstrained rows were masked too: {free}"


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square, pooling categories with expected count < 5 into one bin."""
    expected = probs * counts.sum()
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    if (counts[~keep] > 0).any():
        return 0.0
    return float(chisquare(counts[keep], expected[keep]).pvalue)


@pytest.mark.parametrize("seed", [3])
def test_a_constraint_that_allows_everything_leaves_the_distribution_unchanged(impl, tokenizer, seed):
    """rb"[\\x00-\\xff]*" accepts every byte string: sampling through it must follow softmax(logits) over
    the text tokens and EOS (special tokens without bytes are never sampled under a constraint)."""
    engine_mod, sequence = impl("stage04_batching.engine"), impl("stage04_batching.sequence")
    model = make_model(seed, vocab_size=tokenizer.get_vocab_size())
    engine = engine_mod.LLMEngine(model, tokenizer, num_blocks=64, max_num_seqs=16)
    ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids]))[0, -1].float() / 0.9, -1).double().numpy()
    special = sorted(set(tokenizer.get_added_tokens_decoder()) - {model.config.eos_token_id})
    probs[special] = 0
    probs /= probs.sum()
    runs = 3000
    params = [
        sequence.SamplingParams(max_tokens=1, temperature=0.9, seed=seed * runs + i, guided_regex=rb"[\x00-\xff]*")
        for i in range(runs)
    ]
    counts = np.bincount([o.token_ids[0] for o in engine.generate([ids] * runs, params)], minlength=len(probs))
    assert counts[special].sum() == 0, f"seed={seed}: a special token without bytes was sampled under a constraint"
    p = chi2_pvalue(counts.astype(float), probs)
    assert p > 1e-3, f"seed={seed}: sampled tokens do not follow softmax(logits / T) (chi-square p={p:.2e})"


def test_a_guided_request_stops_itself_and_eos_waits_for_an_accepting_state(impl, tokenizer):
    """Greedy decoding of a random model under r"(ab|cd){2,3}": the output matches; with ignore_eos off
    the request ends with "stop" as soon as nothing but EOS could follow."""
    engine_mod, sequence = impl("stage04_batching.engine"), impl("stage04_batching.sequence")
    for seed in range(4):
        model = make_model(seed, vocab_size=tokenizer.get_vocab_size())
        engine = engine_mod.LLMEngine(model, tokenizer, num_blocks=32)
        rng = random.Random(seed)
        words = ["".join(rng.choice("abcdefgh") for _ in range(2)) for _ in range(2)]
        pattern = f"({words[0]}|{words[1]}){{2,3}}"
        out = engine.generate([PROMPT], sequence.SamplingParams(max_tokens=20, temperature=0, guided_regex=pattern))[0]
        assert re.fullmatch(pattern, out.text), f"seed={seed}: {out.text!r} does not match {pattern!r}"
        assert out.finish_reason == "stop", f"seed={seed}: {out.finish_reason}"
        assert len(out.text) == 6 or out.token_ids[-1] == model.config.eos_token_id, (
            f"seed={seed}: a request stops before the third repeat only by sampling EOS: {out.text!r}"
        )


@pytest.fixture(scope="module")
def server(impl, tokenizer):
    s = LiveServer(impl, tokenizer, max_waiting=64, request_timeout=60.0)
    yield s
    s.close()


def sampled_completion(client, seed: int, max_tokens: int, **extra_body):
    """A seeded temperature-1 /v1/completions request of PROMPT; extra_body carries the constraint."""
    return client.completions.create(
        model="test-model", prompt=PROMPT, max_tokens=max_tokens, temperature=1.0, seed=seed, extra_body=extra_body
    )


def test_openai_client_gets_schema_valid_json_from_both_endpoints(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in range(3):
        chat = client.chat.completions.create(
            model="test-model", messages=messages, max_tokens=120, temperature=1.0, seed=seed, response_format=fmt
        )
        text = chat.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        done = sampled_completion(client, seed, 120, response_format=fmt)
        jsonschema.validate(json.loads(done.choices[0].text), schema)
    pattern = r"(yes|no), [0-9]{2}"
    for seed in range(3):
        out = sampled_completion(client, seed, 20, guided_regex=pattern)
        assert re.fullmatch(pattern, out.choices[0].text), f"seed={seed}: {out.choices[0].text!r}"
        assert out.choices[0].finish_reason == "stop", f"seed={seed}"
    obj = client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    text = obj.choices[0].message.content
    assert text.startswith("{"), f"json_object output starts an object: {text!r}"
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text


def test_openai_client_parse_fills_a_nested_pydantic_model(server):
    """client.chat.completions.parse sends pydantic's schema (nested models as local $refs, Literal as
    an enum, bounds from Field) and parses the reply into the model."""
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Owner(BaseModel):
        id: int
        nick: str = Field(max_length=5)

    class Pet(BaseModel):
        name: str = Field(min_length=1, max_length=8)
        kind: Literal["cat", "dog", "owl"]
        ages: list[int] = Field(max_length=3)
        owner: Owner

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "A pet, please."}]
    for seed in range(2):
        reply = client.chat.completions.parse(
            model="test-model", messages=messages, max_tokens=150, temperature=1.0, seed=seed, response_format=Pet
        )
        pet = reply.choices[0].message.parsed
        assert isinstance(pet, Pet) and isinstance(pet.owner, Owner), f"seed={seed}: {reply.choices[0].message}"


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize(
    "fmt, feature",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a+"}}},
            "pattern",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"oneOf": [{"type": "string"}]}}}, "oneOf"),
    ],
    ids=["pattern", "oneOf"],
)
def test_an_unsupported_schema_feature_gets_400_naming_it(server, endpoint, fmt, feature):
    import httpx

    body = {"max_tokens": 5, "response_format": fmt}
    body.update({"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
    assert r.status_code == 400, (
        f"{endpoint}: an unsupported schema must not run unconstrained: {r.status_code} {r.text}"
    )
    error = r.json()["error"]
    assert feature in error["message"] and error["param"] == "response_format", error


@pytest.mark.parametrize("pattern", ["(yes|no", "^yes$", "(a|b)*a(a|b){14}"], ids=["unbalanced", "anchor", "explodes"])
def test_a_guided_regex_the_engine_cannot_compile_gets_400(server, pattern):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 5, "guided_regex": pattern}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, f"{pattern!r}: {r.status_code} {r.text}"
    assert r.json()["error"]["param"] == "guided_regex", r.json()


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(name, marks=pytest.mark.skipif(find_spec(name) is None, reason=f"needs {name} (make guided)"))
        for name in ("llguidance", "xgrammar")
    ],
)
def test_a_library_behind_the_guided_backend_interface_gives_valid_json_too(impl, tokenizer, backend):
    """`--guided-decoding-backend llguidance|xgrammar` (optional packages, `make guided`, which `make test`
    installs): the engine's guides come from the library instead of the course's token index, and every sampled
    output is still valid."""
    LibraryBackend = impl("stage04_batching.guided_backends").LibraryBackend
    engine_mod, sequence, structured = (impl(f"stage04_batching.{m}") for m in ("engine", "sequence", "structured"))
    schema = SCHEMAS[0]
    model = make_model(0, vocab_size=tokenizer.get_vocab_size())
    engine = engine_mod.LLMEngine(model, tokenizer, num_blocks=96, max_num_seqs=8)
    engine.guided_backend = LibraryBackend(backend, tokenizer, model.config.vocab_size, model.config.eos_token_id)
    pattern = structured.schema_to_regex(schema)
    params = [sequence.SamplingParams(max_tokens=160, temperature=1.0, seed=i, guided_regex=pattern) for i in range(6)]
    for i, out in enumerate(engine.generate([PROMPT] * len(params), params)):
        try:
            jsonschema.validate(json.loads(out.text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"backend={backend} seed={i}: {out.text!r} is not valid: {e}") from None
