"""Structured output at its edges: accepting states a match may still continue from (after `[0-9]+`, or two
repetitions of `x{2,3}`), and JSON Schema arrays and strings with an open upper bound.

References: Python's `re.fullmatch` over every short completion (which texts can still become a match), a
brute-force walk of each token's bytes through the (given) byte DFA, and the `jsonschema` package on JSON
texts built here. Never the solution.
"""

import functools
import itertools
import json
import random
import re

import jsonschema
import pytest
import torch

EOS = 0
# Tokens of one or several characters, so a token may finish a repetition and start the next one.
VOCAB = [None, b"1", b"23", b"7", b"x", b"xx", b"xxx", b"a", b"b", b"ab", b"ba", b".", b"5.", b"q", b""]
# Patterns whose accepting states can continue (EOS and more text both allowed there). After "q", q(23)* goes on
# only through "23": no single-byte token reads its next byte, so whether the output is finished takes the row.
PATTERNS = [r"[0-9]+", r"x{2,3}", r"(ab)+", r"[0-9]{1,2}(\.[0-9]+)?", r"(xx|ab){1,3}b?", r"q(23)*"]


@functools.cache
def can_continue_to_a_match(pattern: str, text: str, alphabet: str, depth: int = 2) -> bool:
    """Whether some completion of at most `depth` characters from `alphabet` makes `text` a full match."""
    return any(
        re.fullmatch(pattern, text + "".join(c))
        for n in range(depth + 1)
        for c in itertools.product(alphabet, repeat=n)
    )


def brute_force(dfa, vocab, eos):
    """allowed (S, V): each token's bytes walked one at a time through the DFA; EOS exactly where it accepts."""
    allowed = torch.zeros(dfa.num_states, len(vocab), dtype=torch.bool)
    for s in range(dfa.num_states):
        for t, data in enumerate(vocab):
            if t == eos:
                allowed[s, t] = s in dfa.accepting
            elif data:
                allowed[s, t] = dfa.walk(s, data) is not None
    return allowed


@pytest.mark.parametrize("pattern", PATTERNS)
def test_an_accepting_state_allows_eos_and_whatever_continues_the_match(impl, pattern):
    structured = impl("stage04_batching.structured")
    dfa = impl("stage04_batching.byte_dfa").compile_regex(pattern)
    index = structured.build_token_index(dfa, VOCAB, EOS)
    alphabet = "".join(sorted({chr(b) for data in VOCAB if data for b in data}))
    rng = random.Random(pattern)
    for walk in range(6):
        guide, text = structured.Guide(index), ""
        for _ in range(8):
            allowed = guide.allowed()
            want = {
                t
                for t, data in enumerate(VOCAB)
                if data and can_continue_to_a_match(pattern, text + data.decode(), alphabet)
            }
            if re.fullmatch(pattern, text):
                want.add(EOS)
            got = set(allowed.nonzero().flatten().tolist())
            assert got == want, (
                f"pattern {pattern!r} after {text!r} (walk {walk}): allowed {sorted(got)}, expected {sorted(want)} "
                f"(EOS is token {EOS}; a complete match that can go on allows both)"
            )
            assert guide.is_finished == (want <= {EOS}), (
                f"pattern {pattern!r} after {text!r}: is_finished must be {want <= {EOS}} (allowed {sorted(want)})"
            )
            choices = sorted(want - {EOS})
            if not choices:
                break
            token = rng.choice(choices)
            guide.advance(token)
            text += VOCAB[token].decode()
    allowed = brute_force(dfa, VOCAB, EOS)
    assert torch.equal(index.allowed, allowed), f"pattern {pattern!r}: every state's mask equals the brute-force walk"


# JSON Schema with open upper bounds


def accepts(dfa, text: str) -> bool:
    return dfa.walk(dfa.initial, text.encode()) in dfa.accepting


def valid(value, schema) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


ARRAY_SCHEMAS = {
    "no-bounds": {"type": "array", "items": {"type": "integer"}},
    "min-only": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
    "min-1-only": {"type": "array", "items": {"type": "boolean"}, "minItems": 1},
    "max-only": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    "nested-open": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1}},
    "in-an-object": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}},
            "n": {"type": "integer"},
        },
        "required": ["tags", "n"],
    },
}


def item(schema: dict, rng: random.Random):
    kind = schema.get("type")
    if kind == "integer":
        return rng.choice([0, 7, -12, 345])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return "".join(rng.choice("ab") for _ in range(rng.randint(0, schema.get("maxLength", 3))))
    return [item(schema["items"], rng) for _ in range(rng.randint(0, 3))]


@pytest.mark.parametrize("case", list(ARRAY_SCHEMAS))
def test_arrays_without_max_items_take_any_number_of_items(impl, case):
    """maxItems is optional and most schemas (pydantic's list[int]) leave it out: then any count at or above
    minItems is valid. Arrays of 0 to 9 items are accepted exactly when jsonschema says they are valid."""
    schema = ARRAY_SCHEMAS[case]
    dfa = impl("stage04_batching.byte_dfa").compile_regex(impl("stage04_batching.structured").schema_to_regex(schema))
    inner = schema if schema["type"] == "array" else schema["properties"]["tags"]
    rng = random.Random(case)
    for n in range(10):
        values = [item(inner["items"], rng) for _ in range(n)]
        value = values if schema["type"] == "array" else {"tags": values, "n": 3}
        for text in (json.dumps(value), json.dumps(value, separators=(",", ":"))):
            assert accepts(dfa, text) == valid(value, schema), (
                f"{case}: {text} is {'valid' if valid(value, schema) else 'invalid'} against {schema} "
                f"but the regex {'rejects' if valid(value, schema) else 'accepts'} it"
            )


STRING_SCHEMAS = {
    "no-bounds": {"type": "string"},
    "min-only": {"type": "string", "minLength": 3},
    "max-only": {"type": "string", "maxLength": 4},
}


@pytest.mark.parametrize("case", list(STRING_SCHEMAS))
def test_strings_with_an_open_bound_take_any_length_within_the_other(impl, case):
    schema = STRING_SCHEMAS[case]
    dfa = impl("stage04_batching.byte_dfa").compile_regex(impl("stage04_batching.structured").schema_to_regex(schema))
    rng = random.Random(case)
    for n in range(12):
        value = "".join(rng.choice('ab \u00e9"\\') for _ in range(n))  # escapes count as one character
        assert accepts(dfa, json.dumps(value)) == valid(value, schema), (
            f"{case}: a string of {n} characters is {'valid' if valid(value, schema) else 'invalid'} against {schema}"
        )
