"""Stage 07 part 2 learner bugs, one edit each, planted in solutions/stage07_tensor_parallel (see labkit/grading/mutants.py)."""

MUTANTS = [
    # --- radix_cache.py (lab2) ---
    # --- policies.py, kv_index.py (lab3) ---
    dict(
        file="policies.py",
        find="        i = self.next % len(workers)\n        self.next += 1",
        replace="        i = self.next % len(workers)\n        self.next += 2",
        bug="round-robin skips every other worker",
    ),
    dict(
        file="policies.py",
        find="        i = self.next % len(workers)\n        self.next += 1\n        return i",
        replace="        self.next += 1\n        return self.next % len(workers)",
        bug="round-robin starts at the second worker (advances before choosing)",
    ),
    dict(
        file="policies.py",
        find="        if w.outstanding < workers[best].outstanding:",
        replace="        if w.outstanding <= workers[best].outstanding:",
        bug="least outstanding breaks ties toward the last worker",
    ),
    dict(
        file="policies.py",
        find="        if w.outstanding < workers[best].outstanding:",
        replace="        if w.outstanding > workers[best].outstanding:",
        bug="least outstanding picks the busiest worker",
    ),
    dict(
        file="policies.py",
        find="        a, b = self.rng.sample(range(len(workers)), 2)",
        replace="        a, b = self.rng.randrange(len(workers)), self.rng.randrange(len(workers))",
        bug="power of two draws with replacement (the same worker twice, so the busiest can win)",
    ),
    dict(
        file="policies.py",
        find="        a, b = self.rng.sample(range(len(workers)), 2)\n        return b if workers[b].outstanding < workers[a].outstanding else a",
        replace="        return self.rng.randrange(len(workers))",
        bug="power of two samples one worker (random routing)",
    ),
    dict(
        file="policies.py",
        find="        a, b = self.rng.sample(range(len(workers)), 2)",
        replace="        a, b = random.sample(range(len(workers)), 2)",
        bug="power of two draws from the global random module, not its seeded rng",
    ),
    dict(
        file="policies.py",
        find="        if bound in names:\n            return names.index(bound)\n",
        replace="",
        bug="session affinity is not sticky (always the least loaded)",
    ),
    dict(
        file="policies.py",
        find="        if bound in names:\n            return names.index(bound)\n        return least_loaded(workers)",
        replace="        if bound in names:\n            return names.index(bound)\n        return 0",
        bug="session affinity sends new sessions (and those of a removed worker) to the first worker",
    ),
    dict(
        file="policies.py",
        find="        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold",
        replace="        return hi - lo > self.balance_abs_threshold or hi > lo * self.balance_rel_threshold",
        bug="cache-aware calls the load imbalanced when either threshold is crossed, not both",
    ),
    dict(
        file="policies.py",
        find="        if self.is_imbalanced(workers):\n            return least_loaded(workers)\n",
        replace="",
        bug="cache-aware ignores the balance thresholds (a hot prefix piles onto one worker)",
    ),
    dict(
        file="policies.py",
        find="        if ids and matched[best] / len(ids) > self.cache_threshold:",
        replace="        if ids and matched[best] > 0:",
        bug="cache-aware follows any match, ignoring cache_threshold",
    ),
    dict(
        file="policies.py",
        find="        return min(range(len(workers)), key=lambda i: sizes[i])",
        replace="        return least_loaded(workers)",
        bug="cache-aware sends a miss to the least loaded instead of the smallest tree",
    ),
    dict(
        file="policies.py",
        find="        excess = tree.total_size() - self.max_tree_size\n        if excess > 0:\n            tree.evict(excess)",
        replace="        pass",
        bug="cache-aware's approximate trees grow without bound (no LRU eviction)",
    ),
    dict(
        file="policies.py",
        find="            tree.evict(excess)",
        replace="            tree.evict(self.max_tree_size)",
        bug="cache-aware evicts max_tree_size tokens instead of the excess",
    ),
    dict(
        file="kv_index.py",
        find="        if seq > self.seq[worker] + 1:\n            self.stale.add(worker)\n            self.pending[worker].append((seq, kind, block_hashes))\n            return False\n",
        replace="",
        bug="the index ignores gaps (applies events past a lost one)",
    ),
    dict(
        file="kv_index.py",
        find="        if worker in self.stale:\n            self.pending[worker].append((seq, kind, block_hashes))\n            return False\n",
        replace="",
        bug="the index applies events while the worker is stale (they are then lost or doubled by the snapshot)",
    ),
    dict(
        file="kv_index.py",
        find="        self.blocks[worker] = set(block_hashes)",
        replace="        self.blocks[worker].update(block_hashes)",
        bug="a snapshot is merged into the index instead of replacing it",
    ),
    dict(
        file="kv_index.py",
        find="        for event in pending:\n            self.apply(worker, *event)",
        replace="        pass",
        bug="events held while stale are dropped, not replayed on the snapshot",
    ),
    dict(
        file="kv_index.py",
        find="        pending = sorted(self.pending.pop(worker, []), key=lambda e: e[0])\n        for event in pending:\n            self.apply(worker, *event)",
        replace="        pending = self.pending.pop(worker, [])\n        for seq, kind, hashes in pending:\n            self.blocks[worker].update(hashes) if kind == 'stored' else self.blocks[worker].difference_update(hashes)",
        bug="held events are replayed even when the snapshot already reflects them",
    ),
    dict(
        file="kv_index.py",
        find="            if h not in held:\n                break\n            n += 1",
        replace="            if h in held:\n                n += 1",
        bug="overlap counts every held page, not only the leading ones",
    ),
    dict(
        file="kv_index.py",
        find="        return self.overlap_score_weight * prefill + worker.active_tokens / self.page_size",
        replace="        return self.overlap_score_weight * prefill + worker.outstanding",
        bug="kv-aware scores decode load by requests, not by the KV pages they hold",
    ),
    dict(
        file="kv_index.py",
        find="        return self.overlap_score_weight * prefill + worker.active_tokens / self.page_size",
        replace="        return prefill + self.overlap_score_weight * worker.active_tokens / self.page_size",
        bug="kv-aware weights the decode load instead of the prefill",
    ),
    # --- loadgen.py, slo.py (lab4) ---
]
