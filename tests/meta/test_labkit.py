"""labkit is not graded, but every stage stands on it: its model, loaders and assets are tested here."""

import json

import pytest
import torch

import labkit
from labkit import bench, checkpoint, impl
from labkit.model import Config, Llama, from_pretrained, init_weights, save
from labkit.testing import (
    FP32_MARGIN,
    LLAMA_CONFIGS,
    assert_hf_greedy,
    hf_from_labkit,
    labkit_from_hf,
    random_labkit_llama,
    random_llama,
    random_tokens,
)


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_model_logits_equal_hf_llama(name):
    hf = random_llama(seed=7, **LLAMA_CONFIGS[name])
    model = labkit_from_hf(hf)
    ids = random_tokens(seed=7, length=23, vocab_size=97, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0, msg=f"config {name}")


@pytest.mark.parametrize("name", LLAMA_CONFIGS)
def test_cached_decode_equals_full_forward(name):
    model = labkit_from_hf(random_llama(seed=3, **LLAMA_CONFIGS[name]))
    ids = random_tokens(seed=3, length=21, vocab_size=97, batch=2)
    cache = model.new_cache(batch_size=2, max_seq_len=32)
    with torch.no_grad():
        chunks = [model(ids[:, :9], cache), model(ids[:, 9:10], cache), model(ids[:, 10:], cache)]
        torch.testing.assert_close(torch.cat(chunks, 1), model(ids), atol=1e-5, rtol=0)
    assert cache.length == 21


@pytest.mark.parametrize("keep", [1, 5])
def test_logits_to_keep_equals_the_last_rows(keep):
    """An engine's prefill asks for the last position's logits only; HF's logits_to_keep is the reference."""
    hf = random_llama(seed=4, **LLAMA_CONFIGS["gqa2-tied"])
    model = labkit_from_hf(hf)
    ids = random_tokens(seed=4, length=11, vocab_size=97, batch=2)
    with torch.no_grad():
        got = model(ids, model.new_cache(2, 16), logits_to_keep=keep)
        torch.testing.assert_close(got, hf(ids, logits_to_keep=keep).logits, atol=1e-5, rtol=0)


def test_truncated_cache_continues_like_a_fresh_run():
    model = labkit_from_hf(random_llama(seed=4))
    ids = random_tokens(seed=4, length=15, vocab_size=97, batch=1)
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        model(ids, cache)
        cache.truncate(10)
        got = model(ids[:, 10:12], cache)
        torch.testing.assert_close(got, model(ids[:, :12])[:, 10:], atol=1e-5, rtol=0)


def test_cache_overflow_and_bad_truncate_say_what_to_do():
    model = labkit_from_hf(random_llama(seed=5))
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="larger max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(3)


def test_generate_equals_hf_greedy():
    hf = random_llama(seed=6, **LLAMA_CONFIGS["gqa4-3layers"])
    prompt = random_tokens(6, 9, 97).tolist()
    got = labkit_from_hf(hf).generate(prompt, 12, stop_at_eos=False)
    assert_hf_greedy(got, hf, prompt, 12, FP32_MARGIN, "seed=6: labkit's generate")


def test_hf_roundtrip_of_weights():
    model = random_labkit_llama(1, intermediate_size=128)
    ids = random_tokens(1, 11, 97, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(hf_from_labkit(model)(ids).logits, model(ids), atol=1e-5, rtol=0)


def test_save_then_load_with_transformers_and_labkit(tmp_path):
    from transformers import AutoModelForCausalLM

    model = random_labkit_llama(2, intermediate_size=128, num_key_value_heads=1)
    save(model, tmp_path / "m", dtype=torch.float32)
    ids = random_tokens(2, 13, 97, batch=1)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=0)
        torch.testing.assert_close(from_pretrained(tmp_path / "m")(ids), model(ids), atol=0, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_loads_a_folder_written_by_save_pretrained(tmp_path, tied):
    hf = random_llama(seed=8, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path)
    ids = random_tokens(8, 10, 97, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path)(ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_checkpoint_errors_name_the_problem(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="not a folder"):
        checkpoint.read_config(tmp_path / "nope")
    with pytest.raises(checkpoint.CheckpointError, match="no config.json"):
        checkpoint.read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(checkpoint.CheckpointError, match="llama family"):
        checkpoint.read_config(tmp_path, family="llama")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(checkpoint.CheckpointError, match="pickle"):
        checkpoint.load_state_dict(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="not valid JSON"):
        checkpoint.read_config(tmp_path)


def test_shape_mismatch_between_config_and_weights_is_reported(tmp_path):
    hf = random_llama(seed=9)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(checkpoint.CheckpointError, match="different models"):
        from_pretrained(tmp_path)


def test_a_failed_save_leaves_the_old_checkpoint_intact(tmp_path):
    model = random_labkit_llama(0, intermediate_size=128, num_hidden_layers=1)
    save(model, tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    with pytest.raises(FileNotFoundError):
        save(model, tmp_path / "m", extra_files=[tmp_path / "missing.json"])  # fails mid-write
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "no temporary folder may be left behind"


def test_impl_switch(monkeypatch):
    with pytest.raises(ValueError, match="stage folder"):
        impl.load("kv_cache")
    monkeypatch.setenv("LABS_IMPL", "teacher")
    with pytest.raises(ValueError, match="LABS_IMPL"):
        impl.current()
    with pytest.raises(ModuleNotFoundError, match="stage name"):
        impl.load("stage99_nothing.module", impl="student")


def test_benchmark_names_of_every_stage_row():
    assert [bench.benchmark_name(s) for s in ("2", "02", "2b", "02B", "7", "04_latency", "decode")] == [
        "stage02", "stage02", "stage02b", "stage02b", "stage07", "stage04_latency", "decode"
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="such as 02"):
        bench.benchmark_name("two")


@pytest.mark.parametrize("path", [labkit.TARGET, labkit.DRAFT], ids=["target", "draft"])
def test_tiny_models_load_offline_with_transformers(path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok("Once upon a time, there was a", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(path)(ids), hf(ids).logits, atol=1e-4, rtol=0)
    assert tok.decode(ids[0]) == "Once upon a time, there was a"


def test_tiny_models_fit_the_course():
    target, draft = (
        Config.from_hf(checkpoint.read_config(labkit.TARGET)),
        Config.from_hf(checkpoint.read_config(labkit.DRAFT)),
    )
    for c in (target, draft):
        assert c.hidden_size % 128 == 0 and c.intermediate_size % 128 == 0, "stage 03 quantizes in groups of 128"
        assert c.max_position_embeddings >= 1024, "stage 02 generates 1024-token sequences"
    assert target.vocab_size == draft.vocab_size
    assert (labkit.TARGET / "tokenizer.json").read_bytes() == (labkit.DRAFT / "tokenizer.json").read_bytes()
    size = sum(p.stat().st_size for d in (labkit.TARGET, labkit.DRAFT) for p in d.iterdir())
    assert size < 30e6, f"assets take {size / 1e6:.1f} MB"
    report = json.loads((labkit.ASSETS / "training_report.json").read_text())
    assert report["greedy_agreement_draft_vs_target"] >= 0.8


def test_medusa_heads_round_trip_and_refuse_another_width(tmp_path):
    """labkit.medusa: heads start as the identity (they repeat the lm_head), save as bf16, load back onto
    a target, and refuse a target whose hidden size differs."""
    from labkit import medusa
    from labkit.checkpoint import CheckpointError

    target = init_weights(Llama(Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)))  # fmt: skip
    heads = medusa.attach(target, 3)
    h = torch.randn(5, 32)
    torch.testing.assert_close(heads(h), target.lm_head(h)[:, None].expand(5, 3, 64))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    medusa.save(heads, tmp_path / "heads", {"note": "test"})
    again = medusa.load(tmp_path / "heads", target)
    assert "lm_head.weight" not in again.state_dict(), "the heads must not store the target's lm_head"
    torch.testing.assert_close(again(h), heads(h), atol=2e-2, rtol=2e-2)  # bf16 weights
    wider = Llama(Config(vocab_size=64, hidden_size=48, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=24))  # fmt: skip
    with pytest.raises(CheckpointError, match="hidden_size 32 cannot read a target of hidden_size 48"):
        medusa.load(tmp_path / "heads", wider)


def test_eagle_study_trains_each_part_for_its_share_of_the_steps_and_keeps_only_matching_points(monkeypatch):
    """labkit.train_eagle.eagle_study, its training stubbed: 1/n of the answers trains steps // n steps, the shipped
    head is the curve's last point, and a kept point is copied only where recipe, tokens and steps all match."""
    from labkit import train_eagle as te

    trained = []

    def fake_train(target, part, vocab, index_of, steps, variant, batch, seed):
        trained.append((variant, len(part), steps))
        return None, [], 1.0

    monkeypatch.setattr(te, "train_head", fake_train)
    monkeypatch.setattr(te, "head_report", lambda head, part, heldout: {"first_draft_top1": {}, "heldout": {"n": 0}})
    target = Llama(Config(vocab_size=16, hidden_size=8, num_attention_heads=2, num_key_value_heads=1))
    rows = [(torch.arange(3 + i % 5) % 16, None, 1, None) for i in range(64)]
    tokens = lambda n: sum(len(r[0]) for r in rows[: 64 // n])  # noqa: E731
    part = te.RECIPES_PART
    kept = [
        {"recipe": te.SHIPPED, "train_tokens": tokens(part), "steps": 800 // part, "heldout": "kept",
         "train_seconds": 9, "first_draft_top1": {}},
        {"recipe": "eagle3", "train_tokens": tokens(part), "steps": 600, "heldout": "stale", "train_seconds": 9,
         "first_draft_top1": {}},
    ]  # fmt: skip
    report = {"train_seconds": 5, "first_draft_top1": {}, "heldout": "shipped"}
    te.eagle_study(target, rows, [], 800, 4, 0, report, lambda: None, kept)
    curve = report["learning_curve"]
    assert [p["steps"] for p in curve] == [800 // n for n in te.CURVE], curve
    assert curve[-1]["heldout"] == "shipped" and curve[te.CURVE.index(part)]["heldout"] == "kept", curve
    assert (te.SHIPPED, 64 // part, 800 // part) not in trained, (
        "a point with the same recipe, tokens and steps was trained again"
    )
    assert ("eagle3", 64 // part, 800 // part) in trained, "a kept point trained for other steps was copied"
    assert report["recipes"]["eagle3"]["heldout"] == {"n": 0} and report["recipes"][te.SHIPPED]["heldout"] == "kept"
    assert (
        report["all_answers_at_the_recipes_steps"]["steps"] == 800 // part and (te.SHIPPED, 64, 800 // part) in trained
    )
