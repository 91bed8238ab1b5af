"""Structured output: decoding constrained to a regular expression, or to a JSON Schema compiled to one.

    dfa = compile_regex(schema_to_regex(schema))                  # byte_dfa.py (given)
    index = build_token_index(dfa, token_bytes(tokenizer, V), eos)  # once per pattern: cheap, nothing computed yet
    guide = Guide(index)                                            # one per request
    logits = mask_logits(logits, [guide, None, ...])                # every step, the whole batch at once
    guide.advance(token)                                            # after sampling

The automaton reads bytes; the model emits tokens. The token index holds, for each automaton state,
which tokens keep the match alive (walking all of a token's bytes) and where each one leads
(Willard & Louf 2023, "Efficient Guided Generation"). Outlines precomputes it for every state, which
costs states x vocabulary before the first token; here a state's row is computed when a sequence first
reaches it and memoized (llguidance's on-demand masks), so a pattern of thousands of states costs only
the rows its outputs visit.
"""

import json
import re
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .byte_dfa import DFA


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: byte -> the printable character that stands for it in vocab strings.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (space, control characters, ...)
    are shifted to chr(256 + k) in byte order, so a leading space shows as 'Ġ' (chr(288)).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + shifted)
            shifted += 1
    return alphabet


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id stands for: a list of length vocab_size (the model's, which may exceed
    the tokenizer's), None for special tokens (<s>, </s>, ...) and for ids the tokenizer does not have.

    tokenizer: a byte-level BPE `tokenizers.Tokenizer` (GPT-2, Llama 3, Qwen, SmolLM). Its vocabulary
    strings are written in byte_level_alphabet(); map every character back to its byte. A token may end
    in the middle of a UTF-8 character, so never decode a token to str on its own.
    Raises ValueError naming the token if a vocabulary string is not in that alphabet.
    """
    raise NotImplementedError("stage04: token_bytes — see lab2.ipynb §1")


@dataclass
class TokenTrie:
    """The vocabulary as a trie over bytes, flattened into arrays: node 0 is the root (no bytes), every
    other node one byte longer than its parent, numbered level by level (all nodes of depth 1, then depth
    2, ...), so a level's parents all come before it. A token's bytes spell the path to its node."""

    parent: np.ndarray  # (N,) int64: the node one byte shorter (the root's is itself)
    byte: np.ndarray  # (N,) int64: the byte from parent[n] to n
    levels: list[int]  # the nodes of depth d are levels[d]:levels[d + 1] (levels[0], levels[1] = 0, 1: the root)
    token_node: np.ndarray  # (V,) int64: the node where token t's bytes end; N (no node) for a token with no bytes
    single_bytes: frozenset[int]  # the bytes that are a token by themselves


def token_trie(vocab: list[bytes | None]) -> TokenTrie:
    """The flattened trie of `vocab` (from token_bytes), built once per vocabulary. Tokens sharing a prefix
    share its nodes: SmolLM2's 49,152 tokens hold 332,150 bytes but make 100,298 nodes."""
    prefixes = sorted({data[:d] for data in vocab if data for d in range(1, len(data) + 1)}, key=lambda p: (len(p), p))
    node = {b"": 0} | {p: i for i, p in enumerate(prefixes, 1)}
    parent = np.array([0] + [node[p[:-1]] for p in prefixes], dtype=np.int64)
    byte = np.array([0] + [p[-1] for p in prefixes], dtype=np.int64)
    depth = np.array([0] + [len(p) for p in prefixes])
    levels = np.searchsorted(depth, np.arange(depth[-1] + 2)).tolist()
    token_node = np.array([node[data] if data else len(node) for data in vocab], dtype=np.int64)
    single_bytes = frozenset(data[0] for data in vocab if data and len(data) == 1)
    return TokenTrie(parent, byte, levels, token_node, single_bytes)


def state_mask(
    dfa: DFA, trie: TokenTrie, state: int, vocab_size: int, eos_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of the token index: which tokens may follow DFA state `state`, and where each leads.

    Returns allowed (vocab_size,) bool and next_state (vocab_size,) int64. allowed[t] is True iff reading
    ALL of token t's bytes from `state` keeps the DFA alive (a token may span several literals of the
    pattern, e.g. `",` ends a string and starts the separator), and next_state[t] is the state it ends in,
    -1 where not allowed. A token with no bytes is never allowed, except EOS: allowed exactly in
    accepting states, where it leaves the state unchanged.

    Walk the trie level by level, a whole level per NumPy operation: the state each node's bytes lead
    to is the table entry of its parent's state and its byte (dfa.table: (num_states + 1, 256), the
    extra last row a dead state every byte keeps, `dead = dfa.num_states`). Once a node is dead all its
    children are; once a whole level is dead you may stop. A token's state is its node's
    (trie.token_node; index N, past the last node, is where the tokens without bytes point: keep it dead).
    """
    raise NotImplementedError("stage04: state_mask — see lab2.ipynb §2")


ROW_BUDGET_BYTES = 64 * 2**20  # one pattern's memoized rows; past it the oldest are dropped and recomputed


class TokenIndex:
    """A DFA's token index, computed lazily: a state's row (state_mask) is computed the first time a
    sequence reaches it and memoized, so the work grows with the tokens generated, not with the size of
    the automaton (llguidance computes every mask on demand the same way). Thread-safe: the server
    compiles on a worker thread while the engine steps on another."""

    def __init__(
        self, dfa: DFA, trie: TokenTrie | None, vocab_size: int, eos_token_id: int, max_bytes: int = ROW_BUDGET_BYTES
    ):
        self.dfa, self.trie, self.vocab_size, self.eos_token_id = dfa, trie, vocab_size, eos_token_id
        self.initial = dfa.initial
        self.max_bytes = max_bytes
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lock = threading.Lock()

    @classmethod
    def from_table(
        cls, allowed: torch.Tensor, next_state: torch.Tensor, initial: int, eos_token_id: int
    ) -> "TokenIndex":
        """An index whose every row is given ((S, V) tensors), e.g. one built by brute force in a test."""
        index = cls(DFA([{} for _ in range(allowed.shape[0])], set(), initial), None, allowed.shape[1], eos_token_id)
        index.rows = {s: (allowed[s], next_state[s].to(torch.int16)) for s in range(allowed.shape[0])}
        index.max_bytes = index.nbytes
        return index

    @property
    def nbytes(self) -> int:
        """The bytes its memoized rows hold (the DFA and the shared trie not counted)."""
        return len(self.rows) * self.vocab_size * 3  # bool + int16 per token

    def row(self, state: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(allowed (V,) bool, next_state (V,) int16) of `state`, computed on first use."""
        row = self.rows.get(state)
        if row is None:
            allowed, nxt = state_mask(self.dfa, self.trie, state, self.vocab_size, self.eos_token_id)
            row = (allowed, nxt.to(torch.int16))  # MAX_STATES < 2**15: int16 holds every state and -1
            with self.lock:
                while self.rows and self.nbytes + 3 * self.vocab_size > self.max_bytes:
                    self.rows.pop(next(iter(self.rows)))
                self.rows[state] = row
        return row

    @property
    def allowed(self) -> torch.Tensor:
        """(num_states, V) bool, every row computed: for inspection and tests, never in the engine."""
        return torch.stack([self.row(s)[0] for s in range(self.dfa.num_states)])

    @property
    def next_state(self) -> torch.Tensor:
        """(num_states, V) int64, -1 where not allowed: every row computed, like `allowed`."""
        return torch.stack([self.row(s)[1] for s in range(self.dfa.num_states)]).to(torch.int64)


def build_token_index(
    dfa: DFA, vocab: list[bytes | None], eos_token_id: int, trie: TokenTrie | None = None
) -> TokenIndex:
    """The (lazy) token index of `dfa` over `vocab` (from token_bytes); pass the vocabulary's `trie`
    (token_trie) when you have it, since building it walks every token."""
    return TokenIndex(dfa, token_trie(vocab) if trie is None else trie, len(vocab), eos_token_id)


class Guide:
    """One request's position in a TokenIndex, advanced by every token it samples."""

    def __init__(self, index: TokenIndex):
        self.index = index
        self.state = index.initial

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool: the tokens this request may sample next."""
        return self.index.row(self.state)[0]

    def advance(self, token_id: int) -> None:
        nxt = int(self.index.row(self.state)[1][token_id])
        if nxt < 0:
            raise ValueError(f"token {token_id} is not allowed in state {self.state} of the constraint")
        self.state = nxt

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS may follow: the output is complete (a request stops here without sampling EOS).
        Read off the automaton where it can be (a state that reads no byte; a byte that is a token by itself),
        so that the engine learns it without computing the new state's row, which it leaves to the next step's
        mask thread; only a vocabulary without that one-byte token needs the row."""
        trie, reads = self.index.trie, self.index.dfa.transitions[self.state]
        if trie is not None and not reads:
            return True
        if trie is not None and not trie.single_bytes.isdisjoint(reads):
            return False
        allowed = self.allowed()
        return int(allowed.sum()) - int(allowed[self.index.eos_token_id]) == 0


def mask_logits(logits: torch.Tensor, guides: list[Guide | None]) -> torch.Tensor:
    """logits (B, vocab) float32 of a batch, one guide per row (None: the row is not constrained).

    Returns new logits with -inf on every token a row's guide does not allow; rows without a guide,
    and the allowed entries, keep their values exactly. One masked_fill for the whole batch.
    """
    raise NotImplementedError("stage04: mask_logits — see lab2.ipynb §3")


# JSON Schema -> regex. The building blocks are given; schema_to_regex assembles them.
WS = "[ ]?"  # at most one space between JSON tokens: free runs of whitespace let a model ramble on
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'  # one character of a JSON string
INTEGER = r"-?(?:0|[1-9][0-9]{0,15})"  # at most 16 digits, so a sampled number always ends
NUMBER = INTEGER + r"(?:\.[0-9]{1,15})?(?:[eE][+-]?[0-9]{1,3})?"
BOOLEAN = "(?:true|false)"
NULL = "null"
SCALAR = {"string": f'"{STRING_CHAR}*"', "integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}
# Keywords that only annotate, or that every output we generate already satisfies.
ANNOTATIONS = {"title", "description", "$schema", "$id", "default", "examples", "additionalProperties"}
SUPPORTED = {
    "type",
    "properties",
    "required",
    "enum",
    "const",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
}


class UnsupportedSchema(ValueError):
    """A JSON Schema feature this compiler does not implement; the message names it."""


def inline_refs(schema: dict) -> dict:
    """The schema with every local `$ref` ("#/$defs/Name", as pydantic and the openai client write nested
    models) replaced by its definition and `$defs` removed, so schema_to_regex never sees a reference.
    A recursive or non-local reference raises UnsupportedSchema (a recursive schema is not regular)."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})} if isinstance(schema, dict) else {}

    def resolve(node, seen: tuple[str, ...]):
        if isinstance(node, list):
            return [resolve(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            ref = node["$ref"]
            name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else ""
            if ref not in (f"#/$defs/{name}", f"#/definitions/{name}") or name not in defs:
                raise UnsupportedSchema(f"unsupported JSON Schema feature '$ref' to {ref!r} (only local #/$defs/...)")
            if ref in seen:
                raise UnsupportedSchema(f"unsupported JSON Schema feature '$ref': {ref!r} refers to itself")
            return resolve(defs[name], (*seen, ref))
        return {k: resolve(v, seen) for k, v in node.items() if k not in ("$defs", "definitions")}

    return resolve(schema, ())


def any_json(depth: int) -> str:
    """Any JSON value nested at most `depth` levels deep (JSON itself is not regular)."""
    scalar = "|".join(SCALAR.values())
    if depth == 0:
        return f"(?:{scalar})"
    return f"(?:{scalar}|{any_object(depth)}|{any_array(depth)})"


def any_object(depth: int) -> str:
    """Any JSON object whose values nest at most depth - 1 levels deeper."""
    member = f"{SCALAR['string']}{WS}:{WS}{any_json(depth - 1)}"
    return rf"\{{{WS}(?:{member}(?:{WS},{WS}{member})*)?{WS}\}}"


def any_array(depth: int) -> str:
    """Any JSON array whose items nest at most depth - 1 levels deeper."""
    item = any_json(depth - 1)
    return rf"\[{WS}(?:{item}(?:{WS},{WS}{item})*)?{WS}\]"


def json_literal(value) -> str:
    """The regex matching exactly json.dumps(value)."""
    return re.escape(json.dumps(value))


def schema_to_regex(schema: dict) -> str:
    """A regex whose matches are JSON texts valid against `schema`.

    Supports: type object (properties, all emitted in order; required), string (minLength, maxLength),
    integer, number, boolean, null, array (items, minItems, maxItems), enum, const, and annotation
    keywords (ANNOTATIONS). A schema without type/enum/const is any JSON value (any_json(2)), and an
    object without properties any object (any_object(2)). Separators are WS; scalars use SCALAR, STRING_CHAR,
    json_literal. Anything else (pattern, minimum, anyOf, $ref, a list of types, ...) raises
    UnsupportedSchema naming the keyword, so no request silently runs unconstrained.
    """
    raise NotImplementedError("stage04: schema_to_regex — see lab2.ipynb §4")
