"""One request as the engine sees it: its tokens, how many have KV in the cache, its block table; and what the
engine reports of it after each step (RequestOutput)."""

import enum
import time
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request decodes. temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    guided_regex: str | bytes | None = None  # structured output (part 2): the output must match this regex
    lora: str | None = None  # the LoRA adapter that serves the request (lora_engine.py); None: the base model
    n: int = 1  # parallel sampling: n sequences from one prompt, computed once (engine.py forks them)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token the output already holds
    frequency_penalty: float = 0.0  # ... and this once per occurrence
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # report each output token's logprob and the this many most likely tokens'
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (echo)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not all(-100 <= b <= 100 for b in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {self.logit_bias}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (or None: not reported), got {getattr(self, name)}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """One token's log-probability under the model (before any sampling setting) and the `k` most likely
    tokens of the same position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


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
    index: int = 0  # which of the request's n sequences this is (its id is sibling_ids(parent, n)[index])
    logprobs: list[TokenLogprob] | None = None  # of every output token so far, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # of each prompt token (None for the first)


def sibling_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n sequences: its own, then one per extra sample (parallel sampling)."""
    return [request_id] + [f"{request_id}-{i}" for i in range(1, n)]


class Sequence:
    """token_ids = prompt + output so far. Positions [0, num_computed_tokens) have K/V in the paged cache;
    the next step computes [num_computed_tokens, num_computed_tokens + n) for the n tokens it schedules.
    Preemption resets num_computed_tokens to 0 and keeps the output, so recompute re-prefills both."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, index: int = 0):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; pass at least one token")
        self.request_id = request_id
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by prefix-cache hits (last admission)
        self.block_table: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.text = ""  # detokenized output, cut at a stop string
        self.num_sent_chars = 0  # how much of `text` has been streamed
        self.detok_offsets = (0, 0)  # output tokens [a, b): the context the next token's text is decoded with
        self.guide = None  # structured.Guide of a guided_regex request, set by the engine
        self.index = index  # which of the request's n samples (n > 1), each seeded seed + index as vLLM does
        seed = params.seed if params.seed is None or not index else (params.seed + index) % 2**64
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.logprobs: list = []  # TokenLogprob of each output token, when params.logprobs is set
        self.prompt_logprobs: list = [None]  # ... of each prompt token, when params.prompt_logprobs is set
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_rows(self) -> bool:
        """Its prompt logprobs are asked for and not all computed yet: every prompt position needs its row."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks that hold every token so far (ceil(num_tokens / block_size))."""
        return -(-self.num_tokens // block_size)

    def detokenize(self, tokenizer, final: bool) -> None:
        """Append the new token's text to self.text, decoding only the last few tokens (vLLM's incremental
        detokenizer: decoding the whole output every token cost O(length) a token). Tokens [a, b) were decoded
        already and give the new ones their context (a leading space, a byte-level character's first bytes);
        text is held back while it ends in an incomplete UTF-8 character, and the final token decodes it all."""
        ids = self.output_token_ids
        if final:
            self.text = tokenizer.decode(ids)
            return
        a, b = self.detok_offsets
        before, now = tokenizer.decode(ids[a:b]), tokenizer.decode(ids[a:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self.detok_offsets = (b, len(ids))

    def output(self, delta: str, reason: str | None, error: str | None = None) -> RequestOutput:
        """What the engine reports of this sequence now: `delta` the text new since its last report, `reason`
        why it finished (None: it runs on), `error` why the engine failed it."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            token_ids=self.output_token_ids,
            text=self.text,
            delta_text=delta,
            finished=reason is not None,
            finish_reason=reason,
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            error=error,
            index=self.index,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_logprobs=list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None,
        )

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
