"""§2–§6 Medusa's tree: candidates from the heads' top-k, the tree attention mask, one verification
forward, greedy acceptance of the longest verified path, and moving its K/V into place.

References: brute force written here (ranks by sorting, ancestors by walking parent links, acceptance
by checking every node's whole path) and Hugging Face run on each root-to-node path separately.
"""

import pytest
import torch
from stage06_medusa_helpers import random_paths

from labkit.testing import LLAMA_CONFIGS, labkit_from_hf, random_family, random_llama, random_tokens, relative_error

pytestmark = pytest.mark.in_process("the learner's code changes the test's KV cache in place")

MEDUSA = "stage06_speculative.medusa"


def brute_force_tree(root: int, head_logits: torch.Tensor, paths: list[tuple[int, ...]]):
    order = head_logits.argsort(dim=-1, descending=True)  # (K, V): rank r of head k is order[k - 1, r]
    nodes = [(), *paths]
    tokens = [root] + [int(order[len(p) - 1, p[-1]]) for p in paths]
    parents = [-1] + [nodes.index(p[:-1]) for p in paths]
    return tokens, parents, [len(p) for p in nodes]


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    seen = {i}
    while parents[i] >= 0:
        i = parents[i]
        seen.add(i)
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_candidate_tree_takes_each_heads_ranked_choices(impl, seed):
    m = impl(MEDUSA)
    K, V = 2 + seed % 3, 37 + 11 * seed
    paths = random_paths(seed, K, n=5 + 3 * seed)
    head_logits = torch.randn(K, V, generator=torch.Generator().manual_seed(seed))
    root = seed * 5 % V
    tokens, parents, depths = m.candidate_tree(root, head_logits, paths)
    want_tokens, want_parents, want_depths = brute_force_tree(root, head_logits, paths)
    assert torch.as_tensor(tokens).tolist() == want_tokens, (
        f"seed={seed} K={K} paths={paths}: node i + 1 is paths[i]; its token is the paths[i][-1]-th best "
        f"guess (0 = argmax) of head len(paths[i]), and node 0 is the root"
    )
    assert list(parents) == want_parents, f"seed={seed} paths={paths}: parents of each node (root: -1)"
    assert list(depths) == want_depths, f"seed={seed} paths={paths}: depth of each node (root: 0)"


@pytest.mark.parametrize("seed", range(8))
def test_tree_attention_mask_equals_brute_force_ancestors(impl, seed):
    m = impl(MEDUSA)
    if seed < 4:  # Medusa-shaped trees
        _, parents, _ = brute_force_tree(0, torch.randn(4, 50), random_paths(seed, 4, n=6 + 4 * seed))
    else:  # any tree whose parents come first
        g = torch.Generator().manual_seed(seed)
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 5 + 6 * seed)]
    N = len(parents)
    want = torch.tensor([[j in ancestors_or_self(parents, i) for j in range(N)] for i in range(N)])
    got = m.tree_attention_mask(parents)
    assert got.dtype == torch.bool and got.shape == (N, N), f"seed={seed}: expected ({N}, {N}) bool, got {got.dtype}"
    wrong = (got != want).nonzero().tolist()
    assert not wrong, (
        f"seed={seed} parents={parents}: (query, key) pairs wrong: {wrong[:6]} (True = is self or ancestor)"
    )


VERIFY_CASES = [(name, "llama") for name in LLAMA_CONFIGS] + [
    ("llama3.2-tied", "family"),
    ("qwen2-tied", "family"),
    ("qwen3-bias-untied", "family"),
    ("llama-attention-mlp-bias", "family"),
]


def random_target(name: str, kind: str, seed: int):
    """(HF model, its labkit twin, vocab size) of a random Llama config or a random family."""
    hf = random_llama(seed, **LLAMA_CONFIGS[name]) if kind == "llama" else random_family(name, seed=seed)[0]
    return hf, labkit_from_hf(hf), hf.config.vocab_size


@pytest.mark.parametrize(("name", "kind"), VERIFY_CASES)
def test_verify_tree_logits_equal_each_path_run_separately(impl, name, kind):
    """One forward over the whole tree gives, at every node, the logits of the prefix + that node's path."""
    m = impl(MEDUSA)
    seed = 11 + VERIFY_CASES.index((name, kind))
    hf, model, V = random_target(name, kind, seed)
    prefix = random_tokens(seed, 5 + seed % 7, V).tolist()
    paths = random_paths(seed, 4, n=14)
    tokens, parents, depths = brute_force_tree(
        int(random_tokens(seed + 1, 1, V)), torch.randn(4, V, generator=torch.Generator().manual_seed(seed)), paths
    )
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(torch.tensor([prefix]), cache)
    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            logits, hidden = m.verify_tree(model, cache, torch.tensor(tokens), parents, depths)
    finally:
        hook.remove()
    assert len(calls) == 1, f"{name} seed={seed}: verify the whole tree in ONE forward, got {len(calls)} layer-0 calls"
    N = len(tokens)
    assert logits.shape == (N, V), f"{name} seed={seed}: logits {tuple(logits.shape)}, expected ({N}, {V})"
    assert hidden.shape == (N, hf.config.hidden_size), f"{name} seed={seed}: hidden {tuple(hidden.shape)}"
    assert cache.length == len(prefix) + N, f"{name} seed={seed}: cache.length {cache.length}, expected prefix + N"
    for i in range(N):
        path = sorted(ancestors_or_self(parents, i))
        with torch.no_grad():
            out = hf(torch.tensor([prefix + [tokens[j] for j in path]]), output_hidden_states=True)
        err = relative_error(logits[i], out.logits[0, -1])
        assert err < 1e-4, f"{name} seed={seed} node {i} (path {path}): logits rel err {err:.2e} vs HF on that path"
        err = relative_error(hidden[i], out.hidden_states[-1][0, -1])
        assert err < 1e-4, f"{name} seed={seed} node {i}: hidden must be the final normed hidden state ({err:.2e})"


def verified_logits(tokens: list[int], parents: list[int], V: int, seed: int, p_agree: float) -> torch.Tensor:
    """Random logits whose argmax after node i is, with probability p_agree, one of its children's tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(tokens), V, generator=g)
    for i in range(len(tokens)):
        children = [c for c, p in enumerate(parents) if p == i]
        if children and torch.rand(1, generator=g) < p_agree:
            pick = children[int(torch.randint(0, len(children), (1,), generator=g))]
            logits[i, tokens[pick]] = logits[i].max() + 1.0
    return logits


@pytest.mark.parametrize("seed", range(10))
def test_accept_path_is_the_longest_verified_path(impl, seed):
    m = impl(MEDUSA)
    V = 61
    paths = random_paths(seed, 5, n=8 + 2 * seed)
    tokens, parents, _ = brute_force_tree(
        seed % V, torch.randn(5, V, generator=torch.Generator().manual_seed(seed)), paths
    )
    logits = verified_logits(tokens, parents, V, seed, p_agree=0.3 + 0.07 * seed)
    choice = logits.argmax(-1).tolist()
    # brute force: a node is verified when every node on its path is the argmax after its parent
    verified = [
        all(tokens[j] == choice[parents[j]] for j in ancestors_or_self(parents, i) - {0}) for i in range(len(tokens))
    ]
    deepest = max((i for i in range(len(tokens)) if verified[i]), key=lambda i: len(ancestors_or_self(parents, i)))
    want = sorted(ancestors_or_self(parents, deepest))
    path, bonus = m.accept_path(torch.tensor(tokens), parents, logits)
    assert list(path) == want, f"seed={seed}: accepted nodes {list(path)}, the longest verified path is {want}"
    assert bonus == choice[want[-1]], f"seed={seed}: the bonus is the target's argmax after the last accepted node"


@pytest.mark.parametrize("seed", range(4))
def test_commit_path_moves_accepted_kv_to_consecutive_slots(impl, seed):
    m = impl(MEDUSA)
    cfg = LLAMA_CONFIGS[list(LLAMA_CONFIGS)[seed]]
    model = labkit_from_hf(random_llama(seed, **cfg))
    cache = model.new_cache(1, 48)
    g = torch.Generator().manual_seed(seed)
    for k, v in zip(cache.k, cache.v, strict=True):
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    before_k, before_v = [k.clone() for k in cache.k], [v.clone() for v in cache.v]
    start, N = 7 + 3 * seed, 12 + seed
    cache.length = start + N  # as verify_tree leaves it
    _, parents, _ = brute_force_tree(0, torch.randn(4, 40, generator=g), random_paths(seed, 4, n=N - 1))
    path = sorted(ancestors_or_self(parents, N - 1 - seed))
    m.commit_path(cache, start, path)
    assert cache.length == start + len(path), f"seed={seed}: cache.length {cache.length}, expected {start + len(path)}"
    for layer in range(len(cache.k)):
        for got, old, what in ((cache.k, before_k, "K"), (cache.v, before_v, "V")):
            assert torch.equal(got[layer][:, :, :start], old[layer][:, :, :start]), (
                f"seed={seed} layer {layer}: the prefix's {what} must not move"
            )
            for j, node in enumerate(path):
                assert torch.equal(got[layer][:, :, start + j], old[layer][:, :, start + node]), (
                    f"seed={seed} layer {layer}: slot {start + j} must hold node {node}'s {what} (path {path})"
                )


@pytest.mark.parametrize(("name", "kind"), VERIFY_CASES[:4] + VERIFY_CASES[-2:-1])
def test_after_a_round_the_cache_continues_like_a_fresh_forward(impl, name, kind):
    """verify → accept → commit, then decode the bonus token: HF on prefix + accepted + bonus agrees."""
    m = impl(MEDUSA)
    seed = 31 + VERIFY_CASES.index((name, kind))
    hf, model, V = random_target(name, kind, seed)
    prefix = random_tokens(seed, 6 + seed % 5, V).tolist()
    binary = {tuple((i >> b) & 1 for b in range(d)) for d in range(1, 5) for i in range(2**d)}  # ranks 0, 1
    paths = sorted(binary | set(random_paths(seed, 4, n=8)), key=lambda p: (len(p), p))
    cache = model.new_cache(1, 96)
    with torch.no_grad():
        root = int(model(torch.tensor([prefix]), cache)[0, -1].argmax())
        # candidates: the target's own next guesses at rank 0 or 1, so several levels get accepted
        want = [root]
        for _ in range(4):
            want.append(int(hf(torch.tensor([prefix + want])).logits[0, -1].argmax()))
        head_logits = torch.randn(4, V, generator=torch.Generator().manual_seed(seed))
        for k in range(4):
            head_logits[k, want[k + 1]] = head_logits[k].max() + (1.0 if (seed + k) % 3 else -1e-3)
        tokens, parents, depths = brute_force_tree(root, head_logits, paths)
        start = cache.length
        logits, _ = m.verify_tree(model, cache, torch.tensor(tokens), parents, depths)
        path, bonus = m.accept_path(torch.tensor(tokens), parents, logits)
        m.commit_path(cache, start, path)
        kept = prefix + [tokens[i] for i in path]
        assert cache.length == len(kept), f"{name} seed={seed}: cache.length {cache.length}, expected {len(kept)}"
        assert len(path) >= 2, f"{name} seed={seed}: the head guessed the target's next token; accept it ({path})"
        got = model(torch.tensor([[bonus]]), cache)[0, -1]
        fresh = hf(torch.tensor([kept + [bonus]])).logits[0, -1]
    err = relative_error(got, fresh)
    assert err < 1e-4, f"{name} seed={seed}: after committing path {path}, decoding differs from HF ({err:.2e})"
