"""§5 of lab3.ipynb (stage 04 part 2): the server picks an adapter by model name ("test-model:a" or vLLM's bare "a"),
lists them in /v1/models, answers 404 naming an unknown one, and serves concurrent requests of
several adapters through one slot, each equal to Hugging Face with its adapter merged by peft."""

import contextlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from stage04_helpers import PROMPT
from stage04_lora_helpers import ADAPTER_KINDS, peft_merged, save_random_adapter

from labkit.impl import load
from labkit.serving import serving
from labkit.testing import FP32_MARGIN, hf_greedy_variants, labkit_from_hf, random_llama


@pytest.fixture(scope="module")
def lora_server(tokenizer, tmp_path_factory):
    """A LoRAEngine with adapters "a" and "b" and ONE slot, so mixed traffic loads and evicts."""
    folder = tmp_path_factory.mktemp("adapters")
    hf = random_llama(3, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=256)
    save_random_adapter(hf, folder / "a", seed=1, std=0.15, **ADAPTER_KINDS["qv-r8"])
    save_random_adapter(hf, folder / "b", seed=2, std=0.15, **ADAPTER_KINDS["all-r4-rslora"])
    model = labkit_from_hf(hf)
    registry = load("stage04_batching.lora").AdapterRegistry(model.config, {"a": folder / "a", "b": folder / "b"}, max_loras=1)  # fmt: skip
    engine = load("stage04_batching.lora_engine").LoRAEngine(model, tokenizer, registry, num_blocks=128, max_num_seqs=8)  # fmt: skip
    app = load("stage04_batching.api_server").create_app(engine, tokenizer, model_name="test-model")
    refs = {None: hf, "a": peft_merged(hf, folder / "a"), "b": peft_merged(hf, folder / "b")}
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(serving(app, timeout=20)), refs, registry


def _reference(tokenizer, refs, adapter, prompt, n) -> set[str]:
    """HF's greedy texts with the adapter merged: its own, and those a server whose batches round otherwise
    may give where HF's logits have a near-tie (within FP32_MARGIN; adapter b on PROMPT has one, 1.5e-4)."""
    variants = hf_greedy_variants(refs[adapter], tokenizer.encode(prompt).ids, n, FP32_MARGIN)
    return {tokenizer.decode(v) for v in variants}


def test_models_lists_adapters_and_an_unknown_one_gets_404_naming_it(lora_server, tokenizer):
    from openai import NotFoundError, OpenAI

    url, refs, _ = lora_server
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["test-model", "test-model:a", "test-model:b"]
    for name in ("test-model:nope", "nope"):
        with pytest.raises(NotFoundError, match="nope"):
            client.completions.create(model=name, prompt=PROMPT, max_tokens=4)
    body = dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    for model, adapter in (("test-model:a", "a"), ("b", "b"), ("test-model", None)):
        text = client.completions.create(model=model, **body).choices[0].text
        want = _reference(tokenizer, refs, adapter, PROMPT, 8)
        assert text in want, f"seed=3: model {model!r} gave {text!r}; HF with adapter {adapter} merged: {want!r}"


@pytest.mark.parametrize("seed", [0, 1])
def test_concurrent_requests_of_several_adapters_through_one_slot(lora_server, tokenizer, seed):
    url, refs, registry = lora_server
    words = PROMPT.split()
    jobs = [(["test-model", "test-model:a", "test-model:b"][(i + seed) % 3], " ".join(words[: 2 + i % 5]), 3 + i % 4) for i in range(12)]  # fmt: skip
    loads_before = registry.num_loads

    def call(job):
        model, prompt, n = job
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, f"seed={seed}: {r.text}"
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(call, jobs))
    for (model, prompt, n), text in zip(jobs, texts, strict=True):
        adapter = model.partition(":")[2] or None
        want = _reference(tokenizer, refs, adapter, prompt, n)
        assert text in want, f"seed={seed}: {model} on {prompt!r} gave {text!r}; HF with its adapter merged: {want!r}"
    assert registry.num_loads > loads_before, f"seed={seed}: with one slot, mixed traffic must load adapters"
