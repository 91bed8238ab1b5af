"""§8 (§1–§7 on the real model): SmolLM2-135M-Instruct through the learner's engine and server. Chats are
formatted with the chat template of the checkpoint's tokenizer_config.json, as the server applies it, and
compared with Hugging Face: its tokenizer's apply_chat_template for the prompt, its greedy generate for
the answer."""

import contextlib
import functools

import pytest

from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.serving import serving
from labkit.testing import REAL_MARGIN, assert_decisive, assert_hf_greedy, hf_greedy_logits, real_hf, real_labkit

pytestmark = [pytest.mark.real, pytest.mark.slow]  # loading SmolLM2 alone takes seconds

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three primary colors.",
]
CAPITAL = "The capital of France is Paris."  # SmolLM2's greedy answer (the issue's run); HF's is checked too
SYSTEM = (
    "You are a terse assistant for a course on LLM inference. Answer in one sentence, and never use a "
    "list. If you do not know, say so."
)


@pytest.fixture(scope="module")
def chat(impl):
    """prompt_ids(messages) -> the token ids the server feeds its engine for a chat."""
    protocol = impl("stage04_batching.protocol")
    folder = require_real_model()
    template, tok = protocol.load_chat_template(folder), load_tokenizer(folder)

    def prompt_ids(messages: list[dict]) -> list[int]:
        text = protocol.render_chat([protocol.ChatMessage(**m) for m in messages], template)
        return tok.encode(text).ids

    return prompt_ids


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(require_real_model())


def hf_chat_ids(messages: list[dict]) -> list[int]:
    """The prompt as transformers' tokenizer renders and encodes it (the independent reference)."""
    return list(hf_tokenizer().apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def until_eos(tokens: list[int]) -> list[int]:
    eos = real_hf().config.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_four_batched_chats_on_smollm2_equal_hf_greedy(impl, chat):
    engine_mod, sequence = impl("stage04_batching.engine"), impl("stage04_batching.sequence")
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [chat(m) for m in messages]
    engine = engine_mod.LLMEngine(real_labkit(), load_tokenizer(require_real_model()), num_blocks=32, max_num_seqs=4)
    params = sequence.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, [params] * len(prompts))
    for q, m, prompt, out in zip(QUESTIONS, messages, prompts, outs, strict=True):
        assert prompt == hf_chat_ids(m), f"seed=0: {q!r}: the chat template gives other ids than HF's tokenizer"
        assert_hf_greedy(out.token_ids, real_hf(), prompt, 12, REAL_MARGIN, f"seed=0: {q!r} batched with 3 chats")
    assert engine.block_manager.num_used_blocks == 0, "seed=0: finished requests left KV blocks in use"


def test_shared_system_prompt_hits_the_prefix_cache_on_smollm2(impl, chat):
    engine_mod, sequence = impl("stage04_batching.engine"), impl("stage04_batching.sequence")
    model, block = real_labkit(), 16
    a, b = (chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS[2:])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    engine = engine_mod.LLMEngine(model, load_tokenizer(require_real_model()), num_blocks=32, block_size=block)
    params = sequence.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = engine.generate([a], [params])[0]
    computed = []  # the token positions each forward pass computes
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: computed.append(args[0].numel()))
    try:
        second = engine.generate([b], [params])[0]
    finally:
        hook.remove()  # the model is shared with the other real tests
    hit = shared // block * block  # only full blocks are cached
    assert second.num_cached_tokens == hit, (
        f"seed=0: the chats share {shared} tokens (system prompt and template), {hit} of them in full "
        f"{block}-token blocks; num_cached_tokens={second.num_cached_tokens}"
    )
    prefill = sum(computed) - (len(second.token_ids) - 1)  # output tokens but the last are fed back once
    assert prefill == len(b) - hit, (
        f"seed=0: the second chat should prefill {len(b) - hit} tokens, it computed {prefill}"
    )
    for prompt, out in ((a, first), (b, second)):
        assert_hf_greedy(out.token_ids, real_hf(), prompt, 6, REAL_MARGIN, "seed=0: with the prefix cache")


@pytest.fixture(scope="module")
def server(impl):
    """The learner's server on SmolLM2, with the checkpoint's chat template, as make serve starts it."""
    folder = require_real_model()
    engine = impl("stage04_batching.engine").LLMEngine(real_labkit(), load_tokenizer(folder), num_blocks=64)
    api, protocol = impl("stage04_batching.api_server"), impl("stage04_batching.protocol")
    app = api.create_app(engine, load_tokenizer(folder), model_name=folder.name,
                         chat_template=protocol.load_chat_template(folder))  # fmt: skip
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(serving(app, timeout=30)), folder.name


def test_server_chat_on_smollm2_streamed_and_not_answers_as_hf(server):
    from openai import OpenAI

    url, name = server
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    done = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(p.choices[0].delta.content or "" for p in stream)
    text = done.choices[0].message.content
    assert streamed == text, f"seed=0: streamed chat {streamed!r}, plain chat {text!r}"
    ids = hf_chat_ids(messages)
    want, logits = hf_greedy_logits(real_hf(), ids, 16)
    assert_decisive(
        want[: len(until_eos(want)) + 1], logits, REAL_MARGIN, "seed=0: HF greedy on the chat"
    )  # so text compares exactly
    want = load_tokenizer(require_real_model()).decode(until_eos(want))
    assert text == want, f"seed=0: the server answered {text!r}; HF greedy on the same chat: {want!r}"
    assert text == CAPITAL, f"seed=0: SmolLM2 greedy should answer {CAPITAL!r}, the server gave {text!r}"
    assert done.choices[0].finish_reason == "stop", "seed=0: the answer ends with <|im_end|>, so finish_reason 'stop'"
    assert done.usage.prompt_tokens == len(ids), (
        f"seed=0: usage.prompt_tokens {done.usage.prompt_tokens}, HF {len(ids)}"
    )
