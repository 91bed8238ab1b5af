"""§1–§4 of lab2.ipynb: token bytes, the token index, the batched logit mask, JSON Schema to regex.

References: GPT-2's byte table from transformers and the tokenizer's own encode; a brute-force walk of
every token's bytes through the (given) byte DFA, written here; JSON texts built here and checked with
the `jsonschema` package. Never the solution.
"""

import json
import random

import pytest
import torch

from labkit import TARGET
from labkit.checkpoint import load_tokenizer
from labkit.impl import load

compile_regex = load("stage04_batching.byte_dfa").compile_regex


def brute_force(dfa, vocab, eos):
    """allowed (S, V) bool and next_state (S, V) int64 (-1: not allowed), one token and one byte at a time."""
    S, V = dfa.num_states, len(vocab)
    allowed = torch.zeros(S, V, dtype=torch.bool)
    nxt = torch.full((S, V), -1, dtype=torch.int64)
    for s in range(S):
        for t, data in enumerate(vocab):
            if t == eos:
                if s in dfa.accepting:
                    allowed[s, t], nxt[s, t] = True, s
                continue
            if not data:
                continue
            state = s
            for byte in data:
                state = dfa.transitions[state].get(byte)
                if state is None:
                    break
            if state is not None:
                allowed[s, t], nxt[s, t] = True, state
    return allowed, nxt


def random_pattern(rng: random.Random) -> str:
    """A JSON-like pattern whose keys, lengths and value kinds vary with the seed."""
    keys = ["".join(rng.choice("abcdxyz_") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
    values = [
        f'"[a-z é]{{{rng.randint(0, 2)},{rng.randint(3, 6)}}}"',
        "-?(0|[1-9][0-9]{0,3})",
        "(true|false|null)",
        r"\[([0-9](, ?[0-9]){0,2})?\]",
    ]
    members = [f'"{k}": ?{rng.choice(values)}' for k in keys]
    return r"\{ ?" + ", ?".join(members) + r" ?\}"


def random_vocab(rng: random.Random, size: int) -> tuple[list, int]:
    """Byte strings made of JSON pieces, letters, digits and halves of 'é' (b'\\xc3', b'\\xa9'); some ids
    are special (None) or empty. Returns (vocab, eos id)."""
    pieces = [b'{"', b'"', b'":', b'": ', b'",', b'", "', b'"}', b"}", b"{", b",", b" ", b":", b"[", b"]", b"\xc3"]
    pieces += [b"\xa9", b"\xc3\xa9", b"true", b"fal", b"se", b"null", b"-", b"0"] + [bytes([c]) for c in b"abcdxyz_19"]
    vocab = []
    for _ in range(size):
        vocab.append(b"".join(rng.choice(pieces) for _ in range(rng.choice([1, 1, 2, 3]))))
    for i in rng.sample(range(size), 4):
        vocab[i] = rng.choice([None, b""])
    eos = rng.randrange(size)
    vocab[eos] = None
    return vocab, eos


def gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable bytes stand for themselves, the other 68 for
    chr(256 + k), k counting them in byte order (as in GPT-2's encoder.py; importing transformers for it costs
    more than this section's tests)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


@pytest.mark.parametrize("vocab_size", [800, 854, 2048])
def test_token_bytes_invert_byte_level_bpe(impl, vocab_size):
    tok = load_tokenizer(TARGET)
    table = impl("stage04_batching.structured").token_bytes(tok, vocab_size)
    assert len(table) == vocab_size, f"one entry per model token id (vocab_size={vocab_size})"
    byte_of = gpt2_byte_table()
    special = set(tok.get_added_tokens_decoder())
    for text, i in tok.get_vocab().items():
        if i >= vocab_size:
            continue  # a tokenizer entry the model cannot emit
        want = None if i in special else bytes(byte_of[c] for c in text)
        assert table[i] == want, f"token {i} ({text!r}): got {table[i]!r}, want {want!r}"
    assert all(t is None for t in table[tok.get_vocab_size() :]), "ids past the tokenizer's vocabulary have no bytes"
    text = 'She said: "{\\"é\\": 1}" — ✓ ok'
    ids = tok.encode(text).ids
    assert max(ids) < 800, "this text's tokens exist at every vocab_size tested"
    assert b"".join(table[i] for i in ids) == text.encode(), "the bytes of an encoding are the text's UTF-8 bytes"


def test_token_bytes_refuses_a_tokenizer_that_is_not_byte_level(impl):
    """A SentencePiece-style vocabulary ('▁hello') is not written in GPT-2's byte alphabet: a ValueError
    naming the token, not a KeyError from deep inside."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({"a": 0, "Ġb": 1, "\u2581hello": 2}, unk_token="a"))
    with pytest.raises(ValueError, match="hello"):
        impl("stage04_batching.structured").token_bytes(tok, 3)


@pytest.mark.parametrize("seed", range(4))
def test_token_index_equals_brute_force_on_random_vocabularies(impl, seed):
    rng = random.Random(seed)
    pattern = random_pattern(rng)
    dfa = compile_regex(pattern)
    vocab, eos = random_vocab(rng, rng.randint(60, 140))
    index = impl("stage04_batching.structured").build_token_index(dfa, vocab, eos)
    allowed, nxt = brute_force(dfa, vocab, eos)
    assert index.allowed.dtype == torch.bool and index.allowed.shape == allowed.shape, f"seed={seed}: (S, V) bool"
    bad = (index.allowed != allowed).nonzero()
    assert len(bad) == 0, (
        f"seed={seed} pattern={pattern!r}: {len(bad)} wrong mask entries, first (state, token)={bad[0].tolist()} "
        f"token bytes={vocab[int(bad[0][1])]!r}, want {bool(allowed[tuple(bad[0])])}"
    )
    assert torch.equal(index.next_state[allowed], nxt[allowed]), f"seed={seed} pattern={pattern!r}: next states"
    assert torch.equal(index.next_state, nxt), f"seed={seed} pattern={pattern!r}: next_state is -1 where not allowed"
    assert index.initial == dfa.initial, f"seed={seed}"


@pytest.mark.parametrize("seed", [0, 1])
def test_token_index_equals_brute_force_on_the_tiny_target_vocabulary(impl, seed):
    rng = random.Random(seed)
    structured = impl("stage04_batching.structured")
    tok = load_tokenizer(TARGET)
    byte_of = gpt2_byte_table()
    special = set(tok.get_added_tokens_decoder())
    vocab = [None] * 2048  # the model's vocabulary is larger than the tokenizer's
    for text, i in tok.get_vocab().items():
        vocab[i] = None if i in special else bytes(byte_of[c] for c in text)
    pattern = random_pattern(rng)
    dfa = compile_regex(pattern)
    index = structured.build_token_index(dfa, vocab, 2)
    allowed, nxt = brute_force(dfa, vocab, 2)
    bad = (index.allowed != allowed).nonzero()
    assert len(bad) == 0, f"seed={seed} pattern={pattern!r}: wrong mask at (state, token) {bad[0].tolist()}"
    assert torch.equal(index.next_state[allowed], nxt[allowed]), f"seed={seed} pattern={pattern!r}: next states"


def test_tokens_that_cross_literal_boundaries(impl):
    """A token may end one literal and start the next (`":"` closes a key, passes the colon, opens a
    string); another may stop in the middle of a UTF-8 character. Both must be allowed and land right."""
    structured = impl("stage04_batching.structured")
    pattern = '\\{"name":"[a-zé]{1,4}","n":[0-9]\\}'
    dfa = compile_regex(pattern)
    vocab = [None, b'{"', b"name", b'":"', b"ab", b"\xc3", b"\xa9", b'","', b'n":', b"7}", b"n", b'"', b"x", b"{"]
    eos = 0
    index = structured.build_token_index(dfa, vocab, eos)
    guide = structured.Guide(index)
    text = b""
    for t in [1, 2, 3, 4, 5, 6, 7, 8, 9]:  # {" name ":" ab \xc3 \xa9 "," n": 7}
        assert guide.allowed()[t], f"token {vocab[t]!r} must be allowed after {text!r}"
        guide.advance(t)
        text += vocab[t]
        assert guide.state == dfa.walk(dfa.initial, text), f"state after {text!r}"
    assert guide.state in dfa.accepting and guide.allowed()[eos], "EOS is allowed once the pattern is complete"
    assert guide.is_finished, "only EOS may follow a complete match"
    allowed, _ = brute_force(dfa, vocab, eos)
    assert torch.equal(index.allowed, allowed), "every state's mask equals the brute-force walk"


def random_index(structured, rng: random.Random, V: int):
    """A TokenIndex built here by brute force (independent of build_token_index)."""
    vocab, eos = random_vocab(rng, V)
    dfa = compile_regex(random_pattern(rng))
    allowed, nxt = brute_force(dfa, vocab, eos)
    return structured.TokenIndex.from_table(allowed, nxt, dfa.initial, eos)


@pytest.mark.parametrize("seed", range(3))
def test_mask_logits_batches_rows_with_different_constraints(impl, seed):
    structured = impl("stage04_batching.structured")
    rng = random.Random(seed)
    V = rng.randint(50, 120)
    indexes = [random_index(structured, rng, V) for _ in range(2)]
    B = rng.randint(3, 7)
    guides = []
    for b in range(B):
        if b == 0 or rng.random() < 0.3:
            guides.append(None)
            continue
        guide = structured.Guide(rng.choice(indexes))
        guide.state = rng.randrange(guide.index.allowed.shape[0])
        guides.append(guide)
    guides[-1] = guides[-1] or structured.Guide(indexes[0])
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed))
    before = logits.clone()
    got = structured.mask_logits(logits, guides)
    assert torch.equal(logits, before), f"seed={seed}: mask_logits must not change its input"
    for b, guide in enumerate(guides):
        want = logits[b] if guide is None else logits[b].masked_fill(~guide.index.allowed[guide.state], float("-inf"))
        assert torch.equal(got[b], want), (
            f"seed={seed} row {b} ({'unconstrained' if guide is None else f'state {guide.state}'}): "
            "allowed tokens keep their logits exactly, the others get -inf"
        )


# JSON Schema -> regex


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 5)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 'say "hi"', "ü", 3, 2.5, True, None], rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 2)
        items = {"type": rng.choice(["integer", "boolean"])}
        return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "ok", "score", "x_1"], rng.randint(1, 3))
        props = {n: random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names)))}
    return {"type": kind}


def random_instance(rng: random.Random, schema: dict):
    """A value valid against `schema` with every property present (the regex emits them all, in order)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        n = rng.randint(schema["minLength"], schema["maxLength"])
        return "".join(rng.choice('ab Z"\\/\n\té✓') for _ in range(n))
    if kind == "integer":
        return rng.choice([0, -7, 12345, -(10**15), 10**15])
    if kind == "number":
        return rng.choice([0.5, -3.25, 1e-7, 6.02e23, 42, -0.0])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        n = rng.randint(schema["minItems"], schema["maxItems"])
        return [random_instance(rng, schema["items"]) for _ in range(n)]
    return {k: random_instance(rng, v) for k, v in schema["properties"].items()}


def random_match(dfa, rng: random.Random) -> bytes:
    """A random byte string the DFA accepts (a random walk; the DFA has no dead-end states)."""
    state, out = dfa.initial, bytearray()
    while True:
        row = dfa.transitions[state]
        if state in dfa.accepting and (not row or rng.random() < 0.3):
            return bytes(out)
        byte = rng.choice(sorted(row))
        out.append(byte)
        state = row[byte]


def assert_matches_validate(dfa, schema: dict, rng: random.Random, n: int, where: str) -> None:
    """n random strings the DFA accepts all parse as JSON that jsonschema accepts."""
    import jsonschema  # here, not at the top: its format checkers take a second to import, §1's check needs none

    for i in range(n):
        data = random_match(dfa, rng)
        try:
            jsonschema.validate(json.loads(data), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{where} sample {i}: {data!r} matches the regex but {e}") from None


@pytest.mark.parametrize("seed", range(6))
def test_schema_regex_accepts_valid_json_and_only_valid_json(impl, seed):
    rng = random.Random(seed)
    schema = random_schema(rng) if seed % 2 else {"type": "object", **random_schema(random.Random(seed), 1)}
    if "properties" not in schema:
        schema = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    pattern = impl("stage04_batching.structured").schema_to_regex(schema)
    dfa = compile_regex(pattern)
    for i in range(20):
        value = random_instance(rng, schema)
        for text in (json.dumps(value), json.dumps(value, separators=(",", ":"))):
            state = dfa.walk(dfa.initial, text.encode())
            assert state in dfa.accepting, f"seed={seed} sample {i}: valid JSON {text!r} rejected by {pattern!r}"
    assert_matches_validate(dfa, schema, rng, 100, f"seed={seed}")


@pytest.mark.parametrize("seed", range(4))
def test_schema_regex_rejects_values_outside_the_schema(impl, seed):
    """Each bound the schema sets (lengths, item counts, enum members, types, required keys) excludes the
    JSON one step past it."""
    rng = random.Random(seed)
    lo_s, lo_a = rng.randint(1, 3), rng.randint(1, 2)
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "minLength": lo_s, "maxLength": lo_s + rng.randint(0, 3)},
            "a": {
                "type": "array",
                "items": {"type": "integer"},
                "minItems": lo_a,
                "maxItems": lo_a + rng.randint(0, 2),
            },
            "e": {"enum": rng.sample(["red", "green", "blue", 7, 2.5], 3)},
            "i": {"type": "integer"},
            "b": {"type": "boolean"},
        },
        "required": ["s", "a", "e", "i", "b"],
    }
    dfa = compile_regex(impl("stage04_batching.structured").schema_to_regex(schema))
    props = schema["properties"]
    valid = {"s": "x" * lo_s, "a": [1] * lo_a, "e": props["e"]["enum"][0], "i": -12, "b": False}
    wrong = {
        "s too short": {"s": "x" * (lo_s - 1)},
        "s too long": {"s": "x" * (props["s"]["maxLength"] + 1)},
        "a too short": {"a": [1] * (lo_a - 1)},
        "a too long": {"a": [1] * (props["a"]["maxItems"] + 1)},
        "a of strings": {"a": ["1"] * lo_a},
        "e not a member": {"e": next(v for v in ["red", "green", "blue", 7, 2.5] if v not in props["e"]["enum"])},
        "i a float": {"i": 1.5},
        "b a string": {"b": "false"},
    }
    assert dfa.walk(dfa.initial, json.dumps(valid).encode()) in dfa.accepting, f"seed={seed}: {json.dumps(valid)}"
    for what, change in wrong.items():
        text = json.dumps({**valid, **change})
        assert dfa.walk(dfa.initial, text.encode()) not in dfa.accepting, f"seed={seed}: {what} accepted: {text}"
    missing = json.dumps({k: v for k, v in valid.items() if k != "i"})
    assert dfa.walk(dfa.initial, missing.encode()) not in dfa.accepting, f"seed={seed}: a required key is missing"


def accepts(dfa, text: str) -> bool:
    return dfa.walk(dfa.initial, text.encode()) in dfa.accepting


SCHEMA_CASES = {
    "const": ({"const": "a.b+"}, ['"a.b+"'], ['"aXbb"', '"a.b"', "1"]),
    "const-object": ({"const": {"k": [1, "x"]}}, ['{"k": [1, "x"]}'], ['{"k": [1]}', '{"k": 1}']),
    "names-with-metacharacters": (
        {"type": "object", "properties": {"a.b": {"type": "integer"}, "c+": {"type": "boolean"}}, "required": ["a.b"]},
        ['{"a.b": 1, "c+": true}', '{"a.b":-3,"c+":false}'],
        ['{"aXb": 1, "c+": true}', '{"a.b": 1, "cc": true}'],
    ),
    "max-items-0": ({"type": "array", "items": {"type": "integer"}, "maxItems": 0}, ["[]"], ["[1]", "[1, 2]"]),
    "no-type": (
        {"description": "anything"},
        ["1", "-2.5", '"s"', "null", "true", "[1, 2]", '{"a": [1]}', "[]"],
        ["{", "tru", '"'],
    ),
    "object-without-properties": ({"type": "object"}, ["{}", '{"a": 1}', '{"a": {"b": true}}'], ["1", '"s"', "[]"]),
}


@pytest.mark.parametrize("case", list(SCHEMA_CASES))
def test_schema_regex_const_escaping_empty_arrays_and_untyped_schemas(impl, case):
    """Literals are escaped (a '.' or '+' in a const or a key is that character), maxItems 0 allows only [],
    no type means any JSON value and an object without properties any object; jsonschema agrees on every text."""
    import jsonschema

    schema, good, bad = SCHEMA_CASES[case]
    for text in good:
        jsonschema.validate(json.loads(text), schema)  # the case itself is right
    dfa = compile_regex(impl("stage04_batching.structured").schema_to_regex(schema))
    for text in good:
        assert accepts(dfa, text), f"{case}: {text} is valid against {schema} but rejected"
    for text in bad:
        assert not accepts(dfa, text), f"{case}: {text} is not valid against {schema} but accepted"
    assert_matches_validate(dfa, schema, random.Random(0), 50, case)


def test_a_required_key_without_a_property_is_never_silently_dropped(impl):
    """`required` names a key the properties do not define: no emitted object can hold it, so the regex must
    match nothing jsonschema rejects; refusing the schema (UnsupportedSchema) is the honest answer."""
    structured = impl("stage04_batching.structured")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]}
    try:
        pattern = structured.schema_to_regex(schema)
    except structured.UnsupportedSchema:
        return
    try:
        dfa = compile_regex(pattern)
    except ValueError:
        return  # a regex that matches nothing at all
    assert_matches_validate(dfa, schema, random.Random(0), 20, "required key without a property:")


@pytest.mark.parametrize(
    "schema, feature",
    [
        ({"type": "string", "pattern": "^a+$"}, "pattern"),
        ({"type": "integer", "minimum": 3}, "minimum"),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "anyOf"),
        ({"type": "object", "properties": {"a": {"$ref": "#/defs/a"}}}, "$ref"),
        ({"type": ["string", "null"]}, "type"),
        ({"type": "string", "format": "date-time"}, "format"),
    ],
    ids=["pattern", "minimum", "anyOf", "ref", "type-list", "format"],
)
def test_unsupported_schema_features_are_refused_by_name(impl, schema, feature):
    structured = impl("stage04_batching.structured")
    with pytest.raises(structured.UnsupportedSchema) as info:
        structured.schema_to_regex(schema)
    assert feature in str(info.value), f"the error names the feature {feature!r}: {info.value}"
