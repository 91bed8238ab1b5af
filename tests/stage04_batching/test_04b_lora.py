"""§2–§4 of lab3.ipynb (stage 04 part 2): the batched LoRA term (BGMV), the adapter registry, and the engine serving a
mixed batch. References: a per-token loop written here, an LRU simulation written here, and Hugging
Face models with each adapter merged by `peft` (float32, relative error < 1e-4)."""

import random

import pytest
import torch
from stage04_lora_helpers import ADAPTER_KINDS, hf_logits, peft_merged, save_random_adapter

from labkit import LORA, TARGET
from labkit.testing import FP32_MARGIN, LLAMA_CONFIGS, assert_hf_greedy, labkit_from_hf, random_llama, relative_error

LORA_MOD = "stage04_batching.lora"
LORA_ENGINE = "stage04_batching.lora_engine"


def _params(impl, **kw):
    return impl("stage04_batching.sequence").SamplingParams(**kw)


# ---- §2 bgmv -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bgmv_gives_each_token_its_own_adapter(impl, seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    S, r, d_in, d_out, N = rng.randint(2, 5), rng.choice([2, 4, 8]), rng.randint(5, 40), rng.randint(3, 50), rng.randint(1, 37)  # fmt: skip
    x = torch.randn(N, d_in, generator=g)
    a = torch.randn(S, r, d_in, generator=g)
    b = torch.randn(S, d_out, r, generator=g)
    a[0, r // 2 :] = 0  # slot 0 holds a smaller rank, zero-padded
    scaling = torch.rand(S, generator=g) * 4
    indices = torch.tensor([rng.randrange(-1, S) for _ in range(N)])
    indices[0] = -1
    want = torch.zeros(N, d_out)
    for n in range(N):  # the obvious version: one token at a time
        s = int(indices[n])
        if s >= 0:
            want[n] = scaling[s] * (b[s] @ (a[s] @ x[n]))
    got = impl(LORA_MOD).bgmv(x, a, b, indices, scaling)
    assert got.shape == (N, d_out), f"seed={seed}: shape {tuple(got.shape)}, expected {(N, d_out)}"
    assert torch.equal(got[indices < 0], torch.zeros_like(got[indices < 0])), (
        f"seed={seed}: tokens with adapter index -1 (base model) must get exactly zero"
    )
    err = relative_error(got, want)
    assert err < 1e-5, f"seed={seed}: bgmv differs from the per-token loop (relative error {err:.2e})"


@pytest.mark.parametrize("seed", [0, 1])
def test_bgmv_never_builds_an_adapters_full_weight_delta(impl, seed):
    """B (A x) with r columns in between, not (B A) x: the d_out x d_in product is what merging costs."""
    from labkit.tensor_memory import TensorWatch

    g = torch.Generator().manual_seed(seed)
    S, r, d_in, d_out, N = 3, 4, 96, 80, 7
    x, a, b = (
        torch.randn(N, d_in, generator=g),
        torch.randn(S, r, d_in, generator=g),
        torch.randn(S, d_out, r, generator=g),
    )
    indices = torch.tensor([0, 1, 2, -1, 2, 0, 1])
    with TensorWatch() as watch:
        impl(LORA_MOD).bgmv(x, a, b, indices, torch.ones(S))
    assert watch.largest_numel < d_out * d_in, (
        f"seed={seed}: bgmv made a tensor of shape {watch.largest_shape}; a (d_out, d_in) = ({d_out}, {d_in}) "
        "product B A is a merged weight delta: multiply by A first, then by B"
    )


# ---- §3 the adapter registry ---------------------------------------------------------------------


def _tiny_config():
    from labkit.model import Config

    return Config(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip


def _write_adapter(folder, config, seed: int, rank: int) -> dict:
    """A PEFT folder with a LoRA on q_proj and down_proj of every layer; returns its tensors."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    q, h, f = config.num_attention_heads * config.head_dim, config.hidden_size, config.intermediate_size
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for part, module, d_out, d_in in (("self_attn", "q_proj", q, h), ("mlp", "down_proj", h, f)):
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g)
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return tensors


class ReferenceLRU:
    """The registry's contract, the obvious way: a list in recency order, pins per adapter."""

    def __init__(self, max_loras):
        self.max_loras, self.order, self.slot, self.pins, self.loads = max_loras, [], {}, {}, 0

    def acquire(self, name):
        if name not in self.slot:
            if len(self.slot) < self.max_loras:
                slot = min(set(range(self.max_loras)) - set(self.slot.values()))
            else:
                victims = [n for n in self.order if self.pins[n] == 0]
                if not victims:
                    return None
                slot = self.slot.pop(victims[0])
                self.order.remove(victims[0])
                del self.pins[victims[0]]
            self.slot[name], self.pins[name] = slot, 0
            self.loads += 1
        else:
            self.order.remove(name)
        self.order.append(name)
        self.pins[name] += 1
        return self.slot[name]

    def release(self, name):
        self.pins[name] -= 1


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_registry_loads_on_demand_evicts_lru_and_never_a_pinned_adapter(impl, tmp_path, seed):
    rng = random.Random(seed)
    config = _tiny_config()
    names = [f"a{i}" for i in range(5)]
    tensors = {n: _write_adapter(tmp_path / n, config, 10 * seed + i, rng.choice([2, 3, 4])) for i, n in enumerate(names)}  # fmt: skip
    max_loras = rng.choice([1, 2, 3])
    registry = impl(LORA_MOD).AdapterRegistry(config, {n: tmp_path / n for n in names}, max_loras=max_loras, max_rank=4)
    ref = ReferenceLRU(max_loras)
    held: list[str] = []  # pins we hold, to release later
    for step in range(60):
        if held and rng.random() < 0.45:
            name = held.pop(rng.randrange(len(held)))
            registry.release(name)
            ref.release(name)
            continue
        name = rng.choice(names)
        want = ref.acquire(name)
        got = registry.acquire(name)
        assert got == want, (
            f"seed={seed}, step {step}, max_loras={max_loras}: acquire({name!r}) gave slot {got}, expected {want} "
            f"(recency order {ref.order}, pins {ref.pins})"
        )
        if got is None:
            continue
        held.append(name)
        key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
        b = tensors[name][key]
        assert torch.equal(registry.lora_b[1, "down_proj"][got, :, : b.shape[1]], b), (
            f"seed={seed}, step {step}: slot {got} does not hold {name!r}'s weights after acquire"
        )
    assert registry.num_loads == ref.loads, (
        f"seed={seed}: the registry read adapters from disk {registry.num_loads} times, expected {ref.loads} "
        "(a loaded adapter must be reused, not reloaded)"
    )


def test_unknown_adapter_is_refused_by_name(impl, tmp_path):
    config = _tiny_config()
    _write_adapter(tmp_path / "known", config, 0, 2)
    registry = impl(LORA_MOD).AdapterRegistry(config, {"known": tmp_path / "known"}, max_loras=1, max_rank=4)
    from labkit.model import Llama, init_weights

    engine = impl(LORA_ENGINE).LoRAEngine(init_weights(Llama(config), seed=0), None, registry, num_blocks=16)
    with pytest.raises(ValueError, match="nope"):
        engine.add_request([3, 4, 5], _params(impl, lora="nope"))
    out = engine.generate([[3, 4, 5]], [_params(impl, max_tokens=2, lora="known")])[0]
    assert len(out.token_ids) == 2 and not engine.has_unfinished_requests(), "a known adapter's request must run"


# ---- §4 the engine: a mixed batch ---------------------------------------------------------------


def _record_logits(impl, monkeypatch):
    """Patch the engine's sampler to keep every logits row it gets, per request (by its SamplingParams)."""
    engine_mod = impl("stage04_batching.engine")
    rows: dict[int, list[torch.Tensor]] = {}

    def greedy(logits, params, generator=None):
        rows.setdefault(id(params), []).append(logits.detach().clone())
        return int(logits.argmax())

    monkeypatch.setattr(engine_mod, "sample", greedy)
    return rows


@pytest.mark.parametrize("budget", [512, 13], ids=["one-prefill", "chunked"])
@pytest.mark.parametrize("config", list(LLAMA_CONFIGS), ids=list(LLAMA_CONFIGS))
def test_mixed_batch_logits_equal_peft_merged_models(impl, tmp_path, monkeypatch, config, budget):
    seed = list(LLAMA_CONFIGS).index(config)
    hf = random_llama(seed, **LLAMA_CONFIGS[config])
    kinds = list(ADAPTER_KINDS)
    for i, kind in enumerate(kinds):
        save_random_adapter(hf, tmp_path / kind, seed=100 * seed + i, **ADAPTER_KINDS[kind])
    registry = impl(LORA_MOD).AdapterRegistry(
        labkit_from_hf(hf).config, {k: tmp_path / k for k in kinds}, max_loras=len(kinds), max_rank=8
    )
    engine = impl(LORA_ENGINE).LoRAEngine(labkit_from_hf(hf), None, registry, num_blocks=96, block_size=4,
                                          max_num_seqs=8, max_num_batched_tokens=budget)  # fmt: skip
    rng = random.Random(seed)
    loras = [kinds[0], None, kinds[1], kinds[2], kinds[0], kinds[3], None]
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(3, 19))] for _ in loras]
    params = [_params(impl, max_tokens=3, ignore_eos=True, lora=name) for name in loras]
    rows = _record_logits(impl, monkeypatch)
    outs = engine.generate(prompts, params)
    refs = {name: hf if name is None else peft_merged(hf, tmp_path / name) for name in set(loras)}
    for i, (name, prompt, p, out) in enumerate(zip(loras, prompts, params, outs, strict=True)):
        full = prompt + out.token_ids
        want = hf_logits(refs[name], full[:-1])[len(prompt) - 1 :]
        got = torch.stack(rows[id(p)])
        err = relative_error(got, want)
        assert err < 1e-4, (
            f"seed={seed}, {config}, budget {budget}: request {i} (adapter {name}) logits differ from HF with "
            f"the adapter merged by peft (relative error {err:.2e})"
        )


def test_shipped_adapters_equal_peft_on_the_tiny_target(impl, monkeypatch):
    from transformers import AutoModelForCausalLM

    from labkit.checkpoint import load_tokenizer
    from labkit.model import from_pretrained

    names = sorted(p.name for p in LORA.iterdir())
    assert len(names) >= 2, f"labkit/assets/lora should hold the course's adapters, found {names}"
    tokenizer = load_tokenizer(TARGET)
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    registry = impl(LORA_MOD).AdapterRegistry(from_pretrained(TARGET).config, {n: LORA / n for n in names}, max_loras=2)
    engine = impl(LORA_ENGINE).LoRAEngine(from_pretrained(TARGET), tokenizer, registry, num_blocks=64)
    prompt = "Once upon a time, there was a little"
    loras = [*names, None]
    params = [_params(impl, max_tokens=2, lora=name) for name in loras]
    rows = _record_logits(impl, monkeypatch)
    outs = engine.generate([prompt] * len(loras), params)
    ids = tokenizer.encode(prompt).ids
    for name, p, out in zip(loras, params, outs, strict=True):
        ref = hf if name is None else peft_merged(hf, LORA / name)
        want = hf_logits(ref, ids + out.token_ids[:-1])[len(ids) - 1 :]
        err = relative_error(torch.stack(rows[id(p)]), want)
        assert err < 1e-4, f"seed=0: shipped adapter {name}: logits differ from peft's merge (relative error {err:.2e})"


@pytest.mark.parametrize("seed", [0, 1])
def test_load_and_evict_under_load_never_serves_the_wrong_adapter(impl, tmp_path, seed):
    """Four adapters, two slots, requests of every adapter arriving while others run: each request's
    greedy output equals HF generating it alone with its own adapter merged."""
    hf = random_llama(seed, **LLAMA_CONFIGS["gqa2-tied"])
    kinds = list(ADAPTER_KINDS)
    for i, kind in enumerate(kinds):
        save_random_adapter(hf, tmp_path / kind, seed=10 * seed + i, std=0.15, **ADAPTER_KINDS[kind])
    registry = impl(LORA_MOD).AdapterRegistry(
        labkit_from_hf(hf).config, {k: tmp_path / k for k in kinds}, max_loras=2, max_rank=8
    )
    engine = impl(LORA_ENGINE).LoRAEngine(labkit_from_hf(hf), None, registry, num_blocks=96, block_size=4, max_num_seqs=3)  # fmt: skip
    rng = random.Random(seed)
    loras = [rng.choice([*kinds, None]) for _ in range(14)]
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(2, 12))] for _ in loras]
    max_tokens = [rng.randint(2, 6) for _ in loras]
    ids, done, aborted = {}, {}, set()
    for i in range(len(loras)):
        ids[engine.add_request(prompts[i], _params(impl, max_tokens=max_tokens[i], ignore_eos=True, lora=loras[i]))] = i  # fmt: skip
        if i == 5:  # a client leaves: its pin must go too
            victim = next(rid for rid, j in ids.items() if j not in done)
            engine.abort(victim)
            aborted.add(ids[victim])
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    missing = set(range(len(loras))) - aborted - set(done)
    assert not missing and not aborted & set(done), f"seed={seed}: requests {missing} never finished"
    assert registry.num_loads > 2, f"seed={seed}: the test should make the registry evict (loads {registry.num_loads})"
    refs = {name: hf if name is None else peft_merged(hf, tmp_path / name) for name in set(loras)}
    for i, tokens in done.items():
        what = f"seed={seed}: request {i} (adapter {loras[i]}), alone with its adapter merged"
        assert_hf_greedy(tokens, refs[loras[i]], prompts[i], max_tokens[i], FP32_MARGIN, what)
    assert not any(registry.pins.values()), f"seed={seed}: finished requests left pins {registry.pins}"
