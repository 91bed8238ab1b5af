"""Stage 01 on the course's real model (SmolLM2-135M-Instruct, `make setup`): NumPy against PyTorch.

    OPENBLAS_NUM_THREADS=1 make bench STAGE=01_real [QUICK=1]     (IMPL=student times your own forward)

stage01.py's comparison, run on SmolLM2 instead of the tiny target: a 128-token prefill through
the NumPy Llama forward and through Hugging Face transformers on the same float32 weights,
interleaved in one run, medians of repeats. At 135 M parameters the prefill is matrix products
large enough for BLAS to run at full speed, so the ratio measures the two libraries' matmuls and
the overhead around them, not Python dispatch.
"""

import functools

from labkit import bench
from labkit.checkpoint import require_real_model

from .stage01 import llama_pair, run


def main(quick: bool = False) -> bench.Result:
    return run([functools.partial(llama_pair, require_real_model())], repeats=3 if quick else 7)
