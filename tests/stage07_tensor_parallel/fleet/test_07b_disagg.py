"""§2 of lab5.ipynb through the fleet: one prefill and one decode replica process behind the router, their
KV moving over torch.distributed (gloo), started once for this file. References: labkit.model's Llama
decoding greedily without a cache (the slow obvious version) for the outputs; the per-token KV bytes counted
by hand from the config (2 x layers x KV heads x head_dim x 4 bytes); the replicas' own counters for the
bytes sent and received, the prompt tokens each computed, and the slots in use."""

import concurrent.futures
import json
import random

import httpx
import pytest
from fleet_helpers import greedy

import labkit
from labkit import checkpoint
from labkit.model import from_pretrained

pytestmark = [pytest.mark.dist, pytest.mark.in_process("the test reads the router's state in this process")]

FLEET = "stage07_tensor_parallel.fleet.launch"
PAGE = 4
VOCAB = checkpoint.load_tokenizer(labkit.TARGET).get_vocab_size()


@pytest.fixture(scope="module")
def fleet(impl):
    mod = impl(FLEET)
    with mod.Fleet(labkit.TARGET, prefill=1, decode=1, policy="least_outstanding", num_slots=384, page_size=PAGE) as f:
        yield f


@pytest.fixture(scope="module")
def model():
    return from_pretrained(labkit.TARGET).eval()


def kv_bytes_per_token_by_hand(folder) -> int:
    c = checkpoint.read_config(folder)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4  # fp32 replicas


def complete(fleet, prompt: list[int], n: int, stream: bool) -> list[int]:
    """The completion's token ids (the prompts are ids, and so is what comes back, via the text)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=60.0)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, timeout=60.0) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    return text


def counters(fleet) -> tuple[dict, dict]:
    """(prefill replica's stats, decode replica's stats), once both are idle."""
    prefill, decode = fleet.wait_idle()
    return prefill, decode


def test_disaggregated_greedy_equals_the_model_and_moves_the_formulas_bytes(fleet, model):
    """Six requests, three at a time, half streamed: each prompt computed on the prefill replica, its KV
    sent to the decode replica, which computes only what its cache lacks and streams the same greedy text."""
    seed, n = 21, 8
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(9, 40))] for _ in range(6)]
    tok = checkpoint.load_tokenizer(labkit.TARGET)
    want = [tok.decode(greedy(model, p, n)) for p in prompts]
    p0, d0 = counters(fleet)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda i: complete(fleet, prompts[i], n, stream=bool(i % 2)), range(6)))
    for i in range(6):
        assert got[i] == want[i], (
            f"seed={seed}, prompt {i} ({'streamed' if i % 2 else 'whole'}): {got[i]!r} != {want[i]!r}"
        )
    p1, d1 = counters(fleet)
    whole = sum(len(p) // PAGE * PAGE for p in prompts)  # save_kv ships whole pages
    per_token = kv_bytes_per_token_by_hand(labkit.TARGET)
    sent = p1.get("kv_bytes_sent", 0) - p0.get("kv_bytes_sent", 0)
    received = d1.get("kv_bytes_received", 0) - d0.get("kv_bytes_received", 0)
    assert sent == received == whole * per_token, (
        f"seed={seed}: the prefill replica sent {sent} B, decode received {received} B; "
        f"{whole} whole-page prompt tokens x {per_token} B = {whole * per_token} B"
    )
    loaded = d1.get("kv_transfers_loaded", 0) - d0.get("kv_transfers_loaded", 0)
    assert loaded == 6, f"seed={seed}: the decode replica loaded {loaded} of 6 transfers: {d1}"
    computed = d1["prefill_tokens_computed"] - d0["prefill_tokens_computed"]
    tail = sum(len(p) - (len(p) - 1) // PAGE * PAGE for p in prompts)  # what a cache of whole pages lacks
    assert computed == tail, f"seed={seed}: decode computed {computed} prompt tokens, {tail} after the transfers"
    assert p1["slots_in_use"] == d1["slots_in_use"] == 0, f"slots still in use: prefill {p1}, decode {d1}"


@pytest.mark.parametrize("fault", ["garble"])
def test_a_broken_transfer_recomputes_and_the_next_one_still_moves(fleet, model, fault):
    """The next transfer is broken (a header no receiver accepts): decode computes the whole prompt and
    the output is unchanged; the one after it moves its KV again; no slot stays in use anywhere."""
    seed, n = 22, 6
    rng = random.Random(seed)
    broken, after = ([rng.randrange(3, VOCAB) for _ in range(rng.randrange(12, 30))] for _ in range(2))
    tok = checkpoint.load_tokenizer(labkit.TARGET)
    p0, d0 = counters(fleet)
    fleet.router.transfer_faults.append(fault)
    got = complete(fleet, broken, n, stream=True)
    assert got == tok.decode(greedy(model, broken, n)), f"seed={seed} {fault}: output after a failed transfer"
    p1, d1 = counters(fleet)
    computed = d1["prefill_tokens_computed"] - d0["prefill_tokens_computed"]
    failures = d1.get("kv_transfer_failures", 0) - d0.get("kv_transfer_failures", 0)
    assert failures == 1 and computed == len(broken), (
        f"seed={seed} {fault}: {failures} failures reported, decode computed {computed} of {len(broken)} prompt tokens"
    )
    assert p1["slots_in_use"] == d1["slots_in_use"] == 0, f"{fault}: slots still in use: prefill {p1}, decode {d1}"
    got = complete(fleet, after, n, stream=False)
    assert got == tok.decode(greedy(model, after, n)), f"seed={seed}: output of the request after the failure"
    p2, d2 = counters(fleet)
    computed = d2["prefill_tokens_computed"] - d1["prefill_tokens_computed"]
    assert computed == len(after) - (len(after) - 1) // PAGE * PAGE, (
        f"seed={seed}: after a failed transfer the next one did not serve decode's cache ({computed} computed)"
    )
    assert p2["slots_in_use"] == d2["slots_in_use"] == 0, f"slots still in use: prefill {p2}, decode {d2}"


def test_a_transfer_that_never_comes_times_out_and_the_pair_is_not_used_again(fleet, model):
    """Last in this file: a transfer that works, then one where the prefill replica sends nothing: decode
    gives up after the timeout and computes the prompt; gloo has closed that pair's channel, so the next
    request goes straight to decode. Nobody hangs, the outputs are unchanged, no slot stays in use."""
    seed, n = 23, 5
    rng = random.Random(seed)
    ok, first, second = ([rng.randrange(3, VOCAB) for _ in range(rng.randrange(12, 30))] for _ in range(3))
    tok = checkpoint.load_tokenizer(labkit.TARGET)
    assert complete(fleet, ok, n, stream=False) == tok.decode(greedy(model, ok, n)), f"seed={seed}: output"
    p0, d0 = counters(fleet)
    loaded = d0.get("kv_transfers_loaded", 0)
    fleet.router.transfer_timeout = 1.0
    fleet.router.transfer_faults.append("drop")
    for prompt in (first, second):
        got = complete(fleet, prompt, n, stream=False)
        assert got == tok.decode(greedy(model, prompt, n)), f"seed={seed}: output after a transfer timed out"
    p1, d1 = counters(fleet)
    assert loaded and d1.get("kv_transfers_loaded", 0) == loaded, f"seed={seed}: transfers loaded {loaded} -> {d1}"
    computed = d1["prefill_tokens_computed"] - d0["prefill_tokens_computed"]
    assert computed == len(first) + len(second), f"seed={seed}: decode computed {computed} prompt tokens"
    served = p1["prompt_tokens"] - p0["prompt_tokens"]
    assert served == len(first), f"seed={seed}: the prefill replica saw {served} prompt tokens, only the first's"
    assert fleet.router.broken_pairs == {("w0", "w1")}, f"broken pairs {fleet.router.broken_pairs}"
    assert p1["slots_in_use"] == d1["slots_in_use"] == 0, f"slots still in use: prefill {p1}, decode {d1}"


def test_a_dead_prefill_replica_leaves_decode_serving_alone(fleet, model):
    """Last of all: kill -9 the prefill replica, then ask at once. The router waits for its prefill leg until
    the replica is called dead, then decode computes the prompt itself: same output, nobody hangs."""
    seed, n = 24, 5
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(12, 30))] for _ in range(2)]
    tok = checkpoint.load_tokenizer(labkit.TARGET)
    _, d0 = counters(fleet)
    fleet.router.broken_pairs.clear()  # the test before closed the pair: here the router must try w0 again
    fleet.kill("w0")
    for i, prompt in enumerate(prompts):
        got = complete(fleet, prompt, n, stream=bool(i))
        assert got == tok.decode(greedy(model, prompt, n)), f"seed={seed}, prompt {i}: output without a prefill replica"
    (d1,) = fleet.wait_idle()  # the dead replica is left out
    computed = d1["prefill_tokens_computed"] - d0["prefill_tokens_computed"]
    assert computed == sum(map(len, prompts)), f"seed={seed}: decode computed {computed} prompt tokens"
    assert d1["slots_in_use"] == 0, f"slots still in use on decode: {d1}"
