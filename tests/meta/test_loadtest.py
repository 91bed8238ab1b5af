"""labkit.bench.loadtest --chaos against the reference server: disconnects (streaming and not), invalid bodies
and requests failing inside the engine, mixed into normal load, leave every healthy request completed,
no KV block in use and the server still serving. Bounded: 48 requests, a few seconds on a small model."""

import asyncio

import pytest

from labkit import ROOT, TARGET, impl
from labkit.bench.loadtest import chaos, main
from labkit.checkpoint import load_tokenizer
from labkit.device import pin_threads
from labkit.serving import fail_on_marker, serving
from labkit.testing import random_labkit_llama

pytestmark = pytest.mark.skipif(
    not (ROOT / "solutions").is_dir(),
    reason="runs the reference solution's server, which the learner edition does not have",
)


@pytest.fixture(scope="module")
def reference_server():
    """The solution's server over a small random model with the tiny target's tokenizer and the fault hook."""
    tokenizer = load_tokenizer(TARGET)
    model = random_labkit_llama(0, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=512)
    engine = impl.load("stage04_batching.engine", impl="solution").LLMEngine(model, tokenizer, num_blocks=256)
    engine.fault_hook = fail_on_marker(tokenizer)
    app = impl.load("stage04_batching.api_server", impl="solution").create_app(engine, tokenizer, max_waiting=256)
    with pin_threads(1), serving(app) as url:
        yield url, engine


@pytest.mark.parametrize("seed", [0, 1])
def test_chaos_leaves_every_healthy_request_completed_and_no_block_in_use(reference_server, seed):
    url, engine = reference_server
    report = asyncio.run(asyncio.wait_for(chaos(url, n=48, concurrency=8, seed=seed), 120))
    assert report["ok"], f"seed={seed}: {report}"
    assert report["healthy"] and report["disconnected"] and report["invalid"] and report["faults"], (
        f"seed={seed}: the mix must hold every kind of request: {report}"
    )
    assert report["faults_failed_alone"] == report["faults"], f"seed={seed}: {report}"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests(), f"seed={seed}"


def test_chaos_command_line_exits_0_on_a_healthy_server(reference_server, capsys):
    url, _ = reference_server
    with pytest.raises(SystemExit) as done:
        main(["--url", url, "--chaos", "--requests", "16", "--concurrency", "4"])
    assert done.value.code == 0, capsys.readouterr().out
    assert "kv_cache_usage" in capsys.readouterr().out
