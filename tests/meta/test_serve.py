"""stage04's `serve` command: --model defaults to $MODEL, else labkit's tiny target; the tokenizer is
loaded once; the served model is named after its folder."""

import shutil

import pytest
from fastapi.testclient import TestClient

from labkit import ROOT, TARGET, impl

pytestmark = pytest.mark.skipif(
    not (ROOT / "solutions").is_dir(),
    reason="runs the reference solution's server, which the learner edition does not have",
)


@pytest.fixture
def started(monkeypatch):
    """Run serve.main without a server: returns (the app it would serve, the folders it loaded a tokenizer from)."""
    serve = impl.load("stage04_batching.serve", impl="solution")
    apps, tokenizer_loads = [], []
    real = serve.load_tokenizer
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.setattr(serve, "load_tokenizer", lambda path: tokenizer_loads.append(str(path)) or real(path))

    def start(*argv):
        apps.clear()
        tokenizer_loads.clear()
        serve.main(list(argv))
        with TestClient(apps[0]) as client:
            names = [m["id"] for m in client.get("/v1/models").json()["data"]]
        return names, list(tokenizer_loads)

    return start


@pytest.mark.slow  # loads the tiny target three times
def test_serve_takes_the_model_from_the_flag_then_MODEL_then_the_tiny_target(started, monkeypatch, tmp_path):
    mine = tmp_path / "my-model"
    shutil.copytree(TARGET, mine)
    monkeypatch.delenv("MODEL", raising=False)
    assert started() == ([TARGET.name], [str(TARGET)]), "no flag, no $MODEL: the tiny target, tokenizer loaded once"
    monkeypatch.setenv("MODEL", str(mine))
    assert started() == (["my-model"], [str(mine)]), "MODEL=path make serve serves that folder"
    assert started("--model", str(TARGET)) == ([TARGET.name], [str(TARGET)]), "--model wins over $MODEL"


@pytest.mark.slow  # loads the tiny target
def test_serve_flags_carry_vllm_names_into_every_part_of_the_engine(monkeypatch):
    serve = impl.load("stage04_batching.serve", impl="solution")
    config_mod = impl.load("stage04_batching.config", impl="solution")
    apps = []
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **kw: apps.append(app))
    serve.main(
        ["--model", str(TARGET), "--block-size", "8", "--num-gpu-blocks-override", "40", "--max-num-seqs", "3"]
        + ["--max-num-batched-tokens", "64", "--max-model-len", "200", "--no-enable-prefix-caching"]
    )
    engine = apps[0].state.core.engine
    want = config_mod.EngineConfig(8, 40, 3, 64, 200, False)
    assert engine.config == want, f"the flags should build {want}, the engine holds {engine.config}"
    bm, sched = engine.block_manager, engine.scheduler
    assert (bm.num_blocks, bm.block_size, bm.enable_prefix_caching, engine.cache.block_size) == (40, 8, False, 8)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, engine.max_model_len) == (3, 64, 200)
    serve.main(["--model", str(TARGET)])
    assert apps[1].state.core.engine.config == config_mod.EngineConfig(), "without flags: EngineConfig's defaults"


def test_engine_config_refuses_settings_it_cannot_honour():
    EngineConfig = impl.load("stage04_batching.config", impl="solution").EngineConfig
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="max_model_len=5000 exceeds .* 64 blocks x 16 tokens = 1024"):
        EngineConfig(num_blocks=64, max_model_len=5000).context_length(4096)
    assert EngineConfig(num_blocks=64).context_length(512) == 512, "the model's positions bound the context"
    assert EngineConfig(num_blocks=8).context_length(512) == 128, "so does the pool"
    with pytest.raises(TypeError, match="no engine setting blocksize"):
        EngineConfig().replace(blocksize=8)


def test_serve_usage_says_which_model_make_serve_runs():
    """`make serve` runs the real model (the Makefile's MODEL defaults to `real`), `python -m ...serve` the tiny
    target: serve.py's usage must not promise the tiny one to `make serve`."""
    recipe = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "stage04_batching.serve" in line)
    assert "MODEL:-real}" in recipe, recipe
    usage = (ROOT / "stage04_batching" / "serve.py").read_text().split('"""')[1]
    plain = [line for line in usage.splitlines() if line.strip().startswith("make serve")]
    assert plain and all("SmolLM2" in line and "tiny" not in line for line in plain), usage
