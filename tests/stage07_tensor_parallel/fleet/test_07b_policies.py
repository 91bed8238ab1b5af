"""§1 of lab3.ipynb: the router's policies on hand-built worker states. References are written here:
the cycle, the least loaded by a scan, the power of two choices' exact selection probabilities, a
slow longest-common-prefix over every prompt a worker was sent (CacheAware's approximate tree), and
SGLang's balance thresholds as stated in sgl-router."""

import itertools
import math
import random

import pytest

pytestmark = pytest.mark.in_process("the test changes the worker states the policy reads")

POLICIES = "stage07_tensor_parallel.fleet.policies"
IDS = itertools.count()


def workers(mod, loads):
    return [mod.WorkerState(f"w{i}", outstanding=n) for i, n in enumerate(loads)]


def request(mod, ids, session=None):
    return mod.RoutedRequest(f"r{next(IDS)}", list(ids), session_id=session)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_round_robin_cycles_through_every_worker(impl, n):
    mod = impl(POLICIES)
    policy, ws = mod.RoundRobin(), workers(mod, [5, 0, 2, 9][:n])
    got = [policy.choose(request(mod, [1]), ws) for _ in range(3 * n)]
    assert got == [i % n for i in range(3 * n)], f"{n} workers: round-robin chose {got}"


@pytest.mark.parametrize("seed", range(4))
def test_least_outstanding_picks_the_fewest_first_on_ties(impl, seed):
    mod = impl(POLICIES)
    rng = random.Random(seed)
    for _ in range(50):
        loads = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        got = mod.LeastOutstanding().choose(request(mod, [1]), workers(mod, loads))
        assert got == loads.index(min(loads)), f"seed={seed}: loads {loads}, chose {got}"


@pytest.mark.parametrize("seed", [0, 1])
def test_power_of_two_draws_two_distinct_workers(impl, seed):
    """Loads all differ: the k-th least loaded of n wins exactly when it is drawn with a busier one,
    with probability (n - 1 - k) / C(n, 2); the busiest never wins."""
    mod = impl(POLICIES)
    rng = random.Random(seed)
    loads = rng.sample(range(10), 4)
    ws, n, trials = workers(mod, loads), 4, 6000
    policy = mod.PowerOfTwo(seed=seed)
    counts = [0] * n
    for _ in range(trials):
        counts[policy.choose(request(mod, [1]), ws)] += 1
    rank = sorted(range(n), key=lambda i: loads[i])
    for k, i in enumerate(rank):
        want = (n - 1 - k) / math.comb(n, 2)
        assert abs(counts[i] / trials - want) < 0.025, (
            f"seed={seed}: loads {loads}: worker {i} (rank {k}) chosen {counts[i] / trials:.3f} of the time, "
            f"expected {want:.3f}"
        )
    one, two = mod.PowerOfTwo(seed=seed), mod.PowerOfTwo(seed=seed)
    a, b = ([p.choose(request(mod, [1]), ws) for _ in range(50)] for p in (one, two))
    assert a == b, f"seed={seed}: two PowerOfTwo(seed={seed}) chose differently: the draws must come from self.rng"
    assert mod.PowerOfTwo(seed=seed).choose(request(mod, [1]), workers(mod, [3])) == 0, "one worker: it"


def test_session_affinity_is_sticky_and_moves_off_a_removed_worker(impl):
    mod = impl(POLICIES)
    policy, ws = mod.SessionAffinity(), workers(mod, [2, 0, 1])
    first = {}
    for s in ("alice", "bob", "carol"):
        i = policy.choose(request(mod, [1], s), ws)
        assert i == [w.outstanding for w in ws].index(min(w.outstanding for w in ws)), (
            f"a new session ({s}) goes to the least loaded, got worker {i}"
        )
        policy.on_dispatch(request(mod, [1], s), ws[i])
        ws[i].outstanding += 1
        first[s] = ws[i].name
    ws[1].outstanding += 10  # bob's and alice's worker gets busy: their sessions stay anyway
    for s, name in first.items():
        for _ in range(3):
            i = policy.choose(request(mod, [1, 2], s), ws)
            assert ws[i].name == name, f"session {s} started on {name}, a later turn went to {ws[i].name}"
    gone = first["alice"]
    policy.remove_worker(gone)
    left = [w for w in ws if w.name != gone]
    i = policy.choose(request(mod, [1], "alice"), left)
    assert i == [w.outstanding for w in left].index(min(w.outstanding for w in left)), (
        f"alice's worker {gone} left: she goes to the least loaded of the rest, got {left[i].name}"
    )
    policy.on_dispatch(request(mod, [1], "alice"), left[i])
    left[i].outstanding += 5
    assert left[policy.choose(request(mod, [1], "alice"), left)].name == left[i].name, "alice sticks to her new worker"
    assert policy.choose(request(mod, [1], None), ws) == [w.outstanding for w in ws].index(
        min(w.outstanding for w in ws)
    ), "no session: the least loaded"


class SlowCacheAware:
    """The test's reference: every prompt each worker was sent, matched by a plain scan."""

    def __init__(self, names, threshold):
        self.prompts = {n: [] for n in names}
        self.threshold = threshold

    def match(self, name, ids):
        def common(a, b):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n

        return max((common(p, ids) for p in self.prompts[name]), default=0)

    def size(self, name):  # tokens in a trie of the prompts: its distinct non-empty prefixes
        return len({tuple(p[:k]) for p in self.prompts[name] for k in range(1, len(p) + 1)})

    def choose(self, ids, names):
        matched = [self.match(n, ids) for n in names]
        best = matched.index(max(matched))
        if matched[best] / len(ids) > self.threshold:
            return best
        sizes = [self.size(n) for n in names]
        return sizes.index(min(sizes))


def prompts(seed, n, vocab=50):
    """Prompts on a few shared system prompts, some extended by earlier prompts (multi-turn)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 16))] for _ in range(3)]
    out = []
    for _ in range(n):
        if out and rng.random() < 0.3:
            base = rng.choice(out)
        elif rng.random() < 0.8:
            base = rng.choice(systems)
        else:
            base = []
        out.append(base + [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))])
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", [0.3, 0.6])
def test_cache_aware_routes_to_the_longest_match_when_balanced(impl, seed, threshold):
    mod = impl(POLICIES)
    policy = mod.CacheAware(cache_threshold=threshold, balance_abs_threshold=64)
    ws = workers(mod, [0, 0, 0, 0])
    ref = SlowCacheAware([w.name for w in ws], threshold)
    rng = random.Random(seed)
    for k, ids in enumerate(prompts(seed, 60)):
        for w in ws:
            w.outstanding = rng.randrange(8)  # within the thresholds: balanced
        want, got = ref.choose(ids, [w.name for w in ws]), policy.choose(request(mod, ids), ws)
        assert got == want, (
            f"seed={seed}, threshold={threshold}, request {k} {ids}: chose worker {got}, expected {want} "
            f"(matches {[ref.match(w.name, ids) for w in ws]}, tree sizes {[ref.size(w.name) for w in ws]})"
        )
        policy.on_dispatch(request(mod, ids), ws[got])
        ref.prompts[ws[got].name].append(ids)


@pytest.mark.parametrize(
    "loads, imbalanced",
    [([70, 5], True), ([70, 6], False), ([300, 210], False), ([300, 199], True), ([10, 1], False), ([0, 65], True)],
)
def test_cache_aware_balance_thresholds(impl, loads, imbalanced):
    """sgl-router: imbalanced when max - min > balance_abs_threshold (64) and max > min * balance_rel_threshold
    (1.5); then the least loaded wins over the cache."""
    mod = impl(POLICIES)
    policy = mod.CacheAware()
    hot = list(range(40))
    ws = workers(mod, [0, 0])
    busy = loads.index(max(loads))
    policy.on_dispatch(request(mod, hot), ws[busy])  # the busy worker holds the prompt's whole prefix
    for w, n in zip(ws, loads, strict=True):
        w.outstanding = n
    assert policy.is_imbalanced(ws) == imbalanced, f"loads {loads}: is_imbalanced should be {imbalanced}"
    got = policy.choose(request(mod, hot + [99]), ws)
    want = loads.index(min(loads)) if imbalanced else busy
    assert got == want, f"loads {loads} (imbalanced: {imbalanced}): chose worker {got}, expected {want}"


@pytest.mark.parametrize("seed", [0, 1])
def test_cache_aware_tree_is_bounded_by_lru_eviction(impl, seed):
    mod = impl(POLICIES)
    rng = random.Random(seed)
    policy, ws = mod.CacheAware(max_tree_size=64), workers(mod, [0])
    for k in range(40):
        ids = [rng.randrange(1000) for _ in range(rng.randrange(20, 30))]
        policy.on_dispatch(request(mod, ids), ws[0])
        tree = policy.trees[ws[0].name]
        assert tree.total_size() <= 64, f"seed={seed}, prompt {k}: the tree holds {tree.total_size()} > 64 tokens"
        held = len(tree.match_prefix(ids)[0])
        assert held == len(ids), (
            f"seed={seed}, prompt {k}: the newest prompt is the last to evict; {held} of {len(ids)} kept"
        )


def simulate(mod, policy, seed, n_workers=4, n_requests=400):
    """Two arrivals a tick; one request in five is long (40 ticks), the rest take 4; every prompt
    shares one system prompt (a hot prefix). Returns (requests per worker, peak outstanding per worker)."""
    rng = random.Random(seed)
    ws = workers(mod, [0] * n_workers)
    system = [rng.randrange(500) for _ in range(32)]
    ends, served, peak = [], [0] * n_workers, [0] * n_workers
    for k in range(n_requests):
        t = k // 2
        for end in [e for e in ends if e[0] <= t]:
            ends.remove(end)
            ws[end[1]].outstanding -= 1
            policy.on_finish(end[2], ws[end[1]])
        r = request(mod, system + [rng.randrange(500) for _ in range(8)], session=f"s{rng.randrange(40)}")
        i = policy.choose(r, ws)
        policy.on_dispatch(r, ws[i])
        ws[i].outstanding += 1
        served[i] += 1
        peak[i] = max(peak[i], ws[i].outstanding)
        ends.append((t + (40 if rng.random() < 0.2 else 4), i, r))
    return served, peak


@pytest.mark.parametrize("name", ["least_outstanding", "power_of_two", "cache_aware", "session_affinity"])
def test_balance_under_a_skewed_workload(impl, name):
    """Heavy-tailed service times and one hot prefix: no worker starves (each serves at least 15 % of the
    requests) and none piles up (peak outstanding within 2x the mean of the peaks + 4)."""
    mod = impl(POLICIES)
    make = {
        "least_outstanding": lambda: mod.LeastOutstanding(),
        "power_of_two": lambda: mod.PowerOfTwo(seed=3),
        "cache_aware": lambda: mod.CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5),
        "session_affinity": lambda: mod.SessionAffinity(),
    }
    for seed in range(2):
        served, peak = simulate(mod, make[name](), seed)
        mean_peak = sum(peak) / len(peak)
        assert min(served) >= 0.15 * sum(served), f"seed={seed}, {name}: requests per worker {served}"
        assert max(peak) <= 2 * mean_peak + 4, f"seed={seed}, {name}: peak outstanding per worker {peak}"


@pytest.mark.parametrize(
    "name", ["round_robin", "least_outstanding", "power_of_two", "session_affinity", "cache_aware"]
)
def test_every_policy_while_replicas_join_leave_and_die(impl, name):
    """A fleet that changes mid-trace: replicas join, one leaves (remove_worker), one dies (it only drops out
    of the list the router passes; remove_worker comes later). Every choice is a worker of the current list,
    a session whose worker is gone moves (never an error) and sticks to its new worker, round-robin keeps
    cycling over whoever is there, and the first request (t = 0, nothing known yet) is routed like any other."""
    mod = impl(POLICIES)
    policy = {
        "round_robin": lambda: mod.RoundRobin(),
        "least_outstanding": lambda: mod.LeastOutstanding(),
        "power_of_two": lambda: mod.PowerOfTwo(seed=5),
        "session_affinity": lambda: mod.SessionAffinity(),
        "cache_aware": lambda: mod.CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5),
    }[name]()
    rng = random.Random(11)
    ws = [mod.WorkerState("w0")]
    names = itertools.count(1)
    bound: dict[str, str] = {}  # session -> the worker its last turn went to
    prev = 0
    for t in range(120):
        if t in (5, 20, 50):  # a replica joins
            ws.append(mod.WorkerState(f"w{next(names)}"))
        if t == 35:  # one leaves: the router tells the policy
            gone = ws.pop(1)
            policy.remove_worker(gone.name)
        if t == 70:  # one dies: it drops out of the list now, and remove_worker comes only later
            dead = ws.pop(0)
        if t == 90:
            policy.remove_worker(dead.name)
        session = f"s{rng.randrange(6)}"
        r = request(mod, [rng.randrange(50) for _ in range(rng.randint(1, 9))], session)
        current = [w.name for w in ws]
        i = policy.choose(r, ws)
        assert isinstance(i, int) and 0 <= i < len(ws), f"t={t}, {name}: chose {i} of {len(ws)} workers {current}"
        if name == "round_robin" and t > 70:  # the list no longer changes: one step along it per request
            assert i == (prev + 1) % len(ws), f"t={t}: round-robin went from {current[prev]} to {current[i]}"
        if name == "session_affinity" and bound.get(session) in current:
            assert ws[i].name == bound[session], f"t={t}: {session} left {bound[session]} for {ws[i].name}"
        policy.on_dispatch(r, ws[i])
        ws[i].outstanding += 1
        bound[session], prev = ws[i].name, i
        if rng.random() < 0.5:  # a request elsewhere finishes
            done = rng.choice(ws)
            if done.outstanding:
                done.outstanding -= 1
                policy.on_finish(request(mod, [1]), done)
