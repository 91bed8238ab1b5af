"""The learner's code in a process of its own: the tests call it, and see only data and handles.

    LABKIT_WORKER=1 pytest -p labkit.grading.outcomes ...      (labkit.grading.grade --submission, most tests)

With LABKIT_WORKER set, the outcomes plugin installs `load` below as labkit.impl's loader and takes the variable out of the
environment (a process a test starts loads stage code itself). Then `labkit.impl.load(name)`
imports nothing in the test process: it starts one worker (`python -m labkit.grading.worker`), has it
import the stage module, and returns a proxy whose attribute reads, calls, indexing and
iteration run in the worker. pytest, the tests, the assertions and the outcome pipe stay in the
test process, which the worker cannot reach: the pipe is not inherited, and the test process is
non-dumpable, so the worker can open neither its /proc/PID/fd nor its memory.

What crosses, in either direction, is encoded as data: None, bool, int, float, complex, str,
bytes, paths, lists, tuples, dicts and sets of data, NumPy arrays, scalars and random generators,
torch tensors (strides kept), generators, dtypes and devices. Anything else stays where it lives
and crosses as a handle (a `Remote`), except that an object the tests pass which pickles (a
Hugging Face model, a config) is sent by value, and a result the tests ask to keep there
(labkit.testing.kept: the real model's 540 MB of weights) stays in the worker as a handle. The test process unpickles messages with no
globals allowed, so the worker can send nothing that runs code when read; and it lets the worker
only call what the tests handed it (TRUSTED_OPS), never read its attributes. An array, tensor or
generator argument the callee changed in place is copied back into the caller's (a Triton kernel
writes its output that way). An exception crosses as its type, message and the learner's line; a
stage's own exception class becomes a local class of the same name and built-in base (wire.py encodes them).
"""

import builtins
import io
import operator
import os
import pickle
import socket
import struct
import subprocess
import sys
import types
import weakref
from pathlib import Path

from .. import ROOT
from .wire import (  # noqa: F401  (WorkerError: the tests and outcomes read it as worker.WorkerError)
    WorkerError,
    array_data,
    copy_into,
    describe,
    describe_class,
    exception,
    exception_class,
    from_array_data,
    snapshot,
)

OPS = {
    "getattr": getattr,
    "setattr": setattr,
    "call": lambda obj, *args, **kwargs: obj(*args, **kwargs),
    "call_keep": lambda obj, *args, **kwargs: obj(*args, **kwargs),  # the result stays here: a handle crosses
    "getitem": operator.getitem,
    "setitem": operator.setitem,
    "delitem": operator.delitem,
    "len": len,
    "iter": iter,
    "next": next,
    "contains": operator.contains,
    "bool": bool,
    "eq": operator.eq,
    "lt": operator.lt,
    "le": operator.le,
    "hash": hash,
    "repr": repr,
    "str": str,
    "int": int,
    "float": float,
    "index": operator.index,
    "enter": lambda obj: obj.__enter__(),
    "exit": lambda obj, *exc: obj.__exit__(*exc),
}
WRITABLE = ("ndarray", "tensor", "rng", "generator")  # what a callee may change in place, copied back
TRUSTED_OPS = {"call", "iter", "next", "len", "bool", "contains", "eq", "hash", "repr", "str"}


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a message may hold only plain data, not {module}.{name}")


class Peer:
    """One end of the connection: sends requests, serves the other end's requests while it waits."""

    def __init__(self, sock: socket.socket, trusted: bool):
        self.file = sock.makefile("rwb")
        self.trusted = trusted  # the test process: it never unpickles anything but plain data
        self.objects: dict[int, list] = {}  # handles this end gave out: id -> [object, times given]
        self.released: list[int] = []  # handles the other end dropped, told with the next message
        self.alive = True

    # --- framing: an 8-byte length, then a pickle of plain data ---
    def send(self, message) -> None:
        blob = pickle.dumps(message, protocol=5)
        self.file.write(struct.pack("<Q", len(blob)) + blob)
        self.file.flush()

    def receive(self):
        head = self.file.read(8)
        if len(head) < 8:
            self.alive = False
            raise WorkerError("the process running the code under test ended (it exited or was killed)")
        blob = self.file.read(struct.unpack("<Q", head)[0])
        return _NoGlobals(io.BytesIO(blob)).load()

    # --- requests ---
    def request(self, handle: int, op: str, args=(), kwargs=None):
        if not self.alive:
            raise WorkerError("the process running the code under test ended earlier in this test run")
        sent: list = []
        message = ("req", handle, op, self.encode(list(args), sent), self.encode(kwargs or {}, sent))
        self.send(message + (self.released[:],))
        self.released.clear()
        while True:
            reply = self.receive()
            if reply[0] == "req":
                self.serve(reply)
                continue
            kind, value, changed = reply
            for index, new in changed:  # arguments the callee wrote into
                copy_into(sent[index], self.decode(new))
            if kind == "ok":
                return self.decode(value)
            raise exception(value)

    def serve(self, message) -> None:
        _, handle, op, args, kwargs, released = message
        for h in released:
            if h in self.objects and (entry := self.objects[h])[1] <= 1:
                del self.objects[h]
            elif h in self.objects:
                entry[1] -= 1
        received: list = []
        try:
            if self.trusted and (handle == 0 or op not in TRUSTED_OPS):
                # The worker may call back what the tests handed it, nothing more: no attribute of
                # a test's object (a function's __globals__ would lead to everything here).
                raise PermissionError(f"the code under test may not {op} an object of the tests")
            args, kwargs = self.decode(args, received), self.decode(kwargs, received)
            before = [snapshot(x) for x in received]
            obj = _import if handle == 0 else self.objects[handle][0]
            value = OPS[op](obj, *args, **kwargs)
            changed = [
                (i, self.encode(x)) for i, (x, b) in enumerate(zip(received, before, strict=True)) if snapshot(x) != b
            ]
            kept = op == "call_keep" and not self.trusted
            if kept:
                self.objects.setdefault(id(value), [value, 0])[1] += 1
            reply = ("ok", ("mine", id(value)) if kept else self.encode(value), changed)
        except BaseException as e:  # noqa: BLE001 - every failure of the callee goes back as data
            reply = ("err", describe(e), [])
        self.send(reply)

    def serve_forever(self) -> None:
        while True:
            message = self.receive()
            if message[0] != "req":
                raise WorkerError(f"expected a request, got {message[0]!r}")
            self.serve(message)

    # --- data and handles ---
    def encode(self, obj, arrays: list | None = None):
        """`obj` as plain data; arrays and tensors are appended to `arrays` (to copy changes back)."""
        if obj is None or type(obj) in (bool, int, float, str, bytes):  # not a subclass: np.float64 is one
            return obj
        if type(obj) is complex:
            return ("complex", obj.real, obj.imag)
        if isinstance(obj, (list, tuple, set, frozenset)) and type(obj) in (list, tuple, set, frozenset):
            return (type(obj).__name__, [self.encode(x, arrays) for x in obj])
        if type(obj) is dict:
            return ("dict", [(self.encode(k, arrays), self.encode(v, arrays)) for k, v in obj.items()])
        if isinstance(obj, Remote) and obj._peer is self:
            return ("yours", obj._handle)
        data = array_data(obj)
        if data is not None:
            if arrays is not None and data[0] in WRITABLE:
                arrays.append(obj)
            return data
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return ("exception", describe_class(obj))
        if self.trusted and not isinstance(obj, Remote):  # what the tests pass goes by value if it can
            try:
                return ("pickle", pickle.dumps(obj, protocol=5))
            except Exception:  # noqa: BLE001 - a lambda, a generator: it stays here as a handle
                pass
        self.objects.setdefault(id(obj), [obj, 0])[1] += 1
        return ("mine", id(obj))

    def decode(self, data, arrays: list | None = None):
        if data is None or isinstance(data, (bool, int, float, str, bytes)):
            return data
        tag, *rest = data
        if tag in ("list", "tuple", "set", "frozenset"):
            return getattr(builtins, tag)(self.decode(x, arrays) for x in rest[0])
        if tag == "dict":
            return {self.decode(k, arrays): self.decode(v, arrays) for k, v in rest[0]}
        if tag == "complex":
            return complex(*rest)
        if tag == "mine":  # the other end's object
            return Remote(self, rest[0])
        if tag == "yours":
            return self.objects[rest[0]][0]
        if tag == "exception":
            return exception_class(*rest[0])
        if tag == "pickle" and not self.trusted:
            return pickle.loads(rest[0])
        value = from_array_data(tag, rest)
        if arrays is not None and tag in WRITABLE:
            arrays.append(value)
        return value


class Remote:
    """An object that lives in the other process; every use of it is a request there."""

    __slots__ = ("_peer", "_handle", "__weakref__")

    def __init__(self, peer: Peer, handle: int):
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_handle", handle)
        weakref.finalize(self, peer.released.append, handle)

    def _ask(self, op, *args, **kwargs):
        return self._peer.request(self._handle, op, args, kwargs)

    def __getattr__(self, name):
        return self._ask("getattr", name)

    def _keep(self, *args, **kwargs):
        """Call it, and leave the result in the other process: a handle comes back (labkit.testing.kept)."""
        return self._ask("call_keep", *args, **kwargs)

    def __setattr__(self, name, value):
        self._ask("setattr", name, value)

    def __call__(self, *args, **kwargs):
        return self._ask("call", *args, **kwargs)

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __setitem__(self, key, value):
        self._ask("setitem", key, value)

    def __delitem__(self, key):
        self._ask("delitem", key)

    def __len__(self):
        return self._ask("len")

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __contains__(self, item):
        return self._ask("contains", item)

    def __bool__(self):
        return self._ask("bool")

    def __eq__(self, other):
        # Only between two of the worker's objects (an enum's members): an object that says it
        # equals any data the test compares it with would pass `assert f(x) == expected`.
        return self._ask("eq", other) if isinstance(other, Remote) else NotImplemented

    def __ne__(self, other):
        return not self._ask("eq", other) if isinstance(other, Remote) else NotImplemented

    def __lt__(self, other):
        return self._ask("lt", other)

    def __le__(self, other):
        return self._ask("le", other)

    def __hash__(self):
        return self._ask("hash")

    def __repr__(self):
        return self._ask("repr")

    def __str__(self):
        return self._ask("str")

    def __int__(self):
        return self._ask("int")

    def __float__(self):
        return self._ask("float")

    def __index__(self):
        return self._ask("index")

    def __enter__(self):
        return self._ask("enter")

    def __exit__(self, *exc):
        return self._ask("exit", *[None] * 3)

    def __reduce__(self):
        raise TypeError("a handle to the other process does not pickle")


# --- the two ends ---


def _import(name: str):
    from ..impl import load

    return load(name)


class RemoteModule(types.ModuleType):
    """A stage module in the worker, as a module object here: inspect.getsource reads its file (in
    the course, never a path the worker names); its attributes are the worker's."""

    def __init__(self, name: str, remote: Remote):
        super().__init__(name)
        self.__dict__["_remote"] = remote
        self.__dict__["_patched"] = {}
        path = Path(remote.__file__ or "").resolve()
        if path.suffix == ".py" and path.is_relative_to(ROOT):
            self.__dict__["__file__"] = str(path)

    def __getattr__(self, name):
        return getattr(self.__dict__["_remote"], name)

    def __setattr__(self, name, value):  # monkeypatch.setattr(module, ...) patches the worker's
        self.__dict__["_patched"].setdefault(name, getattr(self.__dict__["_remote"], name, None))
        setattr(self.__dict__["_remote"], name, value)

    def __delattr__(self, name):  # monkeypatch's undo: the worker's attribute as it was before
        setattr(self.__dict__["_remote"], name, self.__dict__["_patched"].pop(name))

    def __dir__(self):
        return self.__dict__["_remote"].__dir__()


_worker: dict = {}


def load(name: str) -> RemoteModule:
    """In the test process: the stage module `name`, imported in the worker (started if need be)."""
    peer = _worker.get("peer")
    if peer is None or not peer.alive or _worker["proc"].poll() is not None:
        peer = _start()
    return RemoteModule(name, peer.request(0, "call", (name,)))


def _start() -> Peer:
    ours, theirs = socket.socketpair()
    # The worker sees the test process's import path, so an object of a test module unpickles there.
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "labkit.grading.worker", str(theirs.fileno())],
        env=env,
        pass_fds=[theirs.fileno()],  # and nothing else: the outcome pipe stays here
        stdin=subprocess.DEVNULL,
    )
    theirs.close()
    if "proc" in _worker and _worker["proc"].poll() is None:
        _worker["proc"].kill()
    _worker.update(peer=Peer(ours, trusted=True), proc=proc)
    return _worker["peer"]


def main() -> int:
    peer = Peer(socket.socket(fileno=int(sys.argv[1])), trusted=False)
    try:
        peer.serve_forever()
    except WorkerError:
        return 0  # the test process went away
    return 0


if __name__ == "__main__":
    sys.exit(main())
