"""labkit.model on real checkpoints' architectures: equal to HF, or a clear refusal (issue 13).

Each family is a random-init HF model built from a real checkpoint's config.json fields (shrunk,
every flag kept; see labkit.testing.FAMILY_CONFIGS), saved as a folder and loaded back through
labkit.model.from_pretrained, the path a learner's downloaded checkpoint takes.
"""

import dataclasses
import json

import pytest
import torch

from labkit import checkpoint
from labkit.model import Config, from_pretrained
from labkit.testing import (
    FAMILY_CONFIGS,
    FP32_MARGIN,
    assert_hf_greedy,
    family_config_json,
    random_tokens,
    relative_error,
    save_family,
)

SEED = 13
T = 24  # longer than Mistral's window (5) and the llama3 scaling's original length (16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, in-memory HF model)}, each saved once for the whole module."""
    root = tmp_path_factory.mktemp("families")
    return {name: (root / name, save_family(name, root / name, seed=SEED + i)) for i, name in enumerate(FAMILY_CONFIGS)}


@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_logits_equal_hf(folders, name):
    path, hf = folders[name]
    model = from_pretrained(path)
    ids = random_tokens(SEED, T, model.config.vocab_size, batch=2)
    with torch.no_grad():
        err = relative_error(model(ids), hf(ids).logits)
    assert err < 1e-4, f"{name}: relative error {err:.2e} vs HF, seed={SEED}"


@pytest.mark.parametrize("name", ["llama3.1-4x-layout", "llama3.2-tied", "llama-linear-4x-type", "mistral-window"])
def test_the_feature_matters_at_test_lengths(folders, name):
    """Dropping the RoPE scaling or the window must change the logits, or the parity test above proves nothing."""
    path, hf = folders[name]
    model = from_pretrained(path)
    plain = type(model)(dataclasses.replace(model.config, rope_scaling=None, sliding_window=None))
    plain.load_state_dict(model.state_dict())
    ids = random_tokens(SEED, T, model.config.vocab_size, batch=1)
    with torch.no_grad():
        assert relative_error(plain(ids), hf(ids).logits) > 1e-3, f"{name}: the feature does not change the logits"


@pytest.mark.parametrize("name", ["llama3.2-tied", "mistral-window", "qwen2-tied", "qwen3-bias-untied"])
def test_cached_generate_equals_hf_greedy(folders, name):
    path, hf = folders[name]
    prompt = random_tokens(SEED + 1, 7, 101).tolist()
    got = from_pretrained(path).generate(prompt, 12, stop_at_eos=False)
    assert_hf_greedy(got, hf, prompt, 12, FP32_MARGIN, f"{name} seed={SEED}")


def test_config_round_trips_through_to_hf():
    from transformers import AutoConfig

    for name in FAMILY_CONFIGS:
        config = Config.from_hf(family_config_json(name))
        hf_cfg = config.to_hf()
        hf_cfg.pop("torch_dtype")
        assert Config.from_hf(AutoConfig.for_model(**hf_cfg).to_dict()) == config, name


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("model_type", "gemma2", "model_type='gemma2'"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type='yarn'"),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(field, value, expect):
    cfg = family_config_json("llama2")
    if field == "rope_scaling":
        cfg.pop("rope_parameters")
    cfg[field] = value
    with pytest.raises(checkpoint.CheckpointError, match="supported") as err:
        Config.from_hf(cfg)
    assert expect in str(err.value), str(err.value)


def test_qwen_sliding_layers_are_refused():
    cfg = dict(family_config_json("qwen2-tied"), use_sliding_window=True)
    with pytest.raises(checkpoint.CheckpointError, match="use_sliding_window=True"):
        Config.from_hf(cfg)
    cfg = dict(family_config_json("qwen3"), layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(checkpoint.CheckpointError, match="layer_types"):
        Config.from_hf(cfg)


def test_a_tensor_nothing_reads_is_an_error_naming_it(folders, tmp_path):
    """A Qwen2 folder relabelled Llama keeps its q/k/v biases: loading must not drop them silently."""
    path, _ = folders["qwen2.5-untied"]
    (tmp_path / "m").mkdir()
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "m" / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        from_pretrained(tmp_path / "m")


def test_a_tied_copy_that_differs_is_refused(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = folders["qwen2.5-untied"]
    (tmp_path / "m").mkdir()
    cfg = dict(json.loads((path / "config.json").read_text()), tie_word_embeddings=True)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    save_file(load_file(path / "model.safetensors"), tmp_path / "m" / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="tie_word_embeddings"):
        from_pretrained(tmp_path / "m")


def test_a_model_too_big_for_memory_is_refused_before_loading(folders, monkeypatch):
    path, _ = folders["llama3-4x-layout"]
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 1000)
    with pytest.raises(checkpoint.CheckpointError, match="GiB of RAM"):
        from_pretrained(path)
    monkeypatch.setenv("LABKIT_MEMORY_CHECK", "0")
    from_pretrained(path)


def test_num_params_matches_the_model():
    from labkit.model import Llama, num_params

    for name in FAMILY_CONFIGS:
        config = Config.from_hf(family_config_json(name))
        model = Llama(config)
        assert num_params(config) == model.num_params(), name


def test_a_big_sharded_folder_reports_each_shard_and_loads_exactly(tmp_path, monkeypatch, capsys):
    from labkit.testing import random_family

    hf, _ = random_family("qwen2-tied", seed=SEED)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    n_shards = len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert n_shards > 1
    monkeypatch.setattr(checkpoint, "PROGRESS_BYTES", 0)  # every folder counts as big
    model = from_pretrained(tmp_path)
    err = capsys.readouterr().err
    assert f"shard {n_shards}/{n_shards}" in err and "GiB" in err, err
    ids = random_tokens(SEED, T, model.config.vocab_size, batch=1)
    with torch.no_grad():
        assert relative_error(model(ids), hf(ids).logits) < 1e-4


def test_model_folder_reads_model_and_draft(monkeypatch, tmp_path):
    import labkit

    monkeypatch.delenv("MODEL", raising=False)
    monkeypatch.delenv("DRAFT", raising=False)
    assert checkpoint.model_folder() == labkit.TARGET and checkpoint.model_folder("DRAFT") == labkit.DRAFT
    monkeypatch.setenv("MODEL", str(tmp_path))
    assert checkpoint.model_folder("MODEL") == tmp_path
    with pytest.raises(ValueError, match="MODEL or DRAFT"):
        checkpoint.model_folder("TARGET")
