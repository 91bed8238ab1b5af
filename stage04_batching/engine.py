"""The continuous-batching engine: labkit's Llama weights run over the paged KV cache.

    engine = LLMEngine(model, tokenizer)
    outputs = engine.generate(["Once upon a time"], SamplingParams(max_tokens=32))

Each step() asks the scheduler for a batch, runs ONE forward pass over all its tokens (prefill
chunks and decodes packed together), samples a token for every sequence whose prompt is fully
computed, and returns what changed for streaming.

Given code (nano-vllm: engine/llm_engine.py); the sampling and stop-string logic it calls is yours,
in sampling.py. What a step reports of each request (RequestOutput) is in sequence.py beside the Sequence it
describes; the course's token indexes for guided requests are in guided_backends.py beside the libraries'.
"""

import itertools
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from labkit.fast_paged import CPP_MAX_ROWS, accelerate
from labkit.model import Llama, apply_rope, refuse_extras
from labkit.serving import check_request

from .batch_invariant import forward_invariant
from .block_manager import BlockManager
from .byte_dfa import DFA
from .config import EngineConfig
from .guided_backends import TokenIndexes, compute_rows
from .kv_quant import make_cache
from .paged_attention import PagedKVCache, paged_attention, slot_mapping
from .sampling import apply_penalties, find_stop, logprobs_of, safe_length, sample
from .scheduler import Scheduler
from .sequence import RequestOutput, SamplingParams, Sequence, Status, TokenLogprob, sibling_ids
from .structured import Guide, TokenIndex, TokenTrie, mask_logits

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
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """labkit's Llama over a packed batch: N tokens of B sequences -> logits (B, vocab) of each last token,
    or of the token rows `keep` (M,) int64 lists (prompt logprobs need every prompt position).

    input_ids, positions, slots: (N,) int64; block_tables (B, max_blocks); context_lens, query_lens (B,).
    Linear layers see all N tokens at once (that is the batching win); attention goes through the pool.
    """
    c = model.config
    N = len(input_ids)
    x = model.model.embed_tokens(input_ids)  # (N, hidden)
    cos, sin = model.rope_cos[positions, None], model.rope_sin[positions, None]  # (N, 1, head_dim): one row a token
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        fused = getattr(layer, "fused", None)  # fast_paged's: the same work around attention in one C++ call each
        qkv = fused and fused.qkv(x, cos, sin)
        if qkv is None:
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(N, c.num_attention_heads, c.head_dim)
            k = attn.k_proj(h).view(N, c.num_key_value_heads, c.head_dim)
            v = attn.v_proj(h).view(N, c.num_key_value_heads, c.head_dim)
            q, k = attn.norm_qk(q, k)  # Qwen3's per-head RMSNorm; a no-op for the others
            qkv = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v  # (N, heads, D)
        q, k, v = qkv
        cache.write(i, k, v, slots)
        k_pool, v_pool, tables = cache.read(i, block_tables)  # a quantized pool's blocks widened to float32
        y = paged_attention(q, k_pool, v_pool, tables, context_lens, query_lens)
        out = fused and fused.out(x, y)
        if out is None:
            x = x + attn.o_proj(y.reshape(N, -1))
            out = x + layer.mlp(layer.post_attention_layernorm(x))
        x = out
    if keep is not None:
        x = x[keep]
    elif N > len(query_lens):  # keep each sequence's last token; a pure decode step has only those
        x = x[torch.cumsum(query_lens, 0) - 1]
    return model.lm_head(model.model.norm(x)).float()


def run_batch(
    model: Llama,
    cache: PagedKVCache,
    seqs: list[Sequence],
    num_tokens: list[int],
    all_rows: list[bool] | None = None,
    forward: Callable[..., torch.Tensor] = forward_paged,
) -> torch.Tensor:
    """Pack the next num_tokens[b] tokens of every sequence into flat tensors and run `forward` (forward_paged,
    or batch_invariant.forward_invariant): logits (B, vocab) at each sequence's last computed token. With
    all_rows, a flagged sequence gets all its num_tokens[b] rows instead (in order, packed back to back with
    the others' last rows)."""
    ids, positions, slots = [], [], []
    for seq, n in zip(seqs, num_tokens, strict=True):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += slot_mapping(seq.block_table, start, end, cache.block_size)
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    keep = None
    if all_rows and any(all_rows):
        ends = itertools.accumulate(num_tokens)
        keep = torch.tensor(
            [i for e, n, a in zip(ends, num_tokens, all_rows, strict=True) for i in range(e - n if a else e - 1, e)]
        )
    return forward(
        model,
        cache,
        torch.tensor(ids),
        torch.tensor(positions),
        torch.tensor(slots),
        torch.tensor(tables),
        torch.tensor([s.num_computed_tokens + n for s, n in zip(seqs, num_tokens, strict=True)]),
        torch.tensor(num_tokens),
        keep,
    )


class LLMEngine:
    def __init__(self, model: Llama, tokenizer=None, config: EngineConfig | None = None, **settings):
        """model: labkit Llama (eval); tokenizer: a `tokenizers.Tokenizer`, needed for str prompts and text.
        config: the engine's settings (config.py); keyword settings override fields of it (num_blocks=64)."""
        self.config = c = (config or EngineConfig()).replace(**settings)
        # the same model, its linear layers through labkit.cpu_kernels (fast_paged.py): config.kernels, quantization
        # batch-invariant: every pass, a prefill chunk too, through the kernels, whose sums do not depend on the rows
        rows = math.inf if c.batch_invariant else CPP_MAX_ROWS
        self.model = accelerate(model.eval(), c.kernels, None if c.quantization == "none" else c.quantization, rows)
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(c.num_blocks, c.block_size, c.enable_prefix_caching)
        self.cache = make_cache(
            model.config, c.num_blocks, c.block_size, c.kv_cache_dtype, next(model.parameters()).dtype
        )
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens)
        self.requests: dict[str, Sequence] = {}
        self.unforked: dict[str, list[Sequence]] = {}  # parent id -> the siblings it forks once its prompt is computed
        self._ids = itertools.count()
        self.max_model_len = c.context_length(model.config.max_position_embeddings)
        # paged_attention has no sliding window: refuse one that a sequence could outgrow.
        refuse_extras(model.config, "stage04's paged engine", SUPPORTED_EXTRAS, self.max_model_len)
        # Batch-invariant mode (part 2, lab4.ipynb): the same bits for a token whatever batch it is in, slower.
        self.forward = forward_invariant if c.batch_invariant else forward_paged
        # Called with each sequence of a batch just before the forward pass; tests and
        # `labkit.bench.loadtest --chaos` set it to make a chosen request fail inside step().
        self.fault_hook: Callable[[Sequence], None] | None = None
        # Structured output (part 2): token indexes by pattern, least recently used first; rows fill lazily.
        self.indexes = TokenIndexes(model.config.vocab_size, model.config.eos_token_id)
        self.token_indexes = self.indexes.by_pattern
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="masks")  # rows computed beside the forward
        self.guided_backend = None  # a guided_backends.LibraryBackend; None: the course's own token index

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises ValueError (labkit.serving.RequestRefused, naming the field)
        if it can never run: the server's checks, made again here for callers that skip the server.

        With params.n > 1 the request has n sequences (ids: sibling_ids): the first computes the prompt,
        then forks the others, which share its KV blocks until they write (copy-on-write)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        family = sibling_ids(request_id, params.n)
        if any(i in self.requests for i in family):
            raise ValueError(f"request id {request_id!r} is already in use")
        check_request(
            ids,
            params.max_tokens,
            max_model_len=self.max_model_len,
            vocab_size=self.model.config.vocab_size,
            logit_bias=params.logit_bias,
            n=params.n,
            max_num_seqs=self.config.max_num_seqs,
        )
        seqs = [Sequence(i, ids, params, index) for index, i in enumerate(family)]
        for seq in seqs:
            if params.guided_regex is not None:
                seq.guide = self.new_guide(params.guided_regex)
            self.requests[seq.request_id] = seq
        if params.n > 1:
            self.unforked[request_id] = seqs[1:]
        self.scheduler.add(seqs[0])
        return request_id

    def new_guide(self, pattern: str | bytes) -> Guide:
        """One sequence's guide: the course's Guide over the pattern's token index, or, with a guided_backend
        set (guided_backends.py: llguidance, XGrammar), that library's guide behind the same interface."""
        if self.guided_backend is not None:
            return self.guided_backend.guide(pattern)
        return Guide(self.token_index(pattern))

    def vocab_trie(self) -> TokenTrie:
        """The trie of the vocabulary's bytes that every token index walks (built once, on first use)."""
        return self.indexes.vocab_trie(self.tokenizer)

    def token_index(self, pattern: str | bytes, dfa: DFA | None = None) -> TokenIndex:
        """The token index of a guided_regex (compiled once per pattern, then cached; its rows are computed
        as sequences reach their states). Raises ValueError for a pattern byte_dfa cannot compile within
        its budgets. The server compiles `dfa` in another process and hands it in before submitting."""
        return self.indexes.get(pattern, self.tokenizer, dfa)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (unknown or finished ids are ignored).
        A parent aborted before its prompt is computed takes its unforked siblings along."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        for sibling in self.unforked.pop(request_id, []):
            self.abort(sibling.request_id)
        for siblings in self.unforked.values():
            if seq in siblings:
                siblings.remove(seq)
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
        batch = self._schedule()
        if not batch.seqs:
            return []
        for src, dst in batch.blocks_to_copy:
            self.cache.copy_block(src, dst)
        outputs = []
        # A guided sequence's mask depends only on the token it sampled last step: compute the rows on another
        # thread while the forward pass runs (NumPy and PyTorch release the GIL), so a guided step costs the
        # slower of the two, not their sum (XGrammar overlaps its CPU masks with the GPU's forward the same way).
        guides = [s.guide for s in batch.seqs if s.guide is not None]
        masks = self._mask_thread.submit(compute_rows, guides) if guides else None
        chunks = self._forward(batch.seqs, batch.num_tokens)
        if masks is not None:
            masks.result()
        last = [c if isinstance(c, Exception) else c[-1] for c in chunks]
        rows = self._constrain(batch.seqs, batch.num_tokens, last)
        for seq, n, chunk, row in zip(batch.seqs, batch.num_tokens, chunks, rows, strict=True):
            try:
                if isinstance(row, Exception):
                    raise row
                self._record_prompt_logprobs(seq, chunk)
                seq.num_computed_tokens += n
                self.block_manager.cache_blocks(seq)
                if seq.num_computed_tokens < seq.num_tokens:
                    continue  # a prefill chunk that has not reached the end of the prompt yet
                family = [seq, *self._fork(seq)]
            except NotImplementedError:
                raise  # an unwritten TODO is not one request's fault
            except Exception as e:
                outputs += [self._fail(s, e) for s in [seq, *self.unforked.pop(seq.request_id, [])]]
                continue
            for s in family:  # the siblings forked this step sample their first token from the same logits
                try:
                    outputs.append(self._sample(s, row, chunk[-1]))
                except NotImplementedError:
                    raise
                except Exception as e:
                    outputs.append(self._fail(s, e))
        return outputs

    def _schedule(self):
        """The scheduler's batch. A prompt whose logprobs are asked for must be computed, not read from the
        prefix cache (vLLM skips the cache for those requests too), so a step that may admit one reads none."""
        skip = self.block_manager.enable_prefix_caching and any(s.wants_prompt_rows for s in self.scheduler.waiting)
        self.block_manager.enable_prefix_caching = not skip and self.config.enable_prefix_caching
        try:
            return self.scheduler.schedule()
        finally:
            self.block_manager.enable_prefix_caching = self.config.enable_prefix_caching

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: the siblings of a parent whose prompt is now computed join the running batch,
        sharing every block of the parent (BlockManager.fork; the scheduler copies a shared block before
        one of them writes into it)."""
        siblings = self.unforked.pop(parent.request_id, [])
        for seq in siblings:
            self.block_manager.fork(parent, seq)
            seq.prompt_logprobs = parent.prompt_logprobs
            seq.status = Status.RUNNING
            self.scheduler.running.append(seq)
        return siblings

    def _sample(self, seq: Sequence, row: torch.Tensor, raw: torch.Tensor) -> RequestOutput:
        """Sample seq's next token from `row` (its logits after any constraint) and report it; `raw` are the
        model's logits, whose log-softmax the logprobs report (vLLM's default: before any sampling setting)."""
        p = seq.params
        if p.presence_penalty or p.frequency_penalty or p.logit_bias:
            row = apply_penalties(row, seq.output_token_ids, p)
        token = sample(row, p, seq.generator)
        if p.logprobs is not None:
            seq.logprobs += self._logprobs(raw[None], [token], p.logprobs)
        seq.token_ids.append(token)
        if seq.guide is not None:
            seq.guide.advance(token)
        seq.first_token_time = seq.first_token_time or time.perf_counter()
        return self._update(seq)

    def _record_prompt_logprobs(self, seq: Sequence, chunk: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this chunk's rows predict: the row at position p predicts token p + 1."""
        if not seq.wants_prompt_rows:
            return
        start, done = seq.num_computed_tokens, len(seq.prompt_logprobs)
        lo, hi = max(done - 1, start), min(start + len(chunk), seq.num_prompt_tokens - 1)
        if done - 1 < start:  # a prefix-cache hit would leave positions without logits
            raise RuntimeError(
                f"prompt logprobs need every prompt position computed; positions {done}..{start} were skipped"
            )
        if hi > lo:
            seq.prompt_logprobs += self._logprobs(
                chunk[lo - start : hi - start], seq.token_ids[lo + 1 : hi + 1], seq.params.prompt_logprobs
            )

    @staticmethod
    def _logprobs(rows: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
        chosen, top_ids, top_lps = logprobs_of(rows, torch.tensor(token_ids), min(k, rows.shape[-1]))
        return [
            TokenLogprob(t, lp, list(zip(ids, lps, strict=True)))
            for t, lp, ids, lps in zip(token_ids, chosen.tolist(), top_ids.tolist(), top_lps.tolist(), strict=True)
        ]

    def _forward(self, seqs: list[Sequence], num_tokens: list[int]) -> list[torch.Tensor | Exception]:
        """Logits (rows, vocab) of each sequence, or the exception its forward pass raised: one row, its last
        token's, or all num_tokens rows of a sequence whose prompt logprobs are being computed.

        When the batched pass raises, each sequence runs again alone (rewriting the same cache slots),
        so one request's fault fails that request only; a fault every sequence hits fails them all.
        """

        def run(group: list[Sequence], counts: list[int]) -> list[torch.Tensor]:
            for seq in group:
                if self.fault_hook is not None:
                    self.fault_hook(seq)
            self.before_forward(group, counts)
            wants = [s.wants_prompt_rows for s in group]
            logits = run_batch(self.model, self.cache, group, counts, wants, self.forward)
            return list(logits.split([n if w else 1 for n, w in zip(counts, wants, strict=True)]))

        try:
            return run(seqs, num_tokens)
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
        return seq.output("", "error", error=f"{type(e).__name__}: {e}")

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion; final outputs in prompt order (the n of a request one after another)."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [sibling_ids(self.add_request(p, sp), sp.n) for p, sp in zip(prompts, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for family in ids for i in family]

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
            seq.detokenize(self.tokenizer, final=reason is not None)
            cut = find_stop(seq.text, p.stop)
            if cut is not None:
                seq.text, reason = seq.text[:cut], "stop"
        if reason:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
            seq.finish_time = time.perf_counter()
        end = len(seq.text) if reason else safe_length(seq.text, p.stop)
        delta, seq.num_sent_chars = seq.text[seq.num_sent_chars : end], max(end, seq.num_sent_chars)
        return seq.output(delta, reason)
