"""§2 of lab6.ipynb: pipeline stages chained in one process give the whole model's logits, with and without
each stage's own KV cache. Reference: Hugging Face LlamaForCausalLM on the same random weights, and its
past_key_values for the caches."""

import pytest
import torch

from labkit.testing import LLAMA_CONFIGS, labkit_from_hf, random_llama, random_tokens

STAGE = "stage07_tensor_parallel.pipeline.stage"
# (config, partition of its L + 2 units): uneven stages, a stage of the embedding alone, one of the head alone
CASES = {
    "mha-untied/2": ("mha-untied", [(0, 2), (2, 4)]),
    "gqa2-tied/3": ("gqa2-tied", [(0, 1), (1, 3), (3, 4)]),
    "gqa4-3layers/3": ("gqa4-3layers", [(0, 3), (3, 4), (4, 5)]),
    "mqa-odd/2": ("mqa-odd", [(0, 3), (3, 4)]),
    "gqa4-3layers/1": ("gqa4-3layers", [(0, 5)]),
}


def chain(stages, x, start=0, caches=None):
    for i, stage in enumerate(stages):
        x = stage(x, start, caches[i] if caches else None)
    return x


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    name, bounds = CASES[request.param]
    seed = list(CASES).index(request.param)
    hf = random_llama(seed, **LLAMA_CONFIGS[name], rope_parameters={"rope_type": "default", "rope_theta": 5e4})
    return request.param, seed, hf, labkit_from_hf(hf), bounds


def test_stages_in_a_chain_give_hf_logits(impl, case):
    label, seed, hf, model, bounds = case
    stages = [impl(STAGE).PipelineStage(model, bounds, s) for s in range(len(bounds))]
    ids = random_tokens(seed, 11, hf.config.vocab_size, batch=2)
    with torch.no_grad():
        got, want = chain(stages, ids), hf(ids).logits
    assert got.shape == want.shape, (
        f"{label}: the last stage returned {tuple(got.shape)}, expected logits {tuple(want.shape)}"
    )
    delta = (got - want).abs().max().item()
    assert delta < 1e-4, f"{label} (seed={seed}): chained stages differ from HF's logits by {delta:.2e}"


def test_middle_stages_hand_on_hidden_states(impl, case):
    label, seed, hf, model, bounds = case
    stages = [impl(STAGE).PipelineStage(model, bounds, s) for s in range(len(bounds))]
    ids = random_tokens(seed, 7, hf.config.vocab_size, batch=1)
    if len(stages) == 1:  # a pipeline of one stage is the whole model: it returns logits
        with torch.no_grad():
            shape = tuple(stages[0](ids, 0).shape)
        assert shape == (1, 7, hf.config.vocab_size), f"{label}: a single stage returned {shape}, not logits"
        return
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states  # [embeddings, after layer 1, ..., normed]
        x = ids
        for s, stage in enumerate(stages[:-1]):
            x = stage(x, 0)
            end = bounds[s][1]  # units [.., end): embedding plus layers 1 .. end - 1
            if end - 1 == hf.config.num_hidden_layers:  # HF's last hidden state is after the final norm
                continue
            delta = (x - hidden[end - 1]).abs().max().item()
            assert x.shape == (1, 7, hf.config.hidden_size) and delta < 1e-5, (
                f"{label} (seed={seed}): stage {s} of {bounds} should hand on the hidden state after its last "
                f"unit (HF's hidden_states[{end - 1}]): shape {tuple(x.shape)}, off by {delta:.2e}"
            )


def test_each_stage_caches_its_own_layers_and_decodes(impl, case):
    label, seed, hf, model, bounds = case
    stages = [impl(STAGE).PipelineStage(model, bounds, s) for s in range(len(bounds))]
    caches = [stage.new_cache(1, 16) for stage in stages]
    ids = random_tokens(seed + 50, 12, hf.config.vocab_size, batch=1)
    with torch.no_grad():
        want = hf(ids, use_cache=True)
        got = [chain(stages, ids[:, :9], 0, caches)]
        for t in range(9, 12):  # decode steps, one token each, at positions 9, 10, 11
            got.append(chain(stages, ids[:, t : t + 1], t, caches))
    delta = (torch.cat(got, 1) - want.logits).abs().max().item()
    assert delta < 1e-4, f"{label} (seed={seed}): prefill 9 + 3 cached decode steps differ from HF by {delta:.2e}"
    layer = 0
    for s, (stage, cache) in enumerate(zip(stages, caches, strict=True)):
        assert cache.length == 12, f"{label}: stage {s}'s cache holds {cache.length} positions after 12 tokens"
        for i in range(len(stage.layers)):
            hf_k = want.past_key_values.layers[layer + i].keys
            delta = (cache.k[i][:, :, :12] - hf_k).abs().max().item()
            assert delta < 1e-5, (
                f"{label}: stage {s}'s cache layer {i} is not model layer {layer + i}'s keys ({delta:.2e})"
            )
        layer += len(stage.layers)
