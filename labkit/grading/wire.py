"""What crosses between the test process and the learner's worker (labkit/grading/worker.py) as data, not
handles: arrays, tensors, scalars, random generators, dtypes and devices as bytes with their layout, and
exceptions as their class, message and the learner's line. A decoded message runs no code: a tensor's dtype must
be a torch dtype, an exception class becomes a local class of the same name and built-in base.
"""

import builtins
import sys
import traceback
from pathlib import Path

import numpy as np

from ..device import has_gpu


class WorkerError(Exception):
    """The worker could not run a call: it died, or it sent something that is not a message.
    Its text is the course's own (labkit.grading.outcomes reports it as a crash, unredacted)."""


# --- arrays and tensors as bytes ---


def torch_module():
    import torch

    return torch


def array_data(obj):
    """(tag, ...) for an array, tensor, scalar or dtype; None for anything else."""
    if isinstance(obj, Path):
        return ("path", str(obj))
    if isinstance(obj, np.ndarray) and obj.dtype.kind not in "OV":
        return ("ndarray", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic) and obj.dtype.kind not in "OV":
        return ("npscalar", obj.dtype.str, obj.tobytes())
    if isinstance(obj, np.dtype) and obj.kind not in "OV":
        return ("npdtype", obj.str)
    if isinstance(obj, np.random.Generator) and type(obj.bit_generator) is np.random.PCG64:
        state = obj.bit_generator.state  # a random generator's state is data: a test's draws continue
        return ("rng", state["state"]["state"], state["state"]["inc"], state["has_uint32"], state["uinteger"])
    if "torch" not in sys.modules:
        return None
    torch = sys.modules["torch"]
    if (
        isinstance(obj, torch.Tensor)
        and type(obj) in (torch.Tensor, torch.nn.Parameter)
        and obj.layout == torch.strided
    ):
        # The storage span the tensor covers, and its strides: a transposed or expanded tensor
        # arrives as one (a kernel's wrapper must see the non-contiguous input it rejects).
        span = 1 + sum((n - 1) * st for n, st in zip(obj.shape, obj.stride(), strict=True)) if obj.numel() else 0
        flat = obj.detach().cpu().as_strided((span,), (1,)).contiguous().view(torch.uint8)
        dtype = str(obj.dtype).removeprefix("torch.")
        layout = (tuple(obj.shape), obj.stride())
        return ("tensor", dtype, layout, flat.numpy().tobytes(), obj.requires_grad, str(obj.device))
    if isinstance(obj, torch.Generator):
        return ("generator", str(obj.device), obj.get_state().numpy().tobytes())
    if isinstance(obj, torch.dtype):
        return ("dtype", str(obj).removeprefix("torch."))
    if isinstance(obj, torch.device):
        return ("device", str(obj))
    if isinstance(obj, torch.Size):
        return ("size", tuple(obj))
    return None


def from_array_data(tag: str, rest: list):
    if tag == "path":
        return Path(rest[0])
    if tag == "ndarray":
        dtype, shape, blob = rest
        return np.frombuffer(bytearray(blob), dtype=np.dtype(dtype)).reshape(shape)
    if tag == "npscalar":
        return np.frombuffer(rest[1], dtype=np.dtype(rest[0]))[0]
    if tag == "npdtype":
        return np.dtype(rest[0])
    if tag == "rng":
        bits = np.random.PCG64()
        state, inc, has_uint32, uinteger = rest
        bits.state = {
            "bit_generator": "PCG64",
            "state": {"state": state, "inc": inc},
            "has_uint32": has_uint32,
            "uinteger": uinteger,
        }
        return np.random.Generator(bits)
    torch = torch_module()
    if tag == "tensor":
        dtype, (shape, stride), blob, requires_grad, device = rest
        kind = getattr(torch, dtype)
        if not isinstance(kind, torch.dtype):
            raise WorkerError("the worker sent a tensor of no torch dtype")
        raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        tensor = raw.view(kind).as_strided(shape, stride)
        if device != "cpu" and has_gpu():
            tensor = tensor.to(device)
        return tensor.requires_grad_(requires_grad) if kind.is_floating_point else tensor
    if tag == "generator":
        generator = torch.Generator(rest[0] if has_gpu() else "cpu")
        generator.set_state(torch.frombuffer(bytearray(rest[1]), dtype=torch.uint8))
        return generator
    if tag == "dtype":
        kind = getattr(torch, rest[0])
        if not isinstance(kind, torch.dtype):
            raise WorkerError("the worker sent no torch dtype")
        return kind
    if tag == "device":
        return torch.device(rest[0])
    if tag == "size":
        return torch.Size(rest[0])
    raise WorkerError("the worker sent something that is not a message")


def snapshot(x):
    return array_data(x)[1:]


def copy_into(original, new) -> None:
    if isinstance(original, np.random.Generator):
        original.bit_generator.state = new.bit_generator.state
        return
    if isinstance(original, np.ndarray):
        if original.flags.writeable and original.shape == new.shape:
            np.copyto(original, new)
        return
    torch = torch_module()
    if isinstance(original, torch.Generator):
        original.set_state(new.get_state())
    elif original.shape == new.shape:
        with torch.no_grad():
            original.copy_(new)


# --- exceptions ---

_CLASSES: dict[tuple, type] = {}


def describe_class(cls: type) -> tuple:
    """(module, name, built-in base) of an exception class."""
    base = next(c for c in cls.__mro__ if getattr(builtins, c.__name__, None) is c)
    return cls.__module__, cls.__qualname__, base.__name__


def exception_class(module: str, name: str, base: str) -> type:
    """The local class for a stage's exception class: built-ins are themselves, others made once."""
    builtin = getattr(builtins, name, None)
    if module == "builtins" and isinstance(builtin, type) and issubclass(builtin, Exception):
        return builtin
    parent = getattr(builtins, base, None)
    parent = parent if isinstance(parent, type) and issubclass(parent, Exception) else Exception
    key = (module, name, parent.__name__)
    if key not in _CLASSES:
        _CLASSES[key] = type(name.rsplit(".", 1)[-1], (parent,), {"__module__": module})
    return _CLASSES[key]


def describe(e: BaseException) -> tuple:
    """An exception as data: its class, its first 2000 characters, the learner's line it came from."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/stage" in f.filename]
    where = ""
    for frame in reversed(frames):
        parts = frame.filename.rsplit("/", 3)
        if "/solutions/" in frame.filename or len(parts) < 3:
            continue
        if parts[-2].startswith("stage"):
            where = f"{parts[-2]}/{parts[-1]}:{frame.lineno}"
            break
        if len(parts) == 4 and parts[-3].startswith("stage"):  # a sub-package's module: stage07_x/fleet/router.py
            where = f"{parts[-3]}/{parts[-2]}/{parts[-1]}:{frame.lineno}"
            break
    try:
        text = str(e)[:2000]
    except BaseException:  # noqa: BLE001 - a learner's __str__ that raises
        text = ""
    return describe_class(type(e)), text, where


def exception(info: tuple) -> Exception:
    cls, text, where = info
    cls = exception_class(*cls) if isinstance(cls, tuple) and len(cls) == 3 else RuntimeError
    try:
        e = cls(text)
    except Exception:  # noqa: BLE001 - a built-in whose constructor wants more (UnicodeDecodeError)
        e = RuntimeError(text)
    e.labkit_where = where  # labkit.grading.outcomes reports it as the learner's file and line
    return e
