"""The API surface real tools call: logprobs, echo with the prompt's logprobs, n > 1 on shared KV
blocks, penalties and logit_bias, usage in a stream (apply_penalties and logprobs_of alone: test_04_sampling). References come from the model's own logits,
computed here with labkit's contiguous forward pass, and from the official `openai` client's view."""

import random

import pytest
import torch
from stage04_helpers import (
    PROMPT,
    LiveServer,
    make_model,
    model_logprobs,
    random_prompts,
    reference_decode,
    wait_blocks_free,
)

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


def _params(impl, **kw):
    return impl("stage04_batching.sequence").SamplingParams(**kw)


def test_echo_returns_the_prompt_logprobs_of_a_forward_pass(server, client, tokenizer):
    """What lm-evaluation-harness's local-completions sends to score a continuation: token ids, echo,
    max_tokens 0, logprobs 1. Sent twice: the second time the prompt's blocks sit in the prefix cache,
    and the logprobs must still be computed, not skipped."""
    ids = tokenizer.encode(PROMPT + " a small red fox who loved the quiet river at night").ids
    ref = model_logprobs(server.model, ids)
    for attempt in range(2):
        r = client.completions.create(model="test-model", prompt=[ids], echo=True, max_tokens=0, logprobs=1)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == tokenizer.decode(ids), f"attempt {attempt}: echo returns the prompt, nothing more"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids), f"attempt {attempt}: {r.usage}"
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids), f"attempt {attempt}: {lp}"
        want = [ref[t, ids[t + 1]].item() for t in range(len(ids) - 1)]
        assert max(abs(g - w) for g, w in zip(lp.token_logprobs[1:], want, strict=True)) < 1e-4, (
            f"attempt {attempt}: prompt logprobs {lp.token_logprobs[1:]} != forward pass {want}"
        )
        for t in range(1, len(ids)):  # the most likely token and the chosen one (OpenAI: logprobs + 1 at most)
            # the server's most likely token: the reference's, or one within FP32_MARGIN of it (a near-tie)
            top = lp.top_logprobs[t]
            best = max(top, key=top.get)
            near = (ref[t - 1] >= ref[t - 1].max() - FP32_MARGIN).nonzero()[:, 0].tolist()
            assert best in {tokenizer.decode([i]) for i in near}, f"position {t}: top {best!r}, reference {near}"
            assert abs(top[best] - ref[t - 1].max().item()) < 1e-4, f"position {t}"
    assert wait_blocks_free(server.engine) == 0, "echo requests must free their blocks"


def test_chat_logprobs_and_top_logprobs_follow_the_model(server, client, tokenizer):
    r = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Tell me about the fox"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    prompt = tokenizer.encode("user: Tell me about the fox\nassistant:").ids  # no chat template: role lines
    out = reference_decode(server.model, prompt, 6)
    ref = model_logprobs(server.model, prompt + out)[len(prompt) - 1 :]
    # the server's batches sum in other orders: its names and order of the top 3 are the reference's only where
    # ranks 1 to 4 stand more than FP32_MARGIN apart, which holds for this prompt on every CPU
    gaps = -ref.topk(4).values.diff(dim=-1)
    assert gaps.min() > FP32_MARGIN, f"the reference has a near-tie in its top 4: gaps {gaps.min():.3g}"
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in out], "one entry per greedy token"
    for i, (entry, token) in enumerate(zip(content, out, strict=True)):
        assert abs(entry.logprob - ref[i, token].item()) < 1e-4, f"token {i}: {entry.logprob} vs {ref[i, token].item()}"
        top = ref[i].topk(3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, top.values.tolist(), strict=True)) < 1e-4


def test_penalties_and_logit_bias_follow_openai_semantics(server, client, tokenizer):
    """Greedy with presence/frequency penalties and a logit_bias: each step's argmax of the penalized logits
    of a whole-sequence forward pass (the output counts, not the prompt), through the openai client."""
    rng = random.Random(5)
    prompt = tokenizer.encode(PROMPT).ids
    banned, favoured = rng.sample(range(3, tokenizer.get_vocab_size()), 2)
    bias = {banned: -100.0, favoured: 2.0}
    presence, frequency = 0.8, 0.6

    def penalize(logits, out):
        logits = logits.clone()
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        for t, b in bias.items():
            logits[t] += b
        return logits

    seen = []
    want = reference_decode(server.model, prompt, 12, penalize, seen=seen)
    assert_decisive(want, torch.stack(seen), FP32_MARGIN, "penalized reference")  # so text compares exactly
    r = client.completions.create(
        model="test-model",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tokenizer.decode(want), (
        f"got {r.choices[0].text!r}, reference {tokenizer.decode(want)!r}"
    )
    assert favoured in want and banned not in want, f"bias {bias}: reference output {want}"


@pytest.mark.parametrize("seed", [0, 1])
def test_n_samples_fork_and_share_the_prompt_blocks(impl, seed):
    """n = 4 seeded samples of one prompt: after the prefill, every prompt block is held by all four
    sequences (one copy in the pool); the next step copies only the shared partial block, once per sibling.
    Sample i draws as a request seeded seed + i would (vLLM's rule)."""
    model = make_model(seed)
    (prompt,) = random_prompts(seed, 1, 37, 37)  # 2 full blocks of 16 and a partial one
    engine = impl("stage04_batching.engine").LLMEngine(model, num_blocks=32, max_num_seqs=8)
    rid = engine.add_request(
        prompt, _params(impl, n=4, max_tokens=6, temperature=1.0, seed=100 + seed, ignore_eos=True)
    )
    engine.step()  # prefill, fork, the first token of each
    seqs = [engine.requests[i] for i in [rid, f"{rid}-1", f"{rid}-2", f"{rid}-3"]]
    table = seqs[0].block_table
    assert all(s.block_table == table for s in seqs), f"seed={seed}: siblings share the parent's table {table}"
    refs = [engine.block_manager.blocks[b].ref_count for b in table]
    assert refs == [4, 4, 4] and engine.block_manager.num_used_blocks == 3, (
        f"seed={seed}: 3 prompt blocks, each held by 4 sequences; ref counts {refs}, "
        f"{engine.block_manager.num_used_blocks} blocks in use"
    )
    engine.step()  # each writes its first token's K/V into the shared partial block: copy-on-write
    assert [engine.block_manager.blocks[b].ref_count for b in table[:2]] == [4, 4], (
        f"seed={seed}: full blocks stay shared"
    )
    assert engine.block_manager.num_used_blocks == 3 + 3, f"seed={seed}: one private copy of the last block per sibling"
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    for o in sorted(outs, key=lambda o: o.index):
        want = reference_decode(model, prompt, 6, generator=torch.Generator().manual_seed(100 + seed + o.index))
        assert o.token_ids == want, (
            f"seed={seed}: sample {o.index} drew {o.token_ids}, seed {100 + seed + o.index} draws {want}"
        )
    assert engine.block_manager.num_used_blocks == 0, f"seed={seed}: all blocks back after the n samples finish"


def test_n_choices_and_usage_stream_through_the_openai_client(server, client, tokenizer):
    prompt = tokenizer.encode(PROMPT).ids
    body = dict(
        model="test-model", prompt=prompt, n=3, max_tokens=5, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    plain = client.completions.create(**body)
    assert sorted(c.index for c in plain.choices) == [0, 1, 2], f"one choice per sample: {plain.choices}"
    for c in plain.choices:
        want = reference_decode(server.model, prompt, 5, generator=torch.Generator().manual_seed(7 + c.index))
        assert c.text == tokenizer.decode(want), f"choice {c.index}: {c.text!r} vs the seed {7 + c.index} draw"
    assert plain.usage.completion_tokens == 15 and plain.usage.prompt_tokens == len(prompt), f"{plain.usage}"
    texts, usage = {}, []
    for chunk in client.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in plain.choices}, f"streamed {texts}"
    assert len(usage) == 1 and usage[0].choices == [], "include_usage: one last chunk, its choices empty"
    assert usage[0].usage.completion_tokens == 15, f"the usage chunk counts all 3 choices: {usage[0].usage}"
    assert wait_blocks_free(server.engine) == 0, "every sample's blocks come back"
