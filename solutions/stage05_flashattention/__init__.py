"""Stage 05: online softmax, tiled attention, and FlashAttention / FlashDecoding kernels in Triton.

Without a CUDA GPU the kernels run in Triton's interpreter (NumPy on the CPU). The switch is read
when `@triton.jit` decorates a kernel, so it is set here, before any kernel module is imported.
An explicit TRITON_INTERPRET in the environment wins (the ahead-of-time compile check sets it to 0).
"""

import os

from labkit import triton_interpret

os.environ["TRITON_INTERPRET"] = triton_interpret()

from labkit.impl import share_given_modules  # given modules live only in the stage folder

share_given_modules(__path__, __name__)
