"""Moving a request's KV between engines: a small KV connector in the shape of vLLM's.

vLLM's KVConnectorBase_V1 splits the job in two: the scheduler side asks how many of a prompt's tokens
an outside store can supply (get_num_new_matched_tokens) and the worker side copies them in
(start_load_kv) or out (save_kv_layer, wait_for_save). Here one engine does both, so the connector
is three functions over a ReplicaEngine:

    kv_bytes_per_token(config, dtype)   what one token's K and V cost (stage 02's formula)
    save_kv(engine, token_ids)          the cached prefix of token_ids, gathered from the engine's slots
    load_kv(engine, payload)            that KV scattered into another engine's slots and prefix cache

Prefill/decode disaggregation (DistServe, Splitwise, Mooncake) runs save_kv on a prefill engine,
ships the payload, and load_kv on a decode engine, whose next request with that prompt hits its prefix
cache and computes only the last token. The transport below (given) ships a payload over
torch.distributed point-to-point: a fixed header of sizes, then the tensors. It runs on gloo here and
on NCCL unchanged (move the tensors to the GPU); whatever goes wrong on the wire becomes a
TransferError, which the receiver answers by computing the prompt itself.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .replica_engine import page_hashes  # noqa: F401 (save_kv names its pages with it)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token occupies across every layer: 2 x layers x KV heads x head_dim x
    the dtype's bytes (config: a labkit.model.Config)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


@dataclass
class KVPayload:
    """The KV of a prompt's leading tokens: k[layer] and v[layer] are (len(token_ids), KV heads, head_dim);
    page_hashes name its whole pages (the names the prefix caches and the router use)."""

    token_ids: list[int]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_hashes: list[int]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))


def save_kv(engine, token_ids: list[int]) -> KVPayload:
    """The KV of the longest prefix of token_ids that the engine's prefix cache holds (whole pages),
    copied out of its slots (engine.store.k[layer][slots]), with the page hashes of that prefix. Lock
    the prefix while you copy (engine.cache.acquire / release) so nothing evicts it meanwhile."""
    slots, handle = engine.cache.acquire(list(token_ids))
    try:
        index = torch.tensor(slots, dtype=torch.long)
        k = [layer[index] for layer in engine.store.k]  # advanced indexing copies
        v = [layer[index] for layer in engine.store.v]
    finally:
        engine.cache.release(handle)
    prefix = list(token_ids[: len(slots)])
    return KVPayload(prefix, k, v, page_hashes(prefix, engine.page_size))


def load_kv(engine, payload: KVPayload) -> int:
    """Put a payload's whole pages into the engine: take slots from the pool (evicting from the prefix
    cache when the pool is short; ValueError when even that cannot hold them), write K and V into
    them, and insert the tokens into the prefix cache, freeing the slots of pages it already held.
    Returns how many tokens the payload added to the cache (pages it held already do not count)."""
    n = len(payload.token_ids) // engine.page_size * engine.page_size
    store = engine.store
    if n > len(store.free_blocks):
        store.free_blocks += engine.cache.evict(n - len(store.free_blocks))
    if n > len(store.free_blocks):
        raise ValueError(
            f"the payload needs {n} KV slots but only {len(store.free_blocks)} are free or evictable; "
            "load it into a larger engine or after its running requests finish"
        )
    slots = [store.free_blocks.pop() for _ in range(n)]
    index = torch.tensor(slots, dtype=torch.long)
    for layer in range(len(store.k)):
        store.k[layer][index] = payload.k[layer][:n].to(store.k[layer].dtype)
        store.v[layer][index] = payload.v[layer][:n].to(store.v[layer].dtype)
    duplicates = engine.cache.insert(list(payload.token_ids[:n]), slots, 0)
    store.free_blocks += duplicates
    return n - len(duplicates)


# ---------------------------------------------------------------- the transport (given)


class TransferError(RuntimeError):
    """A payload did not arrive whole: a timeout, a malformed header, or a short or broken stream."""


MAGIC = 0x4B56  # "KV": the first header field, so a stray tensor is not read as a header
HEADER = 8  # magic, tokens, layers, KV heads, head_dim, dtype code, whole pages, checksum
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def checksum(*tensors: torch.Tensor) -> int:
    """The sum of every byte: gloo accepts a message shorter than the buffer it lands in and says
    nothing, so a short or garbled stream shows only in the bytes."""
    return sum(int(t.contiguous().view(torch.uint8).sum(dtype=torch.int64)) for t in tensors)


def send_kv(payload: KVPayload, dst: int, group=None) -> int:
    """Send a payload to rank dst: the header, the token ids and page hashes, then every layer's K and
    V stacked into one tensor each. Returns the KV bytes sent (the header and ids are not counted)."""
    k, v = torch.stack(payload.k), torch.stack(payload.v)  # (layers, tokens, KV heads, head_dim)
    layers, tokens, heads, dim = k.shape
    ids = torch.tensor(payload.token_ids + payload.page_hashes, dtype=torch.int64)
    header = torch.tensor(
        [MAGIC, tokens, layers, heads, dim, DTYPES.index(k.dtype), len(payload.page_hashes), checksum(ids, k, v)],
        dtype=torch.int64,
    )
    for t in (header, ids, k, v):
        dist.send(t, dst, group=group)
    return k.nbytes + v.nbytes


def recv_kv(src: int, config, timeout_s: float = 10.0, group=None) -> KVPayload:
    """Receive a payload from rank src, checking its header against this model's config; TransferError
    (saying what was wrong) on a timeout, a header that does not fit, or a stream that breaks off.
    After a timeout gloo has closed its channel to src: rebuild the group before the next transfer."""

    def recv(t: torch.Tensor, what: str) -> torch.Tensor:
        try:
            if not dist.irecv(t, src, group=group).wait(timedelta(seconds=timeout_s)):
                raise TransferError(f"the {what} from rank {src} did not arrive within {timeout_s} s")
        except RuntimeError as e:
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"receiving the {what} from rank {src} failed: {e}") from e
        return t

    header = recv(torch.zeros(HEADER, dtype=torch.int64), "header").tolist()
    magic, tokens, layers, heads, dim, code, pages, total = header
    want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    if magic != MAGIC or (layers, heads, dim) != want or not 0 <= code < len(DTYPES) or tokens < 0 or pages < 0:
        raise TransferError(
            f"malformed KV header from rank {src}: {header}; expected magic {MAGIC} and (layers, KV heads, "
            f"head_dim) = {want}: is the sender running the same model?"
        )
    ids_t = recv(torch.zeros(tokens + pages, dtype=torch.int64), "token ids")
    shape = (layers, tokens, heads, dim)
    k = recv(torch.empty(shape, dtype=DTYPES[code]), "keys")
    v = recv(torch.empty(shape, dtype=DTYPES[code]), "values")
    if checksum(ids_t, k, v) != total:
        raise TransferError(f"the KV from rank {src} does not match its header's checksum: a short or broken stream")
    ids = ids_t.tolist()
    return KVPayload(ids[:tokens], list(k), list(v), ids[tokens:])


def prefill_decode(
    model_folder, prompts: list[list[int]], new_tokens: int, page_size: int = 16, timeout_s: float = 10.0
):
    """A labkit.distributed.launch worker for two ranks, one engine each. Rank 0 prefills every prompt
    (one new token), saves its KV and sends it; rank 1 receives it, loads it and decodes new_tokens,
    computing the prompt itself when the transfer fails. Both ranks meet at a barrier before each
    transfer, so the time each reports is the transfer's, not the other's prefill. Rank 0 returns
    [{bytes, seconds}] (save + send), rank 1 [{tokens, loaded, computed, seconds, error}] (receive + load)."""
    import time

    from labkit.model import from_pretrained

    from .replica_engine import EngineRequest, ReplicaEngine

    torch.set_num_threads(1)
    model = from_pretrained(model_folder).float().eval()
    engine = ReplicaEngine(model, num_slots=8 * max(map(len, prompts)) + 8 * new_tokens + 64, page_size=page_size)
    results = []
    for i, prompt in enumerate(prompts):
        if dist.get_rank() == 0:
            engine.add_request(EngineRequest(f"p{i}", prompt, 1))
            while engine.has_work():
                engine.step()
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            sent = send_kv(save_kv(engine, prompt), 1)
            results.append(dict(bytes=sent, seconds=time.perf_counter() - t0))
            continue
        error, loaded = None, 0
        try:
            loaded = load_kv(engine, recv_kv(0, model.config, timeout_s))
        except TransferError as e:
            error = str(e)
        seconds, before = time.perf_counter() - t0, engine.stats["prefill_tokens_computed"]
        engine.add_request(EngineRequest(f"d{i}", prompt, new_tokens))
        tokens = []
        while engine.has_work():
            tokens += [o.token_id for o in engine.step() if o.token_id is not None]
        computed = engine.stats["prefill_tokens_computed"] - before
        results.append(dict(tokens=tokens, loaded=loaded, computed=computed, seconds=seconds, error=error))
    return results
