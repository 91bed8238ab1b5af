"""Sampling and stop strings: what the engine does with a sequence's logits and its text after each step.

logits = apply_penalties(logits, output_ids, params)   # engine.py, when a request sets penalties or logit_bias
token = sample(logits, params, generator)              # once per sequence and step
chosen, top_ids, top_logprobs = logprobs_of(raw_logits, token_ids, k)   # when it asks for logprobs
cut = find_stop(text, params.stop)                     # these two on the detokenized output
end = safe_length(text, params.stop)
"""

import torch

from .sequence import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from logits (vocab,) float32.

    temperature 0 -> argmax. Otherwise softmax(logits / temperature) restricted to the top_k largest
    logits (if top_k > 0) and then to the smallest set of tokens whose probability reaches top_p (if
    top_p < 1), renormalized, sampled with `generator` (a per-request seed makes it reproducible).
    """
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        outside = torch.cumsum(probs, -1) - probs >= params.top_p  # the mass before it already reaches top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(outside, float("-inf")))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def safe_length(text: str, stops: list[str]) -> int:
    """How much of a not-yet-finished text can be streamed: hold back a trailing broken UTF-8 sequence
    (decoded as U+FFFD) and any tail that could still grow into a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    held = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
    return end - held


def apply_penalties(logits: torch.Tensor, output_token_ids: list[int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's presence and frequency penalties and logit_bias on logits (vocab,) float32; a new tensor,
    the input untouched (the engine still reports logprobs from it).

    Only the output so far counts, not the prompt (as in vLLM): a token that occurs c > 0 times in
    output_token_ids loses presence_penalty once and frequency_penalty c times. params.logit_bias maps
    token ids to a value added to their logit. Positive penalties make repeats less likely; -inf stays -inf.
    """
    counts = torch.bincount(torch.tensor(output_token_ids, dtype=torch.long), minlength=logits.numel())
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias))
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    return logits


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's log-probabilities at T positions (what `logprobs`, `top_logprobs` and `echo` report).

    logits:    (T, vocab) float32, row t the logits of the position that predicts token_ids[t]
    token_ids: (T,) int64
    returns    chosen (T,) float32, log p(token_ids[t]) under row t's softmax; top_ids (T, k) int64 and
               top_logprobs (T, k) float32, each row's k most likely tokens, most likely first.
    Every logprob is finite, however unlikely the token (a float32 softmax underflows to 0 far sooner).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(k, dim=-1)
    return logprobs.gather(1, token_ids[:, None]).squeeze(1), top.indices, top.values
