"""Guided-decoding backends: the seam a production engine has between its step and whatever computes the
token masks (vLLM's `--guided-decoding-backend`). Given code.

    engine.guided_backend = LibraryBackend("llguidance", tokenizer, vocab_size, eos)   # None: the course's own
    guide = engine.guided_backend.guide(pattern)   # what add_request puts on each guided sequence

A guide is what `mask_logits` and the engine call, whoever computes it:

    guide.allowed() -> (V,) bool     the tokens the sequence may sample next
    guide.advance(token_id)          after sampling (ValueError if the token was not allowed)
    guide.is_finished                nothing but EOS may follow

The course's backend is structured.Guide over a TokenIndex (your state_mask). llguidance and XGrammar are
optional (`make guided`); their matchers fill a bitmask, one bit per token, which is unpacked here to the
bool row the engine masks with. Both compile a regex (a JSON schema arrives as the course's regex, so every
backend enforces the same language).
"""

import threading

import numpy as np
import torch

from .byte_dfa import DFA, compile_regex
from .structured import TokenIndex, TokenTrie, token_bytes, token_trie

BACKENDS = ("course", "llguidance", "xgrammar")

# The course's backend: the token indexes kept, bounded by the bytes their memoized rows hold (clients send
# arbitrary schemas; a row costs 3 bytes per token, 147 KB on a 49,152-token vocabulary).
TOKEN_INDEX_BUDGET_BYTES = 256 * 2**20


def compute_rows(guides: list) -> None:
    """Compute (and memoize) the row each guide will ask for; a row that fails here fails again, for its own
    request only, when the engine masks its logits."""
    for guide in guides:
        try:
            guide.allowed()
        except Exception:
            pass


class TokenIndexes:
    """The course's own backend behind LLMEngine.token_index: one structured.TokenIndex per pattern, least
    recently used first, over one trie of the vocabulary's bytes. The server compiles on worker threads while
    the engine steps, hence the lock."""

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self.by_pattern: dict[str | bytes, TokenIndex] = {}
        self.trie: TokenTrie | None = None
        self.lock = threading.Lock()

    def vocab_trie(self, tokenizer) -> TokenTrie:
        with self.lock:
            if tokenizer is None:
                raise ValueError("guided_regex needs an engine with a tokenizer (tokens are matched as bytes)")
            if self.trie is None:
                self.trie = token_trie(token_bytes(tokenizer, self.vocab_size))
            return self.trie

    def get(self, pattern: str | bytes, tokenizer, dfa: DFA | None = None) -> TokenIndex:
        with self.lock:
            index = self.by_pattern.pop(pattern, None)
            if index is not None:
                self.by_pattern[pattern] = index  # most recently used goes last
                return index
        trie = self.vocab_trie(tokenizer)
        # Outside the lock: compiling takes up to a second, and other patterns' requests must not queue behind it.
        dfa = dfa or compile_regex(pattern)
        index = TokenIndex(dfa, trie, self.vocab_size, self.eos_token_id)
        with self.lock:
            index = self.by_pattern.setdefault(pattern, index)
            while sum(i.nbytes for i in self.by_pattern.values()) > TOKEN_INDEX_BUDGET_BYTES:
                self.by_pattern.pop(next(iter(self.by_pattern)))
        return index


class LibraryGuide:
    """One request's matcher in llguidance or XGrammar, its mask computed once per state."""

    def __init__(self, matcher, fill, consume, bitmask, bits: np.ndarray, vocab_size: int, eos_token_id: int):
        """bitmask: what the library's fill writes, (1, ceil(V / 32)) int32; bits: the same memory as NumPy."""
        self.matcher, self.fill, self.consume, self.bitmask, self.bits = matcher, fill, consume, bitmask, bits
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self.row: torch.Tensor | None = None  # the current state's mask, until the next advance
        self.lock = threading.Lock()  # the engine's mask thread and its step may both ask for the row

    def allowed(self) -> torch.Tensor:
        with self.lock:
            if self.row is None:
                self.fill(self.matcher, self.bitmask)
                bits = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab_size]
                self.row = torch.from_numpy(bits.astype(bool))
            return self.row

    def advance(self, token_id: int) -> None:
        with self.lock:
            if not self.consume(self.matcher, token_id):
                raise ValueError(f"token {token_id} is not allowed here by the constraint")
            self.row = None

    @property
    def is_finished(self) -> bool:
        allowed = self.allowed()
        return int(allowed.sum()) - int(allowed[self.eos_token_id]) == 0


class LibraryBackend:
    """llguidance or XGrammar behind the engine's guide interface; compiled patterns cached (a few hundred)."""

    def __init__(self, name: str, tokenizer, vocab_size: int, eos_token_id: int, cache: int = 256):
        from transformers import PreTrainedTokenizerFast

        if name not in BACKENDS[1:]:
            raise ValueError(f"unknown guided-decoding backend {name!r}; choose from {BACKENDS}")
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=tokenizer.id_to_token(eos_token_id))
        self.name, self.vocab_size, self.eos_token_id, self.cache = name, vocab_size, eos_token_id, cache
        self.compiled: dict[str | bytes, object] = {}
        try:
            if name == "llguidance":
                import llguidance.hf

                self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_token_id)
            else:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos_token_id])
                self.tokenizer, self.compiler = info, xgrammar.GrammarCompiler(info, max_threads=1)
        except ImportError as e:
            raise ImportError(f"the {name} backend is optional: install it with `make guided` ({e})") from None

    def compile(self, pattern: str | bytes) -> object:
        """The library's compiled form of `pattern` (ValueError if it refuses it), cached by pattern."""
        if pattern in self.compiled:
            return self.compiled[pattern]
        if isinstance(pattern, bytes):
            raise ValueError(f"the {self.name} backend takes str patterns, not bytes")
        try:
            if self.name == "llguidance":
                import llguidance

                compiled = llguidance.LLMatcher.grammar_from_regex(pattern)
                probe = llguidance.LLMatcher(self.tokenizer, compiled)
                if probe.is_error():
                    raise ValueError(probe.get_error())
            else:
                compiled = self.compiler.compile_regex(pattern)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{self.name} cannot compile the pattern: {e}") from None
        while len(self.compiled) >= self.cache:
            self.compiled.pop(next(iter(self.compiled)))
        self.compiled[pattern] = compiled
        return compiled

    def guide(self, pattern: str | bytes) -> LibraryGuide:
        compiled = self.compile(pattern)
        if self.name == "llguidance":
            import llguidance
            import llguidance.numpy

            matcher = llguidance.LLMatcher(self.tokenizer, compiled)
            bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
            bits = bitmask

            def fill(m, mask):
                llguidance.numpy.fill_next_token_bitmask(m, mask)

            def consume(m, token):
                return m.consume_token(token)

        else:
            import xgrammar

            matcher = xgrammar.GrammarMatcher(compiled)
            bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
            bits = bitmask.numpy()

            def fill(m, mask):
                m.fill_next_token_bitmask(mask)

            def consume(m, token):
                return m.accept_token(token)

        return LibraryGuide(matcher, fill, consume, bitmask, bits, self.vocab_size, self.eos_token_id)
