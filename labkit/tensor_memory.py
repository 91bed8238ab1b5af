"""Watch every tensor PyTorch creates on the CPU: the live-bytes peak and the largest tensor.

tracemalloc cannot see torch's allocator, and the CPU has no `max_memory_allocated`, so this
counts bytes itself: every op's output is seen by a TorchDispatchMode, storages are counted once
however many views share them, and a storage is released when its last tensor dies.

    with TensorWatch() as watch:
        attention(q, k, v)
    watch.peak_bytes, watch.largest_shape
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorWatch(TorchDispatchMode):
    """Peak bytes of tensors created inside the block (inputs made before it do not count)."""

    def __init__(self):
        super().__init__()
        self.peak_bytes = 0
        self.largest_shape: tuple[int, ...] = ()
        self._live_bytes = 0
        self._owners: dict[int, int] = {}  # storage address -> live tensors using it
        self._sizes: dict[int, int] = {}

    @property
    def largest_numel(self) -> int:
        return torch.Size(self.largest_shape).numel() if self.largest_shape else 0

    def _release(self, key: int) -> None:
        self._owners[key] -= 1
        if self._owners[key] == 0:
            del self._owners[key]
            self._live_bytes -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._owners:
                self._owners[key] = 0
                self._sizes[key] = storage.nbytes()
                self._live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self._live_bytes)
            self._owners[key] += 1
            weakref.finalize(t, self._release, key)
            if t.numel() > self.largest_numel:
                self.largest_shape = tuple(t.shape)
        return out
