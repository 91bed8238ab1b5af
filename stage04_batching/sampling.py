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
    raise NotImplementedError("stage04: sample — see lab.ipynb §5")


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    raise NotImplementedError("stage04: find_stop — see lab.ipynb §5")


def safe_length(text: str, stops: list[str]) -> int:
    """How much of a not-yet-finished text can be streamed: hold back a trailing broken UTF-8 sequence
    (decoded as U+FFFD) and any tail that could still grow into a stop string."""
    raise NotImplementedError("stage04: safe_length — see lab.ipynb §5")


def apply_penalties(logits: torch.Tensor, output_token_ids: list[int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's presence and frequency penalties and logit_bias on logits (vocab,) float32; a new tensor,
    the input untouched (the engine still reports logprobs from it).

    Only the output so far counts, not the prompt (as in vLLM): a token that occurs c > 0 times in
    output_token_ids loses presence_penalty once and frequency_penalty c times. params.logit_bias maps
    token ids to a value added to their logit. Positive penalties make repeats less likely; -inf stays -inf.
    """
    raise NotImplementedError("stage04: apply_penalties — see lab.ipynb §5")


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
    raise NotImplementedError("stage04: logprobs_of — see lab.ipynb §5")
