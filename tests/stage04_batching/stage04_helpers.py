"""Helpers for the stage-04 tests: small random-init labkit models, prompts, the reference, a token counter.

References are labkit's contiguous-cache model (`Llama.generate`), which tests/meta checks against
Hugging Face, and plain PyTorch ops; never the stage's solution.
"""

import contextlib
import random
import time

import torch

from labkit.model import Llama
from labkit.serving import serving
from labkit.testing import FP32_MARGIN, assert_greedy_within, greedy_logits, random_labkit_llama

PROMPT = "Once upon a time, there was"


def make_model(seed: int = 0, vocab_size: int = 101, **overrides) -> Llama:
    """labkit.testing.random_labkit_llama with the vocabulary random_prompts draws from and room for long prompts."""
    return random_labkit_llama(seed, vocab_size=vocab_size, **{"max_position_embeddings": 512, **overrides})


def random_prompts(seed: int, n: int, lo: int, hi: int, vocab_size: int = 101) -> list[list[int]]:
    """n prompts of lengths in [lo, hi] with ids >= 3 (no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    """log p over the last dim in float64, written out: x - max - log(sum(exp(x - max)))."""
    x = logits.double()
    shifted = x - x.max(-1, keepdim=True).values
    return shifted - shifted.exp().sum(-1, keepdim=True).log()


@torch.no_grad()
def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float64: row t is log p(next token | ids[: t + 1]), one contiguous forward pass."""
    return log_softmax64(model(torch.tensor([ids]))[0])


@torch.no_grad()
def reference_decode(
    model, prompt: list[int], n: int, penalize=None, generator=None, temperature=1.0, seen=None
) -> list[int]:
    """n tokens by recomputing the whole sequence each step: argmax, or a draw from softmax(logits / T)
    with `generator`; penalize(logits, output so far) -> logits is applied first, and each step's
    logits are appended to `seen` if given."""
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([prompt + out]))[0, -1].float()
        if penalize is not None:
            logits = penalize(logits, out)
        if seen is not None:
            seen.append(logits)
        if generator is None:
            out.append(int(logits.argmax()))
        else:
            out.append(int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)))
    return out


def reference(model: Llama, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each request generated alone with labkit's contiguous KV cache (greedy, stops at EOS)."""
    return [model.generate(p, n) for p, n in zip(prompts, max_tokens, strict=True)]


def assert_alone(got: list[int], model: Llama, prompt: list[int], want: list[int], what: str) -> None:
    """A request's greedy tokens from the engine are `want` (generated alone, `reference`) up to a near-tie of
    the model's logits: a batch, a paged cache or a chunk sums in other shapes than one request alone, so a
    token the model rates within FP32_MARGIN of its maximum may win there (labkit.testing.assert_greedy_within)."""
    assert_greedy_within(got, want, lambda: greedy_logits(model, prompt, want), FP32_MARGIN, what)


class TokenCounter:
    """Counts the token positions the model computes (a forward hook on the embedding)."""

    def __init__(self, model: Llama):
        self.tokens = 0
        self.calls = 0
        self.sizes: list[int] = []
        model.model.embed_tokens.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.tokens += args[0].numel()
        self.calls += 1
        self.sizes.append(args[0].numel())


class LiveServer:
    """create_app(...) served by a real uvicorn on a free loopback port (labkit.bench.loadtest.serving), over a
    small random model; `offline` is a second engine on the same weights for reference outputs."""

    def __init__(self, impl, tokenizer, num_blocks: int = 128, **app_kw):
        engine_mod = impl("stage04_batching.engine")
        self.api = impl("stage04_batching.api_server")
        self.model = make_model(7, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=256)
        self.engine = engine_mod.LLMEngine(self.model, tokenizer, num_blocks=num_blocks, max_num_seqs=8)
        self.offline = engine_mod.LLMEngine(self.model, tokenizer, num_blocks=64)
        self.app = self.api.create_app(self.engine, tokenizer, model_name="test-model", **app_kw)
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(serving(self.app, timeout=20))

    @property
    def core(self):
        return self.app.state.core

    def close(self):
        self._stack.close()


def wait_blocks_free(engine, seconds: float = 10.0) -> int:
    """Poll until the engine holds no request and no block (or `seconds` pass); the blocks still in use."""
    deadline = time.time() + seconds
    while time.time() < deadline and (engine.block_manager.num_used_blocks or engine.has_unfinished_requests()):
        time.sleep(0.02)
    return engine.block_manager.num_used_blocks
