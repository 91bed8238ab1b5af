"""Stage 02 on the course's real model (SmolLM2-135M-Instruct, `make setup`): the KV cache's speedup.

    make bench STAGE=02_real [QUICK=1]     (IMPL=student times your own cache)

stage02.py's comparison, run on SmolLM2 instead of the tiny target: greedy generation with the
cache against re-running the whole sequence, interleaved in one run, medians of repeats, and the
cached decode step on its own. SmolLM2's weights (538 MB in float32) are read once per step either
way; without a cache each step also recomputes every earlier token, with 135 M parameters instead
of 6.6 M, so the gap opens much earlier than on the tiny target.
"""

from labkit import bench
from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.device import pin_threads
from labkit.model import from_pretrained

from .stage02 import run


def main(quick: bool = False) -> bench.Result:
    pin_threads(1)  # a busy 2-core machine: one thread is the steady measurement
    folder = require_real_model()
    model = from_pretrained(folder).eval()
    which = f"{folder.name} ({model.num_params() / 1e6:.1f}M params)"
    lengths, new_tokens, repeats = ((128,), 4, 1) if quick else ((128, 512), 8, 3)
    return run(model, which, load_tokenizer(folder), lengths, new_tokens, repeats, 5 if quick else 20)
