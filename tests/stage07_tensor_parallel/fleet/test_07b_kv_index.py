"""§2 of lab3.ipynb: the KV-event index. Fake engines here keep their true cache as a plain set and
number their events; the network drops some; the index, resynced from snapshots, must end equal to
every engine's truth. Dynamo's cost is written out here from its documentation."""

import random

import pytest

pytestmark = pytest.mark.in_process("the test reads the index's tables back")

KV_INDEX = "stage07_tensor_parallel.fleet.kv_index"
POLICIES = "stage07_tensor_parallel.fleet.policies"


class FakeEngine:
    """A worker's true cache and its numbered events; `history[n]` is the cache after event n."""

    def __init__(self, name, rng):
        self.name, self.rng = name, rng
        self.held: set[int] = set()
        self.seq = 0
        self.history = {0: frozenset()}

    def event(self, kind=None):
        kind = kind or ("removed" if self.held and self.rng.random() < 0.4 else "stored")
        if kind == "stored":
            hashes = [self.rng.getrandbits(62) - (1 << 61) for _ in range(self.rng.randrange(1, 5))]
            self.held.update(hashes)
        else:
            hashes = self.rng.sample(sorted(self.held), self.rng.randrange(1, min(4, len(self.held)) + 1))
            self.held.difference_update(hashes)
        self.seq += 1
        self.history[self.seq] = frozenset(self.held)
        return self.name, self.seq, kind, hashes


@pytest.mark.parametrize("seed", range(6))
def test_index_equals_the_engines_after_dropped_events(impl, seed):
    """Events are lost with probability 0.25; a snapshot is answered a few events after it was asked for
    (events published meanwhile must be replayed on top of it)."""
    mod = impl(KV_INDEX)
    rng = random.Random(seed)
    engines = {f"w{i}": FakeEngine(f"w{i}", rng) for i in range(3)}
    index = mod.KVIndex()
    asked: dict[str, tuple[int, int]] = {}  # worker -> (snapshot's seq, events until its reply arrives)

    def deliver_snapshots(force=False):
        for name, (seq, wait) in list(asked.items()):
            if force or wait <= 0:
                del asked[name]
                index.apply_snapshot(name, seq, list(engines[name].history[seq]))
            else:
                asked[name] = (seq, wait - 1)
        for name in index.needs_snapshot():
            asked.setdefault(name, (engines[name].seq, rng.randrange(4)))

    for _ in range(400):
        event = rng.choice(list(engines.values())).event()
        if rng.random() > 0.25:
            index.apply(*event)
        deliver_snapshots()
    for engine in engines.values():  # a last event gets through, so every trailing loss shows as a gap
        index.apply(*engine.event("stored"))
    for _ in range(3):
        deliver_snapshots(force=True)
    assert not index.needs_snapshot(), f"seed={seed}: still stale after every snapshot: {index.needs_snapshot()}"
    for name, engine in engines.items():
        got = set(index.blocks[name])
        assert got == engine.held, (
            f"seed={seed}, worker {name}: the index holds {len(got)} hashes, the engine {len(engine.held)}; "
            f"{len(got - engine.held)} extra, {len(engine.held - got)} missing"
        )


def test_a_gap_marks_the_worker_stale_until_a_snapshot(impl):
    mod = impl(KV_INDEX)
    index = mod.KVIndex()
    assert index.apply("w", 1, "stored", [10, 11]) and index.apply("w", 2, "stored", [12])
    assert index.apply("w", 2, "stored", [12]), "a repeated event is old news, not a gap"
    assert index.apply("w", 4, "removed", [10]) is False, "event 4 after 2: a gap must return False"
    assert index.needs_snapshot() == {"w"}, "after a gap the worker needs a snapshot"
    assert index.apply("w", 5, "stored", [13]) is False, "while stale, events wait for the snapshot"
    assert set(index.blocks["w"]) == {10, 11, 12}, "events that arrive while stale are not applied yet"
    assert index.apply_snapshot("w", 3, [10, 11, 12, 20]), "a snapshot at 3 with 4 and 5 held back closes the gap"
    assert set(index.blocks["w"]) == {11, 12, 13, 20}, "snapshot at 3, then events 4 (remove 10) and 5 (store 13)"
    assert not index.needs_snapshot() and index.seq["w"] == 5
    index.apply("w", 7, "stored", [30])
    index.apply_snapshot("w", 7, [40])  # a snapshot newer than the held event: that event is already in it
    assert set(index.blocks["w"]) == {40} and index.seq["w"] == 7, "events at or below the snapshot's seq are skipped"
    assert index.apply("w", 8, "removed", [40]) and set(index.blocks["w"]) == set()
    assert index.apply("v", 3, "stored", [1]) is False, "a worker first heard of at event 3 missed 1 and 2"


def test_a_snapshot_replaces_what_the_index_held(impl):
    mod = impl(KV_INDEX)
    index = mod.KVIndex()
    index.apply("w", 1, "stored", [1, 2, 3])
    index.apply_snapshot("w", 9, [3, 4])  # 1 and 2 were removed by events the index never saw
    assert set(index.blocks["w"]) == {3, 4}, f"after a snapshot of [3, 4] the index holds {set(index.blocks['w'])}"


@pytest.mark.parametrize("seed", range(3))
def test_overlap_counts_only_leading_pages(impl, seed):
    mod = impl(KV_INDEX)
    rng = random.Random(seed)
    for _ in range(50):
        prompt = [rng.getrandbits(40) for _ in range(rng.randrange(0, 10))]
        held = [h for h in prompt if rng.random() < 0.7] + [rng.getrandbits(40) for _ in range(3)]
        index = mod.KVIndex()
        index.apply("w", 1, "stored", held)
        want = next((i for i, h in enumerate(prompt) if h not in held), len(prompt))
        got = index.overlap("w", prompt)
        assert got == want, f"seed={seed}: {want} leading pages held, overlap said {got}"
        assert index.overlap("nobody", prompt) == 0, "a worker the index never heard of holds nothing"


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0, 4.0])
def test_kv_aware_scores_prefill_and_decode_load(impl, weight):
    """Dynamo's KV router: cost = overlap_score_weight * (prompt pages - cached leading pages) + active pages."""
    mod, pol = impl(KV_INDEX), impl(POLICIES)
    rng = random.Random(int(weight * 10))
    page = 4
    for trial in range(40):
        n_pages = rng.randrange(1, 12)
        tokens = [rng.randrange(100) for _ in range(n_pages * page + rng.randrange(page))]
        hashes = [rng.getrandbits(40) for _ in range(len(tokens) // page)]
        index = mod.KVIndex()
        ws, want = [], []
        for i in range(4):
            cached = rng.randrange(len(hashes) + 1)
            index.apply(f"w{i}", 1, "stored", hashes[:cached])
            active = rng.randrange(0, 200)
            ws.append(pol.WorkerState(f"w{i}", outstanding=rng.randrange(5), active_tokens=active))
            want.append(weight * (len(tokens) / page - cached) + active / page)
        policy = mod.KVAware(index, page_size=page, overlap_score_weight=weight)
        req = pol.RoutedRequest("r", tokens, block_hashes=hashes)
        got = [policy.cost(req, w) for w in ws]
        assert got == pytest.approx(want), f"weight={weight}, trial {trial}: costs {got}, expected {want}"
        assert policy.choose(req, ws) == want.index(min(want)), f"weight={weight}, trial {trial}: costs {want}"
