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
