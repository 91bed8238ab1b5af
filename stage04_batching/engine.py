"""The continuous-batching engine: labkit's Llama weights run over the paged KV cache.

    engine = LLMEngine(model, tokenizer)
    outputs = engine.generate(["Once upon a time"], SamplingParams(max_tokens=32))

Each step() asks the scheduler for a batch, runs ONE forward pass over all its tokens (prefill
chunks and decodes packed together), samples a token for every sequence whose prompt is fully
computed, and returns what changed for streaming.

Given code (nano-vllm: engine/llm_engine.py); the sampling and stop-string logic it calls is yours,
in sampling.py.
"""

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.model import Llama, apply_rope, refuse_extras

from .block_manager import BlockManager
from .byte_dfa import compile_regex
from .config import EngineConfig
from .paged_attention import PagedKVCache, paged_attention, slot_mapping
from .sampling import find_stop, safe_length, sample
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence
from .structured import Guide, TokenIndex, build_token_index, mask_logits, token_bytes


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # detokenized output so far ("" without a tokenizer)
    delta_text: str  # text that is new since the last output of this request
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop string), "length", "abort", "error"
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None  # why the engine failed this request (finish_reason "error")


MAX_TOKEN_INDEXES = 32  # structured output: the token indexes kept (each is num_states x vocab)

# What forward_paged implements of real checkpoints' extras (labkit.model.EXTRAS).
SUPPORTED_EXTRAS = ("attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "rope_scaling")


@torch.inference_mode()
def forward_paged(
    model: Llama,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
) -> torch.Tensor:
    """labkit's Llama over a packed batch: N tokens of B sequences -> logits (B, vocab) of each last token.

    input_ids, positions, slots: (N,) int64; block_tables (B, max_blocks); context_lens, query_lens (B,).
    Linear layers see all N tokens at once (that is the batching win); attention goes through the pool.
    """
    c = model.config
    N = len(input_ids)
    x = model.model.embed_tokens(input_ids)  # (N, hidden)
    cos, sin = model.rope_cos[positions, None], model.rope_sin[positions, None]  # (N, 1, head_dim): one row a token
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(N, c.num_attention_heads, c.head_dim)
        k = attn.k_proj(h).view(N, c.num_key_value_heads, c.head_dim)
        v = attn.v_proj(h).view(N, c.num_key_value_heads, c.head_dim)
        q, k = attn.norm_qk(q, k)  # Qwen3's per-head RMSNorm; a no-op for the others
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (N, heads, D)
        cache.write(i, k, v, slots)
        y = paged_attention(q, cache.k[i], cache.v[i], block_tables, context_lens, query_lens)
        x = x + attn.o_proj(y.reshape(N, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    if N > len(query_lens):  # keep each sequence's last token; a pure decode step has only those
        x = x[torch.cumsum(query_lens, 0) - 1]
    return model.lm_head(model.model.norm(x)).float()


def run_batch(model: Llama, cache: PagedKVCache, seqs: list[Sequence], num_tokens: list[int]) -> torch.Tensor:
    """Pack the next num_tokens[b] tokens of every sequence into flat tensors and run forward_paged:
    logits (B, vocab) at each sequence's last computed token."""
    ids, positions, slots = [], [], []
    for seq, n in zip(seqs, num_tokens, strict=True):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += slot_mapping(seq.block_table, start, end, cache.block_size)
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return forward_paged(
        model,
        cache,
        torch.tensor(ids),
        torch.tensor(positions),
        torch.tensor(slots),
        torch.tensor(tables),
        torch.tensor([s.num_computed_tokens + n for s, n in zip(seqs, num_tokens, strict=True)]),
        torch.tensor(num_tokens),
    )


class LLMEngine:
    def __init__(self, model: Llama, tokenizer=None, config: EngineConfig | None = None, **settings):
        """model: labkit Llama (eval); tokenizer: a `tokenizers.Tokenizer`, needed for str prompts and text.
        config: the engine's settings (config.py); keyword settings override fields of it (num_blocks=64)."""
        self.config = c = (config or EngineConfig()).replace(**settings)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(c.num_blocks, c.block_size, c.enable_prefix_caching)
        self.cache = PagedKVCache(model.config, c.num_blocks, c.block_size, next(model.parameters()).dtype)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.max_model_len = c.context_length(model.config.max_position_embeddings)
        # paged_attention has no sliding window: refuse one that a sequence could outgrow.
        refuse_extras(model.config, "stage04's paged engine", SUPPORTED_EXTRAS, self.max_model_len)
        # Called with each sequence of a batch just before the forward pass; tests and
        # `labkit.bench.loadtest --chaos` set it to make a chosen request fail inside step().
        self.fault_hook: Callable[[Sequence], None] | None = None
        # Structured output (part 2): token indexes by pattern; building one walks the whole vocabulary.
        self.token_indexes: dict[str | bytes, TokenIndex] = {}
        self._vocab_bytes: list[bytes | None] | None = None
        self._index_lock = threading.Lock()  # the server builds indexes on its tokenizing thread

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises ValueError if it can never fit the context or the pool."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                f"context length of {self.max_model_len} tokens"
            )
        seq = Sequence(request_id, ids, params)
        if params.guided_regex is not None:
            seq.guide = Guide(self.token_index(params.guided_regex))
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def token_index(self, pattern: str | bytes) -> TokenIndex:
        """The token index of a guided_regex (built once per pattern, then cached). Raises ValueError for a
        pattern byte_dfa cannot compile; the server calls it off the event loop before submitting."""
        with self._index_lock:
            if pattern not in self.token_indexes:
                if len(self.token_indexes) >= MAX_TOKEN_INDEXES:  # clients send arbitrary schemas: bound the memory
                    self.token_indexes.pop(next(iter(self.token_indexes)))
                if self.tokenizer is None:
                    raise ValueError("guided_regex needs an engine with a tokenizer (tokens are matched as bytes)")
                if self._vocab_bytes is None:
                    self._vocab_bytes = token_bytes(self.tokenizer, self.model.config.vocab_size)
                dfa = compile_regex(pattern)
                self.token_indexes[pattern] = build_token_index(dfa, self._vocab_bytes, self.model.config.eos_token_id)
            return self.token_indexes[pattern]

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (unknown or finished ids are ignored)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            seq.finish_time = time.perf_counter()

    def abort_all(self) -> None:
        """Abort every request, leaving the engine empty with every block free."""
        for request_id in list(self.requests):
            self.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward pass; outputs of the requests that got a token.

        A request whose forward pass or sampling raises is finished with reason "error" (its blocks
        freed, the message in its output); the others in the batch carry on.
        """
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        for src, dst in batch.blocks_to_copy:
            self.cache.copy_block(src, dst)
        outputs = []
        rows = self._constrain(batch.seqs, batch.num_tokens, self._forward(batch.seqs, batch.num_tokens))
        for seq, n, row in zip(batch.seqs, batch.num_tokens, rows, strict=True):
            try:
                if isinstance(row, Exception):
                    raise row
                seq.num_computed_tokens += n
                self.block_manager.cache_blocks(seq)
                if seq.num_computed_tokens < seq.num_tokens:
                    continue  # a prefill chunk that has not reached the end of the prompt yet
                seq.token_ids.append(sample(row, seq.params, seq.generator))
                if seq.guide is not None:
                    seq.guide.advance(seq.token_ids[-1])
                seq.first_token_time = seq.first_token_time or time.perf_counter()
                outputs.append(self._update(seq))
            except NotImplementedError:
                raise  # an unwritten TODO is not one request's fault
            except Exception as e:
                outputs.append(self._fail(seq, e))
        return outputs

    def _forward(self, seqs: list[Sequence], num_tokens: list[int]) -> list[torch.Tensor | Exception]:
        """Logits (vocab,) of each sequence, or the exception its forward pass raised.

        When the batched pass raises, each sequence runs again alone (rewriting the same cache slots),
        so one request's fault fails that request only; a fault every sequence hits fails them all.
        """

        def run(group: list[Sequence], counts: list[int]) -> torch.Tensor:
            for seq in group:
                if self.fault_hook is not None:
                    self.fault_hook(seq)
            self.before_forward(group, counts)
            return run_batch(self.model, self.cache, group, counts)

        try:
            return list(run(seqs, num_tokens))
        except NotImplementedError:
            raise
        except Exception as e:
            if len(seqs) == 1:
                return [e]
        rows: list[torch.Tensor | Exception] = []
        for seq, n in zip(seqs, num_tokens, strict=True):
            try:
                rows.append(run([seq], [n])[0])
            except Exception as e:
                rows.append(e)
        return rows

    def _constrain(
        self, seqs: list[Sequence], num_tokens: list[int], rows: list[torch.Tensor | Exception]
    ) -> list[torch.Tensor | Exception]:
        """Mask the logits of the guided sequences that sample this step, all in one mask_logits call;
        a guided sequence with no token left to take gets a ValueError instead of its row."""
        due = [
            i
            for i, (seq, n, row) in enumerate(zip(seqs, num_tokens, rows, strict=True))
            if seq.guide is not None
            and not isinstance(row, Exception)
            and seq.num_computed_tokens + n == seq.num_tokens
        ]
        if not due:
            return rows  # no constraint in this batch: part 1's engine, untouched
        masked = mask_logits(torch.stack([rows[i] for i in due]), [seqs[i].guide for i in due])
        rows = list(rows)
        for i, row in zip(due, masked, strict=True):
            dead = not torch.isfinite(row).any()
            rows[i] = ValueError("the constraint allows no token of this vocabulary here") if dead else row
        return rows

    def before_forward(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        """Called with the sequences of each forward pass just before it runs (LoRAEngine maps their
        tokens to adapters here); nothing to do for the base model."""

    def _fail(self, seq: Sequence, e: Exception) -> RequestOutput:
        """Finish a request the engine could not serve, free its blocks, and say why."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        self.requests.pop(seq.request_id, None)
        seq.finish_time = time.perf_counter()
        return self._output(seq, "", "error", error=f"{type(e).__name__}: {e}")

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion; final outputs in prompt order."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def _update(self, seq: Sequence) -> RequestOutput:
        """After a new token: detokenize, check EOS / stop strings / max_tokens, and stream the safe delta."""
        p = seq.params
        reason = None
        if seq.token_ids[-1] == self.model.config.eos_token_id and not p.ignore_eos:
            reason = "stop"
        elif seq.guide is not None and seq.guide.is_finished:
            reason = "stop"  # the constrained output is complete: nothing but EOS could follow
        elif len(seq.output_token_ids) >= p.max_tokens:
            reason = "length"
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_token_ids)
            cut = find_stop(seq.text, p.stop)
            if cut is not None:
                seq.text, reason = seq.text[:cut], "stop"
        if reason:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
            seq.finish_time = time.perf_counter()
        end = len(seq.text) if reason else safe_length(seq.text, p.stop)
        delta, seq.num_sent_chars = seq.text[seq.num_sent_chars : end], max(end, seq.num_sent_chars)
        return self._output(seq, delta, reason)

    def _output(self, seq: Sequence, delta: str, reason: str | None, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=seq.text,
            delta_text=delta,
            finished=reason is not None,
            finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            error=error,
        )
