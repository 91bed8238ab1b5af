"""The pipeline (lab6.ipynb §3 and §5) on real processes (gloo, 2 and 3 ranks): greedy decoding stage to
stage equals Hugging Face's, micro-batches come out with HF's logits, the traffic is activations only, and a
stage that dies or stalls is an error on its peers, not a hang. One process group per world size runs every
check. References: HF LlamaForCausalLM (computed here, in the pytest process) and the hand count of the bytes."""

import time
import traceback

import pytest
import torch
import torch.distributed as dist

from labkit.distributed import RankFailed, launch
from labkit.model import Config, Llama
from labkit.testing import (
    FP32_MARGIN,
    LLAMA_CONFIGS,
    assert_greedy_within,
    hf_greedy_logits,
    random_llama,
    random_tokens,
)

pytestmark = pytest.mark.dist
SEED = 11
NEW_TOKENS = 6
CONFIGS = {  # 4 and 5 layers, so 3 stages have a layer each to spare
    "gqa4-untied": dict(LLAMA_CONFIGS["gqa4-3layers"], num_hidden_layers=4, tie_word_embeddings=False),
    "mqa-odd-tied": dict(LLAMA_CONFIGS["mqa-odd"], num_hidden_layers=5, tie_word_embeddings=True),
}
PROMPT_LENGTHS = (7, 10)  # micro-batches of other lengths too: (7, 10, 3, 8)


def _stages(cases):
    """This rank's stage of each case (a partition balanced on the weights' costs)."""
    from pipeline_helpers import weight_costs

    from labkit.impl import load

    partition = load("stage07_tensor_parallel.pipeline.partition")
    stage_mod = load("stage07_tensor_parallel.pipeline.stage")
    for name, (config, state, prompt, micro) in cases.items():
        model = Llama(config).eval()
        model.load_state_dict(state, strict=False)  # a tied lm_head.weight is the embedding's
        bounds = partition.balanced_partition(weight_costs(config), dist.get_world_size())
        yield name, stage_mod.PipelineStage(model, bounds, dist.get_rank()), prompt, micro


def greedy_checks(cases):
    """Worker (§3): greedy decoding through this rank's stage of each case, and the traffic it made."""
    from pipeline_helpers import Traffic

    from labkit.impl import load

    generate = load("stage07_tensor_parallel.pipeline.generate")
    traffic, out = Traffic(), {}
    for name, stage, prompt, _ in _stages(cases):
        try:
            traffic.reset()
            tokens = generate.pipeline_generate(stage, prompt, NEW_TOKENS, timeout_s=30)
            out[name] = dict(tokens=tokens, bytes=dict(traffic.bytes), collectives=traffic.collectives())
            out[name]["layers"] = len(stage.layers)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def microbatch_checks(cases):
    """Worker (§5): each case's micro-batches through this rank's stage, by the fill/drain schedule."""
    from labkit.impl import load

    schedule = load("stage07_tensor_parallel.pipeline.schedule")
    out = {}
    for name, stage, _, micro in _stages(cases):
        try:
            run = schedule.run_microbatches(stage, micro, timeout_s=30)
            out[name] = dict(micro_logits=run["logits"], busy_s=run["busy_s"], wall_s=run["wall_s"])
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def references():
    cases, expected = {}, {}
    for i, (name, overrides) in enumerate(CONFIGS.items()):
        hf = random_llama(SEED + i, **overrides)
        config = Config.from_hf(hf.config.to_dict())
        prompt = (random_tokens(SEED + i, PROMPT_LENGTHS[i], config.vocab_size - 3) + 3).tolist()  # no pad id 0
        micro = [prompt, prompt[:3], (random_tokens(SEED + 50 + i, 8, config.vocab_size - 3) + 3).tolist()]
        tokens, logits = hf_greedy_logits(hf, prompt, NEW_TOKENS)
        with torch.no_grad():
            micro_logits = [hf(torch.tensor([m])).logits[0, -1] for m in micro]
        cases[name] = (config, {k: v.clone() for k, v in hf.state_dict().items()}, prompt, micro)
        expected[name] = dict(tokens=tokens, logits=logits, micro_logits=micro_logits, config=config, prompt=prompt)
    return cases, expected


def _launch(worker, p, references):
    cases, expected = references
    try:
        results = launch(worker, p, cases, timeout=150)
    except (RankFailed, TimeoutError) as e:
        results = e
    return p, results, expected


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"pp{p}")
def group(request, references):
    """(p, per-rank results of greedy_checks, HF references); the run's exception if the group failed."""
    return _launch(greedy_checks, request.param, references)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"pp{p}")
def microbatch_group(request, references):
    """(p, per-rank results of microbatch_checks, HF references)."""
    return _launch(microbatch_checks, request.param, references)


def _per_rank(group, name):
    p, results, _ = group
    if isinstance(results, Exception):
        pytest.fail(f"the PP={p} process group failed before reporting (seed={SEED}):\n{results}")
    for rank, r in enumerate(results):
        if "error" in r[name]:
            pytest.fail(f"PP={p}: case {name!r} raised on rank {rank} (seed={SEED}):\n{r[name]['error']}")
    return [r[name] for r in results]


@pytest.mark.parametrize("name", CONFIGS)
def test_pipeline_greedy_equals_hf(impl, group, name):
    p, _, expected = group
    want = expected[name]
    per_rank = _per_rank(group, name)
    assert [r["layers"] for r in per_rank].count(0) <= 1, (
        f"PP={p}: {name} stages hold {[r['layers'] for r in per_rank]} layers"
    )
    for rank in (0, p - 1):
        assert_greedy_within(
            per_rank[rank]["tokens"], want["tokens"], want["logits"], FP32_MARGIN,
            f"PP={p} rank {rank}, {name} (seed={SEED}), prompt of {len(want['prompt'])}: HF generate",
        )  # fmt: skip
    for rank in range(1, p - 1):
        assert per_rank[rank]["tokens"] == [], (
            f"PP={p}: middle rank {rank} returned {per_rank[rank]['tokens']}, expected []"
        )


@pytest.mark.parametrize("name", CONFIGS)
def test_pipeline_sends_activations_only(impl, group, name):
    """Each non-last stage sends one activation a step: the prompt's (T, hidden), then one position's; the last
    stage sends each token back to rank 0. No collective, no logits on the wire."""
    p, _, expected = group
    c, T = expected[name]["config"], len(expected[name]["prompt"])
    per_rank = _per_rank(group, name)
    for rank, r in enumerate(per_rank):
        assert not r["collectives"], f"PP={p} rank {rank}: pipeline_generate made collectives {r['collectives']}"
        sent = r["bytes"].get("isend", 0) + r["bytes"].get("send", 0)
        want = 8 * NEW_TOKENS if rank == p - 1 else (T + NEW_TOKENS - 1) * c.hidden_size * 4
        assert sent == want, (
            f"PP={p} rank {rank}, {name}: sent {sent} B in {NEW_TOKENS} steps of a {T}-token prompt; the hand count "
            f"is {want} B ({'one int64 token a step to rank 0' if rank == p - 1 else 'T + steps - 1 positions of hidden float32'})"
        )


@pytest.mark.parametrize("name", CONFIGS)
def test_microbatches_give_hf_logits(impl, microbatch_group, name):
    p, _, expected = microbatch_group
    per_rank = _per_rank(microbatch_group, name)
    got, want = per_rank[-1]["micro_logits"], expected[name]["micro_logits"]
    assert len(got) == len(want), f"PP={p}: the last stage returned {len(got)} micro-batches' logits of {len(want)}"
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        delta = (g - w).abs().max().item()
        assert delta < 1e-4, f"PP={p}, {name}: micro-batch {j}'s last logits differ from HF's by {delta:.2e}"
    for rank, r in enumerate(per_rank):
        assert 0 < r["busy_s"] <= r["wall_s"], f"PP={p} rank {rank}: busy {r['busy_s']} s of a {r['wall_s']} s wall"
        if rank < p - 1:
            assert r["micro_logits"] == [], f"PP={p}: rank {rank} is not the last stage but returned logits"


# ---------------------------------------------------------------- a stage that dies or stalls


def die_mid_pipeline(config, state, prompt, victim, how):
    """Worker: rank `victim` leaves after its second step (its process group torn down, as a crash closes its
    sockets) or stalls for 5 s (the timeout is 3 s); the others must get labkit.distributed.PeerLost, not hang."""
    from pipeline_helpers import weight_costs

    from labkit.impl import load

    partition = load("stage07_tensor_parallel.pipeline.partition")
    stage = load("stage07_tensor_parallel.pipeline.stage").PipelineStage
    generate = load("stage07_tensor_parallel.pipeline.generate")
    model = Llama(config).eval()
    model.load_state_dict(state, strict=False)
    rank, p = dist.get_rank(), dist.get_world_size()
    s = stage(model, partition.balanced_partition(weight_costs(config), p), rank)
    if rank == victim:
        forward, calls = s.forward, [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                if how == "dies":
                    dist.destroy_process_group()
                    raise SystemExit("died")
                time.sleep(5)
            return forward(*args, **kwargs)

        s.forward = dying
    t0 = time.monotonic()
    try:
        generate.pipeline_generate(s, prompt, NEW_TOKENS, timeout_s=3)
        return ("finished", "", time.monotonic() - t0)
    except SystemExit:
        return ("victim", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


@pytest.mark.parametrize("p,victim,how", [(3, 1, "dies"), (2, 1, "stalls")])
def test_a_dead_or_stalled_stage_is_an_error_not_a_hang(impl, references, p, victim, how):
    cases, _ = references
    config, state, prompt, _ = cases["gqa4-untied"]
    per_rank = launch(die_mid_pipeline, p, config, state, prompt, victim, how, timeout=90)
    for rank, (kind, message, seconds) in enumerate(per_rank):
        if rank == victim and how == "dies":
            continue
        if how == "stalls" and rank == victim:
            continue
        assert kind == "PeerLost", (
            f"PP={p}, rank {victim} {how} at its third step: rank {rank} ended with {kind} {message[:300]!r} after "
            f"{seconds:.1f} s; it should raise labkit.distributed.PeerLost (every send and receive through "
            "labkit.distributed with the timeout)"
        )
