"""A tiered KV cache: pages the engine's pool evicts go to CPU RAM, then to disk, and come back on a hit.

LMCache, Mooncake's store and SGLang's HiCache all do this: the GPU pool is small, host RAM is ~10x
larger, a local disk ~100x. Pages are named by the same chained page hash the prefix caches and the
router use (replica_engine.page_hashes), so a hit in a tier is a hit on the same prefix, and an admit
that misses in the pool can look the next pages of its prompt up here, one after another along the
chain, and load them back instead of computing them.

    tiers = TieredKVStore(ram_bytes=..., disk_dir=...)
    ReplicaEngine(model, kv_tiers=tiers)     # the engine calls put on eviction and get on admission

The RAM tier is an LRU over whole pages, bounded in bytes; what it pushes out goes to the disk tier
(one file per page hash, its checksum inside), or is dropped when there is no disk tier. A file that
does not match its checksum is deleted and reported as a miss: the engine computes the page again.
"""

import hashlib
from collections import OrderedDict
from pathlib import Path

import torch


class CorruptPage(ValueError):
    """A disk-tier file whose bytes do not match the checksum written with them."""


def write_page(path: Path, k: torch.Tensor, v: torch.Tensor) -> None:
    """K and V of one page (each (layers, page_size, KV heads, head_dim)) and the SHA-256 of their bytes."""
    data = k.contiguous().view(torch.uint8).numpy().tobytes() + v.contiguous().view(torch.uint8).numpy().tobytes()
    torch.save(dict(shape=tuple(k.shape), dtype=k.dtype, data=data, sha256=hashlib.sha256(data).hexdigest()), path)


def read_page(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The page write_page wrote; CorruptPage when the file is unreadable or its bytes changed."""
    try:
        saved = torch.load(path, weights_only=True)
        data, shape, dtype = saved["data"], saved["shape"], saved["dtype"]
        ok = hashlib.sha256(data).hexdigest() == saved["sha256"]
    except Exception as e:  # a truncated or garbled file fails to unpickle in many ways
        raise CorruptPage(f"{path}: unreadable ({e})") from e
    if not ok:
        raise CorruptPage(f"{path}: its bytes do not match their checksum")
    kv = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(2, *shape)
    return kv[0].clone(), kv[1].clone()


class TieredKVStore:
    """Pages by page hash: an LRU in RAM bounded by ram_bytes, spilling to disk_dir (None: no disk tier)."""

    def __init__(self, ram_bytes: int, disk_dir: str | Path | None = None):
        if ram_bytes < 0:
            raise ValueError(f"ram_bytes must be >= 0, got {ram_bytes}")
        self.ram_bytes, self.ram_used = ram_bytes, 0
        self.ram: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # least recently used first
        self.disk = Path(disk_dir) if disk_dir is not None else None
        if self.disk is not None:
            self.disk.mkdir(parents=True, exist_ok=True)
        self.stats = dict(puts=0, ram_hits=0, disk_hits=0, misses=0, spilled=0, dropped=0, corrupt=0)

    def path(self, page_hash: int) -> Path:
        return self.disk / f"{page_hash & 0xFFFFFFFFFFFFFFFF:016x}.pt"  # hashes may be negative

    def on_disk(self, page_hash: int) -> bool:
        return self.disk is not None and self.path(page_hash).exists()

    def put(self, page_hash: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a page in RAM as the most recently used (a page already there is just marked used), then
        spill least recently used pages until RAM holds at most ram_bytes."""
        raise NotImplementedError("stage07: TieredKVStore.put — see lab5.ipynb §3")

    def spill(self) -> None:
        """Move the least recently used RAM page to disk (write_page to self.path(hash)), or drop it when
        there is no disk tier; count it in stats["spilled"] or stats["dropped"]."""
        raise NotImplementedError("stage07: TieredKVStore.spill — see lab5.ipynb §3")

    def get(self, page_hash: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The page's (k, v), or None. RAM first (marking it used); then disk, where a good page moves back
        to RAM (put) and its file is removed, and a corrupt one (CorruptPage) is deleted and counted in
        stats["corrupt"]. Counts ram_hits, disk_hits or misses."""
        raise NotImplementedError("stage07: TieredKVStore.get — see lab5.ipynb §3")
