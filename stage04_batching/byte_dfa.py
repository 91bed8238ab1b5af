"""A regular expression compiled to a deterministic automaton over BYTES (given code).

    dfa = compile_regex(r'\\{"name":"[a-z]{1,8}"\\}')
    dfa.walk(dfa.initial, b'{"na')     # -> a live state, or None once the bytes can no longer match

Tokens of a byte-level BPE are byte strings, and a token may end in the middle of a UTF-8 character,
so the automaton reads bytes, not characters: a str pattern matches UTF-8 text (`.`, `[^"]`, `\\D`
also take every multi-byte character, as its 2-4 bytes), a bytes pattern matches raw bytes
(`rb"[\\x00-\\xff]*"` allows every byte string). The pattern must match the WHOLE output (fullmatch).

Supported: literals and escapes (\\n \\t \\r \\f \\v \\xHH, \\d \\w \\s and their negations, `\\` before
any punctuation), `.`, classes `[a-z_]` `[^"\\\\]`, groups `(...)` `(?:...)`, `|`, `* + ?`, `{n}`
`{n,}` `{n,m}`. Anything else (anchors, lookaround, backreferences, lazy quantifiers) is refused with
a ValueError naming it. Thompson's construction builds an NFA; the subset construction turns it into
a DFA, keeping only states from which the pattern can still be completed (so a live state is
never a dead end). outlines-dev/outlines does the same with the `interegular` package. The subset
construction runs over byte classes (bytes no edge of the NFA tells apart), not the 256 bytes one by
one, and the result also comes as a dense table, the form the vectorized token walk reads.
"""

import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np

ANY = frozenset(range(256))
CONT = frozenset(range(0x80, 0xC0))  # UTF-8 continuation bytes
# Every well-formed multi-byte UTF-8 character, as sequences of byte sets (RFC 3629, table 3-7).
MULTIBYTE = [
    [frozenset(range(0xC2, 0xE0)), CONT],
    [frozenset([0xE0]), frozenset(range(0xA0, 0xC0)), CONT],
    [frozenset(range(0xE1, 0xED)) | {0xEE, 0xEF}, CONT, CONT],
    [frozenset([0xED]), frozenset(range(0x80, 0xA0)), CONT],
    [frozenset([0xF0]), frozenset(range(0x90, 0xC0)), CONT, CONT],
    [frozenset(range(0xF1, 0xF4)), CONT, CONT, CONT],
    [frozenset([0xF4]), frozenset(range(0x80, 0x90)), CONT, CONT],
]
CLASSES = {
    "d": frozenset(b"0123456789"),
    "w": frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"),
    "s": frozenset(b" \t\n\r\f\v"),
}
CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


@dataclass
class DFA:
    transitions: list[dict[int, int]]  # state -> {byte: next state}; a byte not listed kills the match
    accepting: set[int]
    initial: int = 0

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    @cached_property
    def table(self) -> np.ndarray:
        """(num_states + 1, 256) int16: table[s, byte] is the next state, or num_states, a dead state that
        every byte leads back to, where `transitions` has no entry. num_states < 2**15 (MAX_STATES)."""
        dead = self.num_states
        table = np.full((dead + 1, 256), dead, dtype=np.int16)
        for state, row in enumerate(self.transitions):
            if row:
                table[state, np.fromiter(row, np.int64, len(row))] = np.fromiter(row.values(), np.int16, len(row))
        return table

    def walk(self, state: int, data: bytes) -> int | None:
        """The state after reading `data` from `state`, or None if the match dies on the way."""
        for byte in data:
            state = self.transitions[state].get(byte)
            if state is None:
                return None
        return state


# The parse tree: ("set", bytes) | ("seq", [nodes]) | ("alt", [nodes]) | ("rep", node, lo, hi or None)


class _Parser:
    def __init__(self, pattern: str | bytes):
        self.is_bytes = isinstance(pattern, bytes)
        self.chars = [chr(b) for b in pattern] if self.is_bytes else list(pattern)
        self.pos = 0

    def error(self, what: str) -> ValueError:
        return ValueError(
            f"regex: {what} at position {self.pos}; supported: literals, ., [classes], (groups), |, *, +, ?, {{n,m}}"
        )

    def peek(self) -> str | None:
        return self.chars[self.pos] if self.pos < len(self.chars) else None

    def take(self) -> str:
        c = self.peek()
        if c is None:
            raise self.error("unexpected end of pattern")
        self.pos += 1
        return c

    def parse(self):
        node = self.alternation()
        if self.peek() is not None:
            raise self.error(f"unbalanced {self.peek()!r}")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat(self.atom()))
        return ("seq", items)

    def repeat(self, node):
        while self.peek() in ("*", "+", "?", "{"):
            c = self.take()
            if c == "{":
                lo, hi = self.braces()
            else:
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() in ("?", "+"):
                raise self.error("lazy or possessive quantifiers are not supported")
            node = ("rep", node, lo, hi)
        return node

    def braces(self) -> tuple[int, int | None]:
        text = ""
        while self.peek() != "}":
            text += self.take()
        self.take()
        lo, _, hi = text.partition(",")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise self.error(f"bad repetition {{{text}}}")
        lo_n = int(lo)
        hi_n = lo_n if "," not in text else (int(hi) if hi else None)
        if hi_n is not None and hi_n < lo_n:
            raise self.error(f"bad repetition {{{text}}}")
        return lo_n, hi_n

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                self.take()
                if self.take() != ":":
                    raise self.error("lookaround and named groups are not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing )")
            self.take()
            return node
        if c == "[":
            return self.char_class()
        if c == ".":
            return self.charset(self.full - {ord("\n")}, multibyte=True)
        if c in "*+?{":
            raise self.error(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.error("anchors are not supported (the pattern always matches the whole output)")
        item = self.escape() if c == "\\" else c
        return self.charset(item[1], item[2]) if isinstance(item, tuple) else self.literal(item)

    @property
    def full(self) -> frozenset:
        """What one byte-wide character can be: any byte, or for a str pattern any ASCII character."""
        return ANY if self.is_bytes else frozenset(range(128))

    def escape(self) -> str | tuple:
        """After a backslash: one character, or ("class", single-byte members, takes multi-byte characters)."""
        c = self.take()
        if c.lower() in CLASSES:
            members = CLASSES[c.lower()]
            return ("class", members, False) if c.islower() else ("class", self.full - members, True)
        if c in CONTROL:
            return CONTROL[c]
        if c == "x":
            return chr(int(self.take() + self.take(), 16))
        if c.isalnum():
            raise self.error(f"escape \\{c} is not supported")
        return c

    def literal(self, c: str):
        if self.is_bytes or ord(c) < 128:
            return ("set", frozenset([ord(c)]))
        return ("seq", [("set", frozenset([b])) for b in c.encode()])

    def charset(self, members, multibyte: bool):
        """Single-byte members; with `multibyte` (str patterns only), every multi-byte UTF-8 character too."""
        node = ("set", frozenset(members))
        if multibyte and not self.is_bytes:
            return ("alt", [node] + [("seq", [("set", s) for s in seq]) for seq in MULTIBYTE])
        return node

    def char_class(self):
        negate = self.peek() == "^"
        if negate:
            self.take()
        members: set[int] = set()
        wide: list[str] = []  # non-ASCII characters of a str pattern
        multibyte = False  # a \D, \W or \S inside took every multi-byte character
        first = True
        while self.peek() != "]" or first:
            first = False
            item = self.escape() if self.take() == "\\" else self.chars[self.pos - 1]
            if isinstance(item, tuple):
                members |= item[1]
                multibyte |= item[2]
                continue
            chars = [item]
            if self.peek() == "-" and self.pos + 1 < len(self.chars) and self.chars[self.pos + 1] != "]":
                self.take()
                end = self.escape() if self.take() == "\\" else self.chars[self.pos - 1]
                if isinstance(end, tuple) or ord(end) < ord(item):
                    raise self.error("bad range in a class")
                chars = [chr(o) for o in range(ord(item), ord(end) + 1)]
            for ch in chars:
                if self.is_bytes or ord(ch) < 128:
                    members.add(ord(ch))
                else:
                    wide.append(ch)
        self.take()
        if negate:
            if wide:
                raise self.error("a negated class with non-ASCII characters is not supported")
            return self.charset(self.full - members, not multibyte)
        if multibyte:
            return self.charset(members, True)
        if len(wide) > 256:
            raise self.error("a class with more than 256 non-ASCII characters is not supported")
        node = ("set", frozenset(members))
        return ("alt", [node] + [self.literal(w) for w in dict.fromkeys(wide)]) if wide else node


class _NFA:
    def __init__(self, deadline: float = float("inf")):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[frozenset, int]]] = []
        self.deadline = deadline  # time.thread_time() past which compiling is refused

    def check_budget(self, what: str) -> None:
        if time.thread_time() > self.deadline:
            raise ValueError(
                f"regex: compiling the pattern passes its budget of {COMPILE_BUDGET_S} s of CPU ({what}); "
                "simplify the pattern"
            )

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise ValueError(
                f"regex: the pattern unrolls past the limit of {MAX_NFA_STATES} NFA states; simplify its repeats"
            )
        if len(self.eps) % 1024 == 0:
            self.check_budget(f"{len(self.eps)} NFA states so far")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        """Thompson's construction: (start, end) states of the fragment matching `node`."""
        kind = node[0]
        start, end = self.state(), self.state()
        if kind == "set":
            self.edges[start].append((node[1], end))
        elif kind == "seq":
            cur = start
            for child in node[1]:
                s, e = self.build(child)
                self.eps[cur].append(s)
                cur = e
            self.eps[cur].append(end)
        elif kind == "alt":
            for child in node[1]:
                s, e = self.build(child)
                self.eps[start].append(s)
                self.eps[e].append(end)
        else:  # rep
            _, child, lo, hi = node
            cur = start
            for _ in range(lo):
                s, e = self.build(child)
                self.eps[cur].append(s)
                cur = e
            if hi is None:
                s, e = self.build(child)
                self.eps[cur] += [s, end]
                self.eps[e] += [s, end]
            else:
                for _ in range(hi - lo):
                    s, e = self.build(child)
                    self.eps[cur] += [s, end]
                    cur = e
            self.eps[cur].append(end)
        return start, end

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)


# Budgets that refuse a pattern within about a second of CPU, before it costs minutes or gigabytes. The
# NFA bound catches nested repeats ((a{100}){100}) that Thompson's construction would unroll into millions
# of states; the DFA bound, an automaton whose rows would be too many to ever reach; the CPU budget,
# anything else slow to determinize (counted per thread, so other requests' work does not count).
MAX_NFA_STATES = 200_000
MAX_STATES = 4096
COMPILE_BUDGET_S = 1.0


def compile_regex(pattern: str | bytes) -> DFA:
    """The DFA of `pattern` over bytes (fullmatch semantics). Raises ValueError for what it does not support."""
    parser = _Parser(pattern)
    tree = parser.parse()
    nfa = _NFA(deadline=time.thread_time() + COMPILE_BUDGET_S)
    start, end = nfa.build(tree)
    class_of, classes = byte_classes(edge for out in nfa.edges for edge, _ in out)
    edges = [[(classes[allowed], target) for allowed, target in out] for out in nfa.edges]
    # One NFA state's closure, kept to the states that read a byte (and `end`, which accepts): the others
    # only lead on by epsilon, so leaving them out changes no transition and makes the sets several times smaller.
    closures: dict[int, frozenset] = {}

    def closure(states) -> frozenset:
        for s in states:
            if s not in closures:
                closures[s] = frozenset(x for x in nfa.closure([s]) if edges[x] or x == end)
        return frozenset().union(*(closures[s] for s in states))

    first = closure([start])
    ids = {first: 0}
    sets, rows = [first], []  # rows[d]: {class: next DFA state}
    while len(rows) < len(sets):
        current = sets[len(rows)]
        nfa.check_budget(f"{len(sets)} DFA states so far")
        by_class: dict[int, set[int]] = {}
        for s in current:
            for members, target in edges[s]:
                for c in members:
                    by_class.setdefault(c, set()).add(target)
        row, cache = {}, {}
        for c, targets in by_class.items():
            key = frozenset(targets)
            if key not in cache:
                closed = closure(targets)
                if closed not in ids:
                    ids[closed] = len(sets)
                    sets.append(closed)
                    if len(sets) > MAX_STATES:
                        raise ValueError(
                            f"regex: the automaton passes the limit of {MAX_STATES} states; simplify the pattern"
                        )
                cache[key] = ids[closed]
            row[c] = cache[key]
        rows.append(row)
    accepting = {i for i, s in enumerate(sets) if end in s}
    keep = _alive(rows, accepting)
    if 0 not in keep:
        raise ValueError("regex: the pattern matches nothing")
    new = {old: i for i, old in enumerate(keep)}  # state 0 (initial) stays first
    rows = [{c: new[t] for c, t in rows[old].items() if t in new} for old in keep]
    members = [tuple(np.flatnonzero(class_of == c).tolist()) for c in range(int(class_of.max()) + 1)]
    transitions = []
    for row in rows:
        transitions.append(full := {})
        for c, t in row.items():
            full.update(dict.fromkeys(members[c], t))
    dead = len(rows)
    by_class = np.full((dead + 1, len(members)), dead, dtype=np.int16)
    cells = [(state, c, t) for state, row in enumerate(rows) for c, t in row.items()]
    if cells:
        by_class[tuple(np.array(cells).T[:2])] = np.array(cells)[:, 2]
    dfa = DFA(transitions, {new[s] for s in accepting if s in new})
    dfa.table = np.ascontiguousarray(
        by_class[:, class_of]
    )  # C order: a row per state; built here, where compiling runs (the server's worker process)
    return dfa


def byte_classes(edge_sets) -> tuple[np.ndarray, dict[frozenset, list[int]]]:
    """Bytes that no edge set of an NFA tells apart form a class: `[ -~]*a` has three (`a`, the other
    printable bytes, the rest), and the subset construction does its work once per class instead of once
    per byte. Returns class_of (256,) int64, each byte's class, and each distinct edge set's classes."""
    distinct = list(dict.fromkeys(edge_sets))
    signatures = [tuple(b in e for e in distinct) for b in range(256)]
    number = {sig: i for i, sig in enumerate(dict.fromkeys(signatures))}
    class_of = np.array([number[sig] for sig in signatures], dtype=np.int64)
    return class_of, {e: sorted({int(class_of[b]) for b in e}) for e in distinct}


def _alive(rows: list[dict], accepting: set[int]) -> list[int]:
    """The states from which an accepting state can be reached, in order: a live state is never a dead end."""
    reverse: list[set[int]] = [set() for _ in rows]
    for state, row in enumerate(rows):
        for target in row.values():
            reverse[target].add(state)
    alive, todo = set(accepting), list(accepting)
    while todo:
        for prev in reverse[todo.pop()]:
            if prev not in alive:
                alive.add(prev)
                todo.append(prev)
    return sorted(alive)
