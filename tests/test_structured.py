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
enum_values = st.one_of(st.text(max_size=5), st.integers(-99, 99), st.booleans(), st.none(),
                        st.floats(allow_nan=False, allow_infinity=False))
leaf_schemas = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "number", "integer", "boolean", "null")] + [{}]),
    st.lists(st.text(max_size=5), min_size=1, max_size=3, unique=True).map(lambda e: {"type": "string", "enum": e}),
    st.lists(enum_values, min_size=1, max_size=3).map(lambda e: {"enum": e}),
    st.lists(st.integers(-99, 99), min_size=1, max_size=3).map(lambda e: {"type": "integer", "enum": e}),
    enum_values.map(lambda v: {"const": v, "title": "a const"}),
    st.lists(st.sampled_from(["string", "integer", "null", "boolean"]), min_size=2, max_size=2, unique=True)
    .map(lambda t: {"type": t}))


def _object_schema(children):
    return st.dictionaries(st.text(max_size=5), children, max_size=4).flatmap(
        lambda props: st.tuples(st.just(props), st.lists(st.sampled_from(sorted(props)) if props else st.nothing(),
                                                         unique=True), st.booleans() | children)).map(
        lambda t: {"type": "object", "properties": t[0], "required": t[1], "additionalProperties": t[2]})


def _nested(leaves, max_leaves):
    return st.recursive(leaves, lambda inner: _object_schema(inner) | inner.map(
        lambda i: {"type": "array", "items": i}) | st.lists(inner, min_size=1, max_size=3).map(
        lambda alts: {"anyOf": alts, "description": "one of"}), max_leaves=max_leaves)


@st.composite
def schemas(draw):
    """An object schema of the keywords the reader follows, in any nesting, with a definition ``D`` that its
    parts may point to (``$ref``)."""
    definition = draw(_nested(leaf_schemas, 4))
    schema = draw(_object_schema(_nested(leaf_schemas | st.just({"$ref": "#/$defs/D"}), 6)))
    return {**schema, "$defs": {"D": definition}}


@st.composite
def instance(draw, schema, root):
    """A value ``schema`` (a part of ``root``) takes (drawn)."""
    if "$ref" in schema:
        return draw(instance(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root))
    if "anyOf" in schema:
        return draw(instance(draw(st.sampled_from(schema["anyOf"])), root))
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types or ["string", "integer", "boolean", "null", "number"]
    t = draw(st.sampled_from(types))
    if t == "object":
        props = schema.get("properties", {})
        names = set(schema.get("required", [])) | set(draw(st.lists(st.sampled_from(sorted(props)), unique=True))
                                                       if props else [])
        out = {k: draw(instance(props[k], root)) for k in names}
        extra = schema.get("additionalProperties", True)
        if extra is not False and "extra" not in out and draw(st.booleans()):
            out["extra"] = draw(instance(extra if isinstance(extra, dict) else {}, root))
        return out
    if t == "array":
        return draw(st.lists(instance(schema.get("items", {}), root), max_size=3))
    return draw({"string": st.text(max_size=5), "integer": st.integers(-999, 999), "boolean": st.booleans(),
                 "null": st.none(), "number": st.floats(allow_nan=False, allow_infinity=False)}[t])


def schema_valid(doc, schema) -> bool:
    """``jsonschema``'s verdict, where an integer is a JSON number written without a fraction (an int here) and
    enum and const values are compared as their JSON text (as the reader matches them: 1.0 is not 1)."""
    import jsonschema
    from jsonschema.exceptions import ValidationError

    def same_text(validator, allowed, value, _schema):
        if json.dumps(value) not in {json.dumps(a) for a in allowed}:
            yield ValidationError(f"{value!r} is none of {allowed!r}")

    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    validator = jsonschema.validators.extend(
        jsonschema.Draft202012Validator, type_checker=checker,
        validators={"enum": same_text, "const": lambda v, c, i, s: same_text(v, [c], i, s)})
    return validator(schema).is_valid(doc)


@settings(max_examples=500, deadline=None)
@given(st.data(), schemas(), st.sampled_from(["keep", "drop", "add", "swap"]))
def test_the_schema_reader_agrees_with_jsonschema(data, schema, edit):
    """Documents drawn from a schema (types, enums and consts of any JSON scalar, anyOf, $ref, additional
    properties of a schema, in any nesting), then edited (a property dropped, one added, one's value swapped for
    another), written as ``json.dumps`` writes them: the reader takes every prefix of a document the schema
    takes, whole exactly at its end, and refuses, at some byte, one it does not."""
    from kvcompile.structured import SchemaError, SchemaPrefix, check_schema

    try:
        check_schema(schema)
    except SchemaError as e:  # a part whose enum, const and type leave no value: no document follows it
        assert "no value follows it" in str(e)
        return
    doc = data.draw(instance(schema, schema))
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
    ({"$defs": {"L": {"type": "array"}}, "$ref": "#/$defs/L"}, "top level must be"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "'pattern' is not followed"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "date-time"}}}, "'format' is not followed"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}, "'oneOf' is not followed"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, "anyOf must be a non-empty list"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}], "type": "null"}}},
     "anyOf stands beside 'type'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}, "'#/$defs/B' names no schema"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x.org/s.json"}}}, "must point into this schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A", "type": "string"}}, "$defs": {"A": {}}},
     "$ref stands beside 'type'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}},
     "leads back to itself"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}]}}},
     "leads back to itself"),
    ({"type": "object", "properties": {"a": {"type": "object", "$defs": {}}}}, "at the top level"),
    ({"type": "object", "required": ["b"]}, "required must list"),
    ({"type": "object", "additionalProperties": 3}, "additionalProperties must be"),
    ({"type": "object", "properties": {"a": {"enum": [{"b": 1}]}}}, "enum and const values must be"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "enum must be a non-empty list"),
    ({"type": "object", "properties": {"a": {"type": "integer", "enum": ["x", 1.5]}}}, "no value follows it"),
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


LITERALS = {"type": "object", "properties": {"n": {"enum": [12, 1.5, -3, True, None, "x"]}, "c": {"const": 7},
                                             "o": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}


@pytest.mark.parametrize("text, refused_at", [
    ('{"n":12,"c":7,"o":null}', None),
    ('{"n":1.5}', None), ('{"n":-3}', None), ('{"n":true}', None), ('{"n":null}', None), ('{"n":"x"}', None),
    ('{"n":13}', '{"n":13'),
    ('{"n":123}', '{"n":123'),  # 12 is whole: the number may not go on
    ('{"n":1}', '{"n":1}'),  # begins 12 and 1.5, is neither
    ('{"n":1.25}', '{"n":1.2'),
    ('{"n":-4}', '{"n":-4'),
    ('{"n":false}', '{"n":f'),
    ('{"n":"y"}', '{"n":"y'),
    ('{"c":7.0}', '{"c":7.'),  # the const as json.dumps writes it
    ('{"c":70}', '{"c":70'),
    ('{"o":1.5}', '{"o":1.'),
    ('{"o":"1"}', '{"o":"'),
])
def test_enum_const_and_anyof_values_are_refused_at_the_first_byte_none_continues(text, refused_at):
    from kvcompile.structured import SchemaPrefix, check_schema

    check_schema(LITERALS)
    p = SchemaPrefix(LITERALS)
    data = text.encode()
    at = next((i for i, b in enumerate(data) if not p.feed(b)), None)
    assert (None if at is None else data[:at + 1].decode()) == refused_at
    assert at is not None or p.complete


def test_overlapping_alternatives_do_not_multiply_the_readers():
    """Items that two alternatives both take (any object, or one with an "a") keep two readers, not two per
    item so far."""
    from kvcompile.structured import SchemaPrefix

    either = {"anyOf": [{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}]}
    p = SchemaPrefix({"type": "object", "properties": {"l": {"type": "array", "items": either}}})
    assert p.feed_all(b'{"l":[' + b",".join([b'{"a":1}'] * 20))
    assert len(p.branches) <= 2
    assert p.feed_all(b"]}") and p.complete


@pytest.mark.parametrize("seed", range(8))
def test_a_constrained_pick_under_a_pydantic_models_schema_parses_into_the_model(seed, pet_model):
    """The schema the openai client sends for a pydantic model (``client.chat.completions.parse``): a constrained
    walk ends in a document the model parses."""
    from openai.lib._pydantic import to_strict_json_schema

    from kvcompile.structured import check_schema

    Pet, schema = pet_model, to_strict_json_schema(pet_model)

    check_schema(schema)
    pieces = ["{", "}", "[", "]", '"', ":", ",", " ", "kind", "tag", "size", "owner", "friends", "scores", "name",
              "age", "cat", "dog", *"abcdefghijklmnopqrstuvwxyz", "1", "2", ".", "5", "-", "true", "null", '":']
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=bool(seed % 2))
    assert isinstance(Pet.model_validate_json(out), Pet)
