"""Two settings every entry point needs, decided in one place: is there a GPU, and how many threads.

from labkit.device import has_gpu, pin_threads
pin_threads(1)                 # for the rest of the process (benchmarks, notebooks)
with pin_threads(1): ...       # only inside the block (pytest fixtures), then restored
"""

import functools


@functools.cache
def has_gpu() -> bool:
    """True when PyTorch can run on a CUDA GPU here. Asked of torch rather than inferred from
    /dev/nvidia0: a CPU build of torch on a machine with an NVIDIA card has the device file but
    no CUDA, and Triton kernels compiled for it would have nowhere to run."""
    import torch

    return torch.cuda.is_available()


class pin_threads:
    """Set torch's intra-op thread count to n; used as a context manager, restore it on exit.

    The course's models are tiny: their matrices are too small to split over threads, and on a
    busy 2-core machine OpenMP threads spin-waiting for each other make small ops 10-100x slower.
    """

    def __init__(self, n: int):
        import torch

        if n < 1:
            raise ValueError(f"pin_threads needs at least one thread, got {n}.")
        self.before = torch.get_num_threads()
        torch.set_num_threads(n)

    def __enter__(self) -> "pin_threads":
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self.before)
