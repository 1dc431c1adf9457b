"""JSON mode (``kvcompile.structured``): the reader that says whether bytes begin a JSON object agrees with
Python's own JSON parser (every prefix of a document is taken, and a document is whole exactly when
``json.loads`` reads it as an object), and a constrained pick over a vocabulary always ends in a JSON object."""
from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile.structured import MAX_SPACE, JsonConstraint, JsonPrefix

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=4), max_leaves=12)
objects = st.dictionaries(st.text(max_size=6), values, max_size=5)
layouts = st.sampled_from([dict(separators=(",", ":")), dict(separators=(", ", ": ")), {}])


def read(data: bytes) -> tuple[int, bool]:
    """(bytes taken before the first refused one, whether they were all taken and make a whole object)."""
    p = JsonPrefix()
    for i, b in enumerate(data):
        if not p.feed(b):
            return i, False
    return len(data), p.complete


def python_reads_an_object(text: str) -> bool:
    """``json.loads`` reads ``text`` as an object, under the reader's two house rules: no whitespace around the
    object, at most ``MAX_SPACE`` whitespace bytes in a row (and no NaN or Infinity, which Python allows)."""
    if text != text.strip() or re.search(r"[ \t\n\r]{%d}" % (MAX_SPACE + 1), text):
        return False
    try:
        return isinstance(json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))), dict)
    except ValueError:
        return False


@settings(max_examples=300, deadline=None)
@given(objects, layouts, st.booleans())
def test_every_prefix_of_an_object_is_taken_and_only_the_whole_is_complete(obj, layout, ascii_only):
    data = json.dumps(obj, ensure_ascii=ascii_only, **layout).encode()
    p = JsonPrefix()
    for i, b in enumerate(data):
        assert not p.complete, data[:i]
        assert p.feed(b), (data[:i + 1], data)
    assert p.complete


@settings(max_examples=600, deadline=None)
@given(objects, layouts, st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["del", "ins", "sub"]),
                                           st.sampled_from(list('{}[]":,0-.eE+ \n\\tfnu1a\x01é'))), max_size=3))
def test_the_reader_agrees_with_pythons_parser(obj, layout, edits):
    """A document with random edits is whole to the reader exactly when Python reads it as an object."""
    text = json.dumps(obj, ensure_ascii=False, **layout)
    for at, how, c in edits:
        at %= len(text) + 1
        text = (text[:at] + text[at + 1:] if how == "del" else text[:at] + c + text[at:] if how == "ins"
                else text[:at] + c + text[at + 1:])
    data = text.encode()
    assert read(data)[1] == python_reads_an_object(text), text


@pytest.mark.parametrize("text", ['{"a":01}', '{"a":1,}', '{"a" 1}', "{a:1}", '{"a":tru}', '{"a":"\x01"}', "[]",
                                  " {}", "{} ", '{"a":-}', '{"a":1.}', '{"a":1e}', '{"\\x":1}', '{"a":"\\u12g4"}',
                                  '{"a":' + " " * (MAX_SPACE + 1) + "1}"])
def test_what_is_no_json_object_is_refused(text):
    assert read(text.encode()) != (len(text.encode()), True)


def vocabulary():
    pieces = ["{", "}", "[", "]", '"', ":", ",", " ", "a", "b", "1", "0", "-", ".", "e", "true", "null", '"a"',
              '{"', '":', '",', "x\n", "\\", "é"]
    return [p.encode() for p in pieces] + [None]  # a special token, never in JSON text


def walk(c: JsonConstraint, vocab: list, seed: int, sampled: bool) -> bytes:
    """A reply picked token by token under ``c`` with random scores at each step (the end token tempting, the
    closing ones a little more likely, so that the walk ends): its bytes, once the end token is picked."""
    eos = c.eos
    closers = torch.tensor([vocab.index(p) for p in (b"}", b"]", b'"')])
    g = torch.Generator().manual_seed(seed)
    out = b""
    for _ in range(400):
        scores = torch.randn(len(vocab), generator=g) * 3
        scores[eos] += 5  # the end token is tempting: it must wait for the object's end
        scores[closers] += 2  # and the random walk's depth drifts down, so that it ends
        probs = torch.softmax(scores, -1) if sampled else None
        t = c.pick(scores, probs, (lambda p: torch.multinomial(p, 1, generator=g)) if sampled else None)
        if t == eos:
            return out
        c.took(t)
        out += vocab[t]
    pytest.fail(f"no end after 400 tokens: {out!r}")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("sampled", [False, True])
def test_a_constrained_pick_ends_in_a_json_object(seed, sampled):
    """Picking every token under the constraint -- the best-scoring fitting one, or a draw restricted to fitting
    ones -- with random scores at each step gives a JSON object, then the end token, and never a token that
    does not fit (the end token included, before the object is whole)."""
    vocab = vocabulary()
    c = JsonConstraint(vocab, len(vocab) - 1)
    out = walk(c, vocab, seed, sampled)
    assert isinstance(json.loads(out), dict), out
    assert c.pick(torch.zeros(len(vocab))) == c.eos  # once whole, only the end


def test_an_end_token_whose_bytes_could_stand_in_a_string_is_never_picked_before_the_end():
    """A model whose end-of-sequence token is an ordinary token (its text "</s>" fits inside a JSON string):
    picking it would end the reply mid-object, so it does not fit until the object is whole."""
    vocab = [b"{", b"}", b'"', b":", b"a", b"</s>", b"<|end|>"]
    c = JsonConstraint(vocab, eos=5, stops=[5, 6])
    for piece in (b"{", b'"', b"a"):
        c.took(vocab.index(piece))
    scores = torch.zeros(len(vocab))
    scores[5], scores[6] = 10.0, 9.0  # the end tokens are the model's favourites
    assert c.pick(scores) not in (5, 6)
    for piece in (b'"', b":", b'"', b'"', b"}"):
        c.took(vocab.index(piece))
    assert c.pick(scores) == 5


# --------------------------------------------------------------------------- a JSON schema
leaf_schemas = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "number", "integer", "boolean", "null")] + [{}]),
    st.lists(st.text(max_size=5), min_size=1, max_size=3, unique=True).map(lambda e: {"type": "string", "enum": e}),
    st.lists(st.sampled_from(["string", "integer", "null", "boolean"]), min_size=2, max_size=2, unique=True)
    .map(lambda t: {"type": t}))


def _object_schema(children):
    return st.dictionaries(st.text(max_size=5), children, max_size=4).flatmap(
        lambda props: st.tuples(st.just(props), st.lists(st.sampled_from(sorted(props)) if props else st.nothing(),
                                                         unique=True), st.booleans())).map(
        lambda t: {"type": "object", "properties": t[0], "required": t[1], "additionalProperties": t[2]})


schemas = _object_schema(st.recursive(leaf_schemas, lambda inner: _object_schema(inner) | inner.map(
    lambda i: {"type": "array", "items": i}), max_leaves=6))


@st.composite
def instance(draw, schema):
    """A value ``schema`` takes (drawn)."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types or ["string", "integer", "boolean", "null", "number"]
    t = draw(st.sampled_from(types))
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if t == "object":
        props = schema.get("properties", {})
        names = set(schema.get("required", [])) | set(draw(st.lists(st.sampled_from(sorted(props)), unique=True))
                                                       if props else [])
        out = {k: draw(instance(props[k])) for k in names}
        if schema.get("additionalProperties", True) is not False and draw(st.booleans()):
            out.setdefault("extra", 1)
        return out
    if t == "array":
        return draw(st.lists(instance(schema.get("items", {})), max_size=3))
    return draw({"string": st.text(max_size=5), "integer": st.integers(-999, 999), "boolean": st.booleans(),
                 "null": st.none(), "number": st.floats(allow_nan=False, allow_infinity=False)}[t])


def schema_valid(doc, schema) -> bool:
    """``jsonschema``'s verdict (an integer being a JSON number written without a fraction: an int here)."""
    import jsonschema
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)
    return validator(schema).is_valid(doc)


@settings(max_examples=400, deadline=None)
@given(st.data(), schemas, st.sampled_from(["keep", "drop", "add", "swap"]))
def test_the_schema_reader_agrees_with_jsonschema(data, schema, edit):
    """Documents drawn from a schema, then edited (a property dropped, one added, one's value swapped for
    another), written as ``json.dumps`` writes them: the reader takes every prefix of a document the schema
    takes, whole exactly at its end, and refuses, at some byte, one it does not."""
    from kvcompile.structured import SchemaPrefix, check_schema

    check_schema(schema)
    doc = data.draw(instance(schema))
    if edit == "drop" and doc:
        doc.pop(data.draw(st.sampled_from(sorted(doc))))
    elif edit == "add":
        doc[data.draw(st.text(max_size=5))] = data.draw(scalars)
    elif edit == "swap" and doc:
        doc[data.draw(st.sampled_from(sorted(doc)))] = data.draw(scalars)
    text = json.dumps(doc, ensure_ascii=False, separators=data.draw(st.sampled_from([(",", ":"), (", ", ": ")])))
    p = SchemaPrefix(schema)
    taken = all(p.feed(b) for b in text.encode())
    assert (taken and p.complete) == schema_valid(doc, schema), (schema, text)


@pytest.mark.parametrize("schema, message", [
    ({"type": "array"}, "top level must be"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "'pattern' is not followed"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, "'anyOf'"),
    ({"type": "object", "required": ["b"]}, "required must list"),
    ({"type": "object", "additionalProperties": {"type": "string"}}, "additionalProperties must be"),
    ({"type": "object", "properties": {"a": {"enum": [1, 2]}}}, "enum must be"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "type must be one of"),
])
def test_a_schema_the_reader_does_not_follow_is_refused_with_what_it_follows(schema, message):
    from kvcompile.structured import SchemaError, check_schema
    with pytest.raises(SchemaError, match=re.escape(message)):
        check_schema(schema)


PET = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
       "properties": {"name": {"type": "string", "enum": ["cat", "dog"]}, "age": {"type": "integer"},
                      "tags": {"type": "array", "items": {"type": "string"}}, "weight": {"type": ["number", "null"]},
                      "vet": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                              "additionalProperties": False}}}


@pytest.mark.parametrize("text, refused_at", [
    ('{"name":"cat","age":3,"tags":["a"],"weight":null,"vet":{"ok":true}}', None),
    ('{"age": 12, "name": "dog"}', None),
    ('{"name":"cow","age":3}', '{"name":"co'),  # no enum value begins "co": refused there, not at the quote
    ('{"na', None),  # a prefix of a property name
    ('{"nam":1}', '{"nam"'),
    ('{"name":"cat","age":3.5}', '{"name":"cat","age":3.'),
    ('{"name":"cat"}', '{"name":"cat"}'),  # "age" is required
    ('{"name":"cat","age":3,"zz":1}', '{"name":"cat","age":3,"z'),  # no other names
    ('{"name":"cat","name":"dog","age":1}', '{"name":"cat","n'),  # "name" once
    ('{"name":"cat","age":3,"tags":[1]}', '{"name":"cat","age":3,"tags":[1'),
    ('{"name":"cat","age":3,"vet":{}}', '{"name":"cat","age":3,"vet":{}'),
    ('{"name":"cat","age":3,"vet":{"ok":true,"x":1}}', '{"name":"cat","age":3,"vet":{"ok":true,'),
    ('{"name":1}', '{"name":1'),
    ('{"name":"cat","age":3,"vet":{"ok":true,"', '{"name":"cat","age":3,"vet":{"ok":true,'),  # ok is vet's only
])
def test_the_schema_reader_refuses_at_the_first_byte_no_document_continues(text, refused_at):
    """Refused as early as the schema allows (so that a constrained pick never walks into a dead end), and only
    then."""
    from kvcompile.structured import SchemaPrefix

    p = SchemaPrefix(PET)
    data = text.encode()
    at = next((i for i, b in enumerate(data) if not p.feed(b)), None)
    assert (None if at is None else data[:at + 1].decode()) == refused_at


@pytest.mark.parametrize("seed", range(16))
def test_a_constrained_pick_under_a_schema_ends_in_a_document_it_takes(seed):
    """As above, under a schema (a pet with an enum, a required integer, optional tags): every pick keeps the
    reply a prefix of a document the schema takes, and the reply ends as one."""
    import jsonschema

    # every character the schema's names and values need is a token of its own, as every byte is in a
    # byte-level vocabulary: the reader never leads into a string the vocabulary cannot finish
    pieces = ["{", "}", "[", "]", '"', ":", ",", " ", "name", "age", "tags", "cat", "dog",
              *"abcdefghijklmnopqrstuvwxyz", "1", "2", ".", "5", "-", "true", "null", '"name"', '":', '"age":']
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=PET), vocab, seed, sampled=True)
    jsonschema.validate(json.loads(out), PET)
