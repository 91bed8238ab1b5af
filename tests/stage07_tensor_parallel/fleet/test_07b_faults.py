"""§4–§5 of lab3.ipynb: a fleet that survives a dead replica (requests move, a circuit breaker) and refuses
work it cannot start in time (admission control). References: a fake clock for the breaker, exact
arithmetic for the TTFT estimate, labkit.model's Llama decoding greedily without a cache (the slow obvious
version) for the streams, and the replicas' own counters for slots and finished requests."""

import concurrent.futures
import json
import random
import threading
import time

import httpx
import pytest
from fleet_helpers import greedy

import labkit
from labkit import checkpoint
from labkit.model import from_pretrained
from labkit.serving import serving

FLEET = "stage07_tensor_parallel.fleet.launch"
BREAKER = "stage07_tensor_parallel.fleet.breaker"
ADMISSION = "stage07_tensor_parallel.fleet.admission"
POLICIES = "stage07_tensor_parallel.fleet.policies"
VOCAB = checkpoint.load_tokenizer(labkit.TARGET).get_vocab_size()  # prompts that decode to text
DEAD_AFTER = 1.0  # seconds of silence before the router calls a replica dead


def test_circuit_breaker_opens_probes_and_closes(impl):
    """closed -> open after 3 failures in a row -> half-open after the cooldown (one probe) -> open again
    on the probe's failure, closed on its success. The clock is a number the test passes."""
    b = impl(BREAKER).CircuitBreaker(failure_threshold=3, cooldown=5.0)
    t = 100.0
    assert b.allow(t) and b.state == "closed"
    b.record_failure(t)
    b.record_failure(t + 1)
    b.record_success(t + 2)  # a success between failures: they are not consecutive
    b.record_failure(t + 3)
    b.record_failure(t + 4)
    assert b.state == "closed" and b.allow(t + 4), "2 failures after a success must not open (threshold 3)"
    b.record_failure(t + 5)
    assert b.state == "open", "the 3rd consecutive failure must open the breaker"
    assert not b.allow(t + 5) and not b.allow(t + 9.9), "open: no request before the cooldown has passed"
    b.record_failure(t + 8)  # a late failure while open does not restart the cooldown
    assert b.allow(t + 10) and b.state == "half_open", "after the cooldown: half-open, and one probe may go"
    assert not b.allow(t + 10.1), "half-open lets exactly one probe go"
    b.record_failure(t + 11)
    assert b.state == "open", "a failed probe opens the breaker again"
    assert not b.allow(t + 15.9), "a failed probe restarts the cooldown from its own time"
    assert b.allow(t + 16) and b.state == "half_open"
    b.record_success(t + 16.5)
    assert b.state == "closed" and b.allow(t + 16.5), "a successful probe closes the breaker"
    b.record_failure(t + 17)
    b.record_failure(t + 18)
    assert b.state == "closed", "closing must reset the failure count"
    one = impl(BREAKER).CircuitBreaker(failure_threshold=1, cooldown=0.0)
    one.record_failure(t)
    assert one.state == "open" and one.allow(t) and one.state == "half_open", "threshold 1, cooldown 0"


@pytest.mark.parametrize("seed", [0, 1])
def test_admission_estimates_ttft_and_refuses_past_the_slo(impl, seed):
    """Costs that are powers of two make the float arithmetic exact, so the edge (estimate == SLO) is tested."""
    worker_state = impl(POLICIES).WorkerState
    rng = random.Random(seed)
    prefill, decode, slo = 2.0**-7, 2.0**-4, 1.0
    control = impl(ADMISSION).AdmissionControl(ttft_slo=slo, prefill_s_per_token=prefill, decode_s_per_request=decode)
    for _ in range(200):
        workers = [
            worker_state(f"w{i}", outstanding=rng.randrange(0, 8), queued_prefill_tokens=rng.randrange(0, 160))
            for i in range(rng.randrange(1, 4))
        ]
        prompt = rng.randrange(1, 64)
        want = [(w.queued_prefill_tokens + prompt) * prefill + w.outstanding * decode for w in workers]
        got = [control.estimate_ttft(w, prompt) for w in workers]
        assert got == want, f"seed={seed}: estimates {got} != {want} for {workers}, prompt {prompt}"
        assert control.decide(workers, prompt) == (min(want) <= slo, min(want)), f"seed={seed}: {workers}, {prompt}"
    edge = worker_state("w0", outstanding=8, queued_prefill_tokens=0)  # 64 x 2^-7 + 8 x 2^-4 = 1.0 exactly
    assert control.decide([edge], 64) == (True, 1.0), "an estimate equal to the SLO meets it"
    assert control.decide([], 1) == (False, float("inf")), "no healthy replica: refuse"


@pytest.fixture(scope="module")
def fleet(impl):
    """Shared by §4's tests, which kill its replicas one after another."""
    breaker = impl(BREAKER).CircuitBreaker
    with impl(FLEET).Fleet(
        labkit.TARGET, replicas=3, policy="round_robin", num_slots=384, page_size=4, dead_after=DEAD_AFTER,
        breaker=lambda: breaker(failure_threshold=2, cooldown=1.0),
    ) as f:  # fmt: skip
        yield f


@pytest.fixture(scope="module")
def model():
    return from_pretrained(labkit.TARGET).eval()


def alive(fleet) -> list[str]:
    return [name for name, w in fleet.router.workers.items() if fleet.procs[int(name[1:])].poll() is None]


def books(fleet) -> list[tuple[int, int, int]]:
    return [
        (w.state.outstanding, w.state.active_tokens, w.state.queued_prefill_tokens)
        for w in fleet.router.workers.values()
    ]


def finished_by_length(fleet) -> int:
    return sum(s["finish_reasons"].get("length", 0) for s in fleet.wait_idle())


@pytest.mark.dist
def test_a_flood_past_the_ttft_slo_gets_429_and_the_rest_completes(cache_aware_fleet, impl):
    """24 requests at once against an SLO that lets each replica run two: the others get 429 with Retry-After
    before reaching any replica; the accepted ones complete, and no slot is in use after. On conftest's
    two-replica fleet: handout order runs §5 after §4 has killed this file's own fleet's replicas."""
    fleet = cache_aware_fleet
    router, seed = fleet.router, 7
    rng = random.Random(seed)
    # a 20-token prompt costs 0.4 s and each running request 0.35 s: 1 s admits at most 2 per replica
    control = impl(ADMISSION).AdmissionControl(ttft_slo=1.0, prefill_s_per_token=0.02, decode_s_per_request=0.35)
    two_running = impl(POLICIES).WorkerState("w", outstanding=2)
    assert not control.decide([two_running], 20)[0], "the SLO must refuse a third request on a replica"
    router.admission = control
    prompts = [[rng.randrange(3, VOCAB) for _ in range(20)] for _ in range(24)]
    before = finished_by_length(fleet)

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        return httpx.post(fleet.url + "/v1/completions", json=body, timeout=60)

    try:
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            replies = list(pool.map(ask, prompts))
    finally:
        router.admission = None
    codes = [r.status_code for r in replies]
    assert set(codes) == {200, 429}, f"seed={seed}: status codes {codes}"
    for r in replies:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and "SLO" in r.json()["error"]["message"], r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 40, r.text
    ran = finished_by_length(fleet) - before
    assert ran == codes.count(200), (
        f"seed={seed}: {codes.count(429)} refused, yet replicas ran {ran} for {codes.count(200)} accepted"
    )
    stats = fleet.wait_idle()
    assert all(s["slots_in_use"] == 0 for s in stats), f"after the flood: {stats}"
    assert books(fleet) == [(0, 0, 0)] * len(books(fleet)), f"the router still counts {books(fleet)}"


def stream_chunks(fleet, body, on_chunk=None, timeout=60.0) -> tuple[str, list[dict], bool]:
    """(text, error events, whether it ended with [DONE]) of a streamed completion; on_chunk(k) after the k-th."""
    text, errors, done = "", [], False
    with httpx.stream("POST", fleet.url + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        chunks = 0
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                else:
                    text += chunk["choices"][0]["text"]
                chunks += 1
                if on_chunk:
                    on_chunk(chunks)
    return text, errors, done


def kill_the_one_serving(fleet, killed: list[str]):
    def on_chunk(k):
        if k == 3 and not killed:
            (flight,) = fleet.router.flights.values()
            killed.append(flight.worker.state.name)
            fleet.kill(killed[0])

    return on_chunk


@pytest.mark.in_process("the replica runs in a thread of this process, its engine's step slowed by the test")
def test_a_step_longer_than_dead_after_is_not_death(impl, model):
    """A replica's first step (a long prefill on a loaded machine) runs 2.5 x dead_after: its heartbeat goes on
    from its own thread, so the router neither takes it for dead nor moves or fails the request, and two
    requests sent meanwhile answer the model's greedy text."""
    engine = impl("stage07_tensor_parallel.fleet.replica_engine").ReplicaEngine(model, num_slots=256, page_size=4)
    step, slow = engine.step, [2.5 * DEAD_AFTER]

    def slow_step():
        if slow:
            time.sleep(slow.pop())
        return step()

    engine.step = slow_step
    replica = impl("stage07_tensor_parallel.fleet.replica").Replica(engine, "w0", 4, "127.0.0.1", 0, 0)
    thread = threading.Thread(target=replica.run, daemon=True)
    thread.start()
    tokenizer = checkpoint.load_tokenizer(labkit.TARGET)
    app = impl("stage07_tensor_parallel.fleet.router").create_app(
        [f"tcp://127.0.0.1:{replica.port}"], tokenizer, policy="round_robin", dead_after=DEAD_AFTER
    )
    rng = random.Random(31)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(9)] for _ in range(2)]
    try:
        with serving(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
            body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
            replies = list(pool.map(lambda p: httpx.post(url + "/v1/completions", json={**body, "prompt": p},
                                                         timeout=60), prompts))  # fmt: skip
            fleet = app.state.fleet
            assert not slow, "the slow step never ran"
            for r, p in zip(replies, prompts, strict=True):
                assert r.status_code == 200, f"a {2.5 * DEAD_AFTER} s step with dead_after {DEAD_AFTER}: {r.text}"
                assert r.json()["choices"][0]["text"] == tokenizer.decode(greedy(model, p, 5)), r.text
            assert fleet.moved == 0 and fleet.workers["w0"].alive, "a replica busy with a long step is alive"
    finally:
        replica.close()
        thread.join(10)
    assert not thread.is_alive(), "Replica.close() stops its loop"


@pytest.mark.dist
def test_kill_9_mid_stream_the_greedy_stream_goes_on_unchanged(fleet, model):
    """The replica serving a long greedy stream is killed after a few tokens: the router moves the request
    (prompt + tokens received) to a live replica, and the client's text equals an uninterrupted run."""
    seed, n = 19, 120
    rng = random.Random(seed)
    prompt = [rng.randrange(3, VOCAB) for _ in range(12)]
    want = checkpoint.load_tokenizer(labkit.TARGET).decode(greedy(model, prompt, n))
    assert len(alive(fleet)) >= 2, f"the test needs two live replicas, has {alive(fleet)}"
    moved, killed = fleet.router.moved, []
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    text, errors, done = stream_chunks(fleet, body, kill_the_one_serving(fleet, killed))
    assert killed, "the stream ended before the test could kill its replica"
    assert not errors and done, f"seed={seed}: the stream failed after {killed[0]} was killed: {errors}"
    assert fleet.router.moved == moved + 1, (
        f"seed={seed}: the request was not moved (moves {fleet.router.moved - moved})"
    )
    assert text == want, f"seed={seed}: after killing {killed[0]} the stream says {text!r}, the model {want!r}"
    assert not fleet.router.workers[killed[0]].alive, f"{killed[0]} was killed but the router counts it alive"


@pytest.mark.dist
def test_a_dead_replica_leaves_the_rotation_and_later_requests_succeed(fleet, model):
    """Kill an idle replica, then send requests at once (those routed to it before the router notices move
    on), then more: all answer the model's greedy text, and the dead one serves none of the later ones."""
    names = alive(fleet)
    assert len(names) >= 2, f"the test needs two live replicas, has {names}"
    victim, seed = names[0], 23
    fleet.kill(victim)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(10)] for _ in range(6)]
    tokenizer = checkpoint.load_tokenizer(labkit.TARGET)
    want = [tokenizer.decode(greedy(model, p, 8)) for p in prompts]

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        return httpx.post(fleet.url + "/v1/completions", json=body, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = list(pool.map(ask, prompts[:3]))
    served = fleet.router.workers[victim].served
    later = [ask(p) for p in prompts[3:]]
    for i, r in enumerate(first + later):
        assert r.status_code == 200, f"seed={seed}: request {i} after killing {victim}: {r.status_code} {r.text}"
        assert r.json()["choices"][0]["text"] == want[i], f"seed={seed}: request {i}: {r.text} != {want[i]!r}"
    assert fleet.router.workers[victim].served == served, f"{victim} is dead but was sent a request"
    stats = httpx.get(fleet.url + "/fleet/stats", timeout=30).json()
    dead = [w for w in stats["workers"] if w["name"] == victim]
    assert dead[0]["alive"] is False and dead[0]["engine"] is None, f"/fleet/stats on {victim}: {dead}"
    assert books(fleet) == [(0, 0, 0)] * len(books(fleet)), f"the router still counts {books(fleet)}"


@pytest.mark.dist
def test_with_no_live_replica_left_the_stream_ends_with_an_error(fleet):
    """The last replicas die under a stream: it ends with an error event and [DONE], never hangs, and a new
    request gets 503 at once."""
    seed = 29
    rng = random.Random(seed)
    killed = []

    def kill_all(k):
        if k == 3 and not killed:
            for name in alive(fleet):
                killed.append(name)
                fleet.kill(name)

    body = {"prompt": [rng.randrange(3, VOCAB) for _ in range(12)], "max_tokens": 300, "ignore_eos": True}
    _, errors, done = stream_chunks(fleet, body, kill_all, timeout=30)
    assert killed, "the stream ended before the test could kill the replicas"
    assert done and errors and "no healthy replica" in errors[-1]["message"], f"seed={seed}: {errors}"
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3}, timeout=30)
    assert r.status_code == 503 and "healthy" in r.json()["error"]["message"], r.text
    assert books(fleet) == [(0, 0, 0)] * len(books(fleet)), f"the router still counts {books(fleet)}"
