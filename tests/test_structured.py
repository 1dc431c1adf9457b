"""JSON mode (``kvcompile.structured``): the reader that says whether bytes begin a JSON object agrees with
Python's own JSON parser (every prefix of a document is taken, and a document is whole exactly when
``json.loads`` reads it as an object), and a constrained pick over a vocabulary always ends in a JSON object."""
from __future__ import annotations

import json
import math
import re
from typing import Annotated

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile.structured import MAX_SPACE, DeadEnd, JsonConstraint, JsonPrefix

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


def schema_valid(doc, schema, format_checker=None) -> bool:
    """``jsonschema``'s verdict, where an integer is a JSON number written without a fraction (an int here) and
    enum and const values are compared as their JSON text (as the reader matches them: 1.0 is not 1); formats
    checked by ``format_checker`` (None: not checked)."""
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
    return validator(schema, format_checker=format_checker).is_valid(doc)


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
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {}}}}, "'contains' is not followed"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0}}},
     "multipleOf must be a positive number"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.25, "minimum": 0.3, "maximum": 0.45}}},
     "no value follows it"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 5, "minimum": 1, "maximum": 4.5}}},
     "no value follows it"),  # a number under multipleOf is an integer: 2.5 is not one
    ({"type": "object", "properties": {"a": {"type": "array", "prefixItems": {}}}}, "prefixItems must be a list"),
    ({"type": "object", "properties": {"a": {"type": "array", "prefixItems": [{}], "uniqueItems": True}}},
     "not beside prefixItems"),
    ({"type": "object", "properties": {"a": {"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}}},
     "no value follows it"),
    ({"type": "object", "properties": {"a": {"patternProperties": {"^a": {}, "^b": {}}}}}, "with one pattern"),
    ({"type": "object", "properties": {"a": {"patternProperties": {"(": {}}}}}, "is no regular expression"),
    ({"type": "object", "properties": {"a": {"properties": {"ab": {}}, "patternProperties": {"^a": {}}}}},
     "'ab' also matches the patternProperties pattern"),
    ({"type": "object", "properties": {"a": {"properties": {"b": {}}, "patternProperties": {"^a": {}},
                                             "additionalProperties": False}}}, "properties beside patternProperties"),
    ({"type": "object", "properties": {"a": {"propertyNames": {"anyOf": [{"maxLength": 2}, {"pattern": "x"}]}}}},
     "propertyNames: followed when it is one schema of strings"),
    ({"type": "object", "properties": {"a": {"propertyNames": {"enum": ["x"]}, "properties": {"y": {}},
                                             "required": ["y"]}}}, "its required property 'y' does not keep"),
    ({"type": "object", "properties": {"a": {"propertyNames": {"enum": ["x", "y"]}, "minProperties": 3}}},
     "minProperties 3 of 2 names"),
    ({"type": "object", "properties": {"a": {"type": "object", "minProperties": 2, "maxProperties": 1}}}, "no value follows it"),
    ({"type": "object", "properties": {"a": {"maxProperties": -1}}}, "maxProperties must be a non-negative integer"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "idn-email"}}},
     "format 'idn-email' is not followed (followed: date, time, date-time, uuid, ipv4, ipv6, ipvanyaddress, "
     "duration, uri, hostname, email, name-email, ipv4network, ipv6network, ipvanynetwork, ipv4interface, "
     "ipv6interface, ipvanyinterface, binary, path, password)"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "a("}}}, "is no regular expression"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": 3}}}, "pattern must be a string"),
    ({"type": "object", "properties": {"a": {"minimum": 0, "exclusiveMinimum": True}}}, "draft 4's true/false"),
    ({"type": "object", "properties": {"a": {"maximum": "9"}}}, "maximum must be a number"),
    ({"type": "object", "properties": {"a": {"maxLength": -1}}}, "maxLength must be a non-negative integer"),
    ({"type": "object", "properties": {"a": {"minItems": 1.5}}}, "minItems must be a non-negative integer"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0.2, "maximum": 0.8}}},
     "no value follows it"),
    ({"type": "object", "properties": {"a": {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1}}},
     "no value follows it"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}},
     "no value follows it"),
    ({"type": "object", "properties": {"a": {"enum": ["ab", "cd"], "maxLength": 1}}}, "no value follows it"),
    ({"type": "object", "properties": {"a": {"const": 10, "maximum": 9}}}, "no value follows it"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}}},
     "alternatives 0 and 1 may take the same value"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}},
     "may take the same value"),
    ({"type": "object", "properties": {"a": {"oneOf": [
        {"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"enum": ["y", "x"]}}, "required": ["k"]}]}}},
     "may take the same value"),
    ({"type": "object", "properties": {"a": {"oneOf": [
        {"type": "object", "properties": {"k": {"const": "x"}}},
        {"type": "object", "properties": {"k": {"const": "y"}}}]}}},
     "may take the same value"),  # the tag is not required: {} follows both
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"maxLength": 2}]}}},
     "allOf of 2 schemas is not followed"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}], "type": "null"}}},
     "oneOf stands beside 'type'"),
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


def first_refusal(schema: dict, text: str, whole: bool = True) -> str | None:
    """The bytes of ``text`` up to the first the reader of ``schema`` refuses (None: all taken; then, when
    ``whole``, they must make a whole document)."""
    from kvcompile.structured import SchemaPrefix, check_schema

    check_schema(schema)
    p = SchemaPrefix(schema)
    data = text.encode()
    at = next((i for i, b in enumerate(data) if not p.feed(b)), None)
    assert at is not None or not whole or p.complete
    return None if at is None else data[:at + 1].decode(errors="replace")  # (refused inside a character: "\ufffd")


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
    assert first_refusal(PET, text, whole=False) == refused_at


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
    assert first_refusal(LITERALS, text) == refused_at


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


# --------------------------------------------------------------------------- bounds on values
def dumps_positional(value, sep=(",", ":")) -> str:
    """``json.dumps`` but for floats, written without an exponent (the reader's rule for a bounded number; the
    text still parses to the same double)."""
    if isinstance(value, float) and not isinstance(value, bool):
        r = repr(value)
        return format(__import__("decimal").Decimal(r), "f") if "e" in r else r
    if isinstance(value, dict):
        return "{" + sep[0].join(json.dumps(k, ensure_ascii=False) + sep[1] + dumps_positional(v, sep)
                                 for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + sep[0].join(dumps_positional(v, sep) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def format_valid(fmt: str, text: str) -> bool:
    """The formats as the reader documents them, checked by Python's own parsers (not by the reader's patterns):
    RFC 3339 with "T" and "Z" in capitals, at most six fraction digits, a required offset; a UUID's 36 characters."""
    import datetime
    import uuid

    def time_ok(t):
        m = re.fullmatch(r"(\d\d):(\d\d):(\d\d)(\.\d{1,6})?(Z|[+-]\d\d:\d\d)", t)
        if not m:
            return False
        try:
            datetime.time.fromisoformat(t.replace("Z", "+00:00"))
        except ValueError:
            return False
        return True

    def date_ok(d):
        if not re.fullmatch(r"\d{4}-\d\d-\d\d", d):
            return False
        try:
            datetime.date.fromisoformat(d)
        except ValueError:
            return False
        return True

    if fmt == "date":
        return date_ok(text)
    if fmt == "time":
        return time_ok(text)
    if fmt == "date-time":
        return len(text) > 11 and text[10] == "T" and date_ok(text[:10]) and time_ok(text[11:])
    try:
        return len(text) == 36 and str(uuid.UUID(text)) == text.lower() and text.count("-") == 4
    except ValueError:
        return False


def bounded_valid(doc, schema) -> bool:
    """``schema_valid`` with the formats checked (``format_valid``), and each pattern of a top-level property
    also as pydantic reads it (its ``$`` is the end of the string; Python's also matches before a final
    newline)."""
    import jsonschema
    from pydantic import StringConstraints, TypeAdapter, ValidationError

    checker = jsonschema.FormatChecker(formats=())
    for fmt in ("date", "time", "date-time", "uuid"):
        checker.checks(fmt)(lambda t, fmt=fmt: not isinstance(t, str) or format_valid(fmt, t))
    for name, value in doc.items():
        pattern = schema["properties"].get(name, {}).get("pattern")
        if pattern is not None and isinstance(value, str):
            try:
                TypeAdapter(Annotated[str, StringConstraints(pattern=pattern)]).validate_python(value)
            except ValidationError:
                return False
    return schema_valid(doc, schema, checker)


bound_values = st.one_of(st.integers(-20, 20), st.floats(-20, 20), st.sampled_from([0.5, -0.5, 1e-7, 2.0, 0.1]))
number_leaves = st.tuples(
    st.sampled_from(["integer", "number"]),
    st.dictionaries(st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]), bound_values,
                    min_size=1, max_size=2)).map(lambda t: {"type": t[0], **t[1]})
string_leaves = st.one_of(
    st.tuples(st.integers(0, 3), st.integers(0, 4)).map(lambda t: {"type": "string", "minLength": t[0],
                                                                   "maxLength": t[0] + t[1]}),
    st.sampled_from(["^[a-c]{2,4}$", "^x+[0-9]?$", "^(ab|cd)*$", "^[A-Z][a-z]*$", "^[0-9]{3}-[0-9]{2}$"]).map(
        lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(["date", "time", "date-time", "uuid"]).map(lambda f: {"type": "string", "format": f}),
    st.just({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}))
array_leaves = st.tuples(st.integers(0, 2), st.integers(0, 2)).map(
    lambda t: {"type": "array", "items": {"type": "integer"}, "minItems": t[0], "maxItems": t[0] + t[1]})
TAGGED = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer", "maximum": 3}},
                     "required": ["kind", "n"], "additionalProperties": False},
                    {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}, "s": {"type": "string"}},
                     "required": ["kind"], "additionalProperties": False}],
          "discriminator": {"propertyName": "kind"}}


def near_string(draw, schema):
    """A string near what ``schema`` takes: in or just out of its lengths, matching its pattern or format or
    an edit of one that does."""
    if "format" in schema:
        fmt = schema["format"]
        good = draw({"date": st.dates().map(str), "uuid": st.uuids().map(str),
                     "time": st.times().map(lambda t: t.isoformat() + "Z"),
                     "date-time": st.datetimes().map(lambda t: t.isoformat() + "+01:00")}[fmt])
    elif "pattern" in schema:
        good = draw(st.from_regex(schema["pattern"], fullmatch=True).filter(lambda t: t.isascii()))
    else:
        good = draw(st.text(min_size=schema["minLength"], max_size=schema["maxLength"]))
    bad = draw(st.sampled_from(["", "drop", "add", "sub"]))
    if bad == "drop" and good:
        i = draw(st.integers(0, len(good) - 1))
        return good[:i] + good[i + 1:]
    if bad in ("add", "sub") and good:
        i = draw(st.integers(0, len(good) - 1))
        return good[:i] + draw(st.sampled_from(list("a0Z-:.T\n"))) + good[i + (bad == "sub"):]
    return good


@settings(max_examples=600, deadline=None)
@given(st.data(), st.dictionaries(st.sampled_from("pqrs"), number_leaves | string_leaves | array_leaves |
                                  st.just(TAGGED), min_size=1, max_size=3), st.sampled_from([(",", ":"), (", ", ": ")]))
def test_the_reader_keeps_to_bounds_as_jsonschema_does(data, props, sep):
    """Numbers bounded by minimum / maximum / exclusive ones (integers and numbers, bounds of either kind), strings
    by lengths, patterns and formats, arrays by item counts, and a oneOf told apart by a tag: values drawn near
    the bounds (inside, on, just outside) are taken exactly when jsonschema takes the document (formats checked by
    Python's parsers), every prefix of a taken document is taken, and a refused one is refused before its end."""
    from kvcompile.structured import SchemaError, SchemaPrefix, check_schema

    schema = {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
    try:
        check_schema(schema)
    except SchemaError as e:  # bounds that leave no value (an integer between 0.5 and 0.7, say)
        assert "no value follows it" in str(e)
        return
    doc = {}
    for name, leaf in props.items():
        if leaf is TAGGED:
            doc[name] = data.draw(st.sampled_from([{"kind": "a", "n": 2}, {"kind": "a", "n": 4}, {"kind": "b"},
                                                   {"kind": "c", "s": "x"}, {"kind": "b", "n": 1}, {"kind": "d"}]))
        elif leaf["type"] == "string":
            doc[name] = near_string(data.draw, leaf)
        elif leaf["type"] == "array":
            doc[name] = data.draw(st.lists(st.integers(-5, 5), max_size=leaf["maxItems"] + 1))
        else:
            edges = [v for k, v in leaf.items() if k != "type"]
            near = st.sampled_from(edges).flatmap(lambda e: st.sampled_from(
                [e, e + 1, e - 1, e + 0.5, e - 0.5, math.nextafter(e, math.inf), math.nextafter(e, -math.inf)]))
            v = data.draw(near | st.integers(-30, 30) | st.floats(-30, 30))
            doc[name] = int(v) if leaf["type"] == "integer" and data.draw(st.booleans()) else v
    text = dumps_positional(doc, sep)
    p = SchemaPrefix(schema)
    data_bytes = text.encode()
    taken = next((i for i, b in enumerate(data_bytes) if not p.feed(b)), len(data_bytes))
    valid = bounded_valid(json.loads(text), schema)
    assert (taken == len(data_bytes) and p.complete) == valid, (schema, text)


BOUNDED = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": -5, "exclusiveMaximum": 120},
    "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "s": {"type": "string", "minLength": 2, "maxLength": 3},
    "a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
    "d": {"type": "string", "format": "date"}, "c": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "t": {"type": "string", "format": "date-time"}, "u": {"type": "string", "format": "uuid"},
    "pet": TAGGED, "y": {"type": "number", "exclusiveMaximum": 1}}}


@pytest.mark.parametrize("text, refused_at", [
    ('{"n":-5,"x":1,"s":"ab","a":[1,2],"d":"2024-02-29","c":"ABC","t":"2024-01-31T23:59:59.5-01:00",'
     '"u":"0f8fad5b-D9CB-469f-a165-70867728950e","pet":{"kind":"a","n":3}}', None),
    ('{"n":119}', None), ('{"n":-0}', None), ('{"x":0.000001}', None), ('{"x":1.0}', None), ('{"s":"a\\nb"}', None),
    ('{"n":120}', '{"n":120'), ('{"n":1200}', '{"n":120'),  # no number that begins 120 is below 120
    ('{"n":-6}', '{"n":-6'), ('{"n":-50}', '{"n":-50'),
    ('{"n":5.0}', '{"n":5.'),  # an integer
    ('{"x":0}', '{"x":0}'),  # 0.5 begins with 0: refused where it ends
    ('{"x":1.01}', '{"x":1.01'), ('{"x":2}', '{"x":2'), ('{"x":-0.5}', '{"x":-'),
    ('{"x":1e-3}', '{"x":1e'),  # a bounded number has no exponent
    # where the nearest double decides: 1 + 2**-53 (the midpoint between 1 and the next double) parses to 1, which
    # "x" <= 1 takes; 1 - 2**-54 (the midpoint below 1) parses to 1 too, which "y" < 1 refuses; a last digit less
    # and it parses below 1
    ('{"x":1.00000000000000011102230246251565404236316680908203125}', None),
    ('{"x":1.00000000000000011102230246251565404236316680908203126}',
     '{"x":1.00000000000000011102230246251565404236316680908203126'),
    ('{"y":0.999999999999999944488848768742172978818416595458984375}',  # (more digits would only add to it)
     '{"y":0.999999999999999944488848768742172978818416595458984375'),
    ('{"y":0.999999999999999944488848768742172978818416595458984374}', None),
    ('{"s":"a"}', '{"s":"a"'), ('{"s":"abcd"}', '{"s":"abcd'), ('{"s":"\\ud83d\\ude00"}', '{"s":"\\ud8'),
    ('{"a":[]}', '{"a":[]'), ('{"a":[1,2,3]}', '{"a":[1,2,'),
    ('{"d":"2023-02-29"}', '{"d":"2023-02-29'), ('{"d":"2023-04-31"}', '{"d":"2023-04-31'),
    ('{"d":"2023-13-01"}', '{"d":"2023-13'), ('{"d":"0000-01-01"}', '{"d":"0000'), ('{"d":"2023-1-01"}', '{"d":"2023-1-'),
    ('{"c":"ABCD"}', '{"c":"ABCD'), ('{"c":"AbC"}', '{"c":"Ab'), ('{"c":"AB"}', '{"c":"AB"'),
    ('{"c":"\\u0041BC"}', '{"c":"\\'),  # no escape fits [A-Z] (and none is \\u: the pattern's strings are ASCII)
    ('{"c":"\\n"}', '{"c":"\\'),
    ('{"t":"2024-01-01T24:00:00Z"}', '{"t":"2024-01-01T24'), ('{"t":"2024-01-01 10:00:00Z"}', '{"t":"2024-01-01 '),
    ('{"t":"2024-01-01T10:00:00"}', '{"t":"2024-01-01T10:00:00"'),  # an offset is required
    ('{"t":"2024-01-01T10:00:00.1234567Z"}', '{"t":"2024-01-01T10:00:00.1234567'),
    ('{"u":"0f8fad5b-d9cb-469f-a165-70867728950"}', '{"u":"0f8fad5b-d9cb-469f-a165-70867728950"'),
    ('{"u":"0f8fad5bd9cb"}', '{"u":"0f8fad5bd'),
    ('{"pet":{"kind":"a","n":4}}', '{"pet":{"kind":"a","n":4'), ('{"pet":{"kind":"b","n":1}}', '{"pet":{"kind":"b","n'),
    ('{"pet":{"kind":"d"}}', '{"pet":{"kind":"d'), ('{"pet":{"kind":"a"}}', '{"pet":{"kind":"a"}'),
])
def test_bounded_values_are_refused_at_the_first_byte_none_continues(text, refused_at):
    assert first_refusal(BOUNDED, text) == refused_at


def test_an_enum_keeps_only_the_values_inside_its_bounds():
    from kvcompile.structured import SchemaPrefix

    schema = {"type": "object", "properties": {"e": {"enum": [1, 5, 2.5, "ab", "abc", None], "maximum": 2.5,
                                                     "exclusiveMinimum": 1, "maxLength": 2}}}
    taken = [v for v in (1, 5, 2.5, "ab", "abc", None)
             if SchemaPrefix(schema).feed_all(json.dumps({"e": v}).encode())]
    assert taken == [2.5, "ab", None]


@pytest.mark.parametrize("seed", range(8))
def test_a_constrained_pick_under_a_bounded_pydantic_model_parses_into_the_model(seed, bounded_model):
    """A pydantic model with bounded fields (ge / lt, lengths, list lengths, a pattern, a date, a datetime, a
    UUID, a discriminated union), its schema as the openai client sends it: a constrained walk parses into the
    model, greedy and sampled."""
    from openai.lib._pydantic import to_strict_json_schema

    from kvcompile.structured import check_schema

    schema = to_strict_json_schema(bounded_model)
    check_schema(schema)
    pieces = ["{", "}", "[", "]", '"', ":", ",", " ", ".", "-", "+", "T", "Z", "null", "true", '":',
              *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", *[f'"{k}"' for k in
                                                                                   bounded_model.model_fields]]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=bool(seed % 2))
    assert isinstance(bounded_model.model_validate_json(out), bounded_model), out


@pytest.mark.parametrize("seed", range(6))
def test_a_pick_is_the_best_fitting_token_when_the_best_does_not_fit(seed):
    """When the most likely token does not fit, ``pick`` tries only tokens whose first byte can come next: the
    token it gives is still the highest-scoring (greedy) or most probable (a draw that takes the most probable
    token left) of every token that fits, found by trying them all."""
    from kvcompile.structured import SchemaPrefix

    vocab = vocabulary()[:-1] + [b"2024", b"-0", b"1-", b"A", b"5Z"] + [None]
    g = torch.Generator().manual_seed(seed)
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "n": {"type": "integer", "maximum": 10}}}
    c = JsonConstraint(vocab, len(vocab) - 1, schema=schema)
    for text in (b'{"d":"', b'{"d":"2024', b'{"n":', b'{"n":1', b'{"d":"2024-01-01"'):
        c.prefix = SchemaPrefix(schema)
        assert c.prefix.feed_all(text)
        for _ in range(10):
            scores = torch.randn(len(vocab), generator=g)
            fitting = [t for t in range(len(vocab)) if c.fits(t)]
            assert fitting, text
            want = max(fitting, key=lambda t: scores[t])
            assert c.pick(scores) == want
            probs = torch.softmax(scores, 0)
            assert c.pick(scores, probs, draw=lambda p: int(p.argmax())) == want


def test_a_pattern_that_needs_a_character_beyond_u_ffff_ends_in_an_error_naming_it():
    """A string with a pattern is written without characters beyond U+FFFF: where its pattern needs one (here an
    emoji), no token continues the reply, and the pick says so (the request fails with that message) instead of
    ending the reply cut. One that needs "€" writes it, whether a token holds all its bytes or they come split
    over tokens."""
    vocab = [p.encode() for p in ['{"p":', '"', "😀", "5", "}", "E"]] + [None]
    c = JsonConstraint(vocab, len(vocab) - 1, schema={
        "type": "object", "properties": {"p": {"type": "string", "pattern": "^😀[0-9]$"}}, "required": ["p"]})
    for piece in (b'{"p":', b'"'):
        c.took(vocab.index(piece))
    with pytest.raises(DeadEnd, match=r"""\('\{"p":"' so far\).*pattern needs a\s+character not written under"""):
        c.pick(torch.zeros(len(vocab)))
    for vocab in ([b'{"p":', b'"', "€".encode(), b"5", b"}", b"E", None],
                  [b'{"p":', b'"', b"\xe2", b"\x82\xac", b"\x82", b"\xac", b"5", b"}", None]):  # € split
        c = JsonConstraint(vocab, len(vocab) - 1, schema={
            "type": "object", "properties": {"p": {"type": "string", "pattern": "^€[0-9]$"}}, "required": ["p"]})
        out = b""
        while (t := c.pick(torch.zeros(len(vocab)))) != c.eos:
            c.took(t)
            out += vocab[t]
        assert json.loads(out) == {"p": "€5"}


PATTERNS_BEYOND_ASCII = ["^[а-я]{1,3}$", "^[À-ÿ ]+$", "^€[0-9]+$", "^[一-龥]{2}$", "^[^a-z]*$", "é", "^.{2}$",
                         "^(ß|ss)[0-9]?$", r"^\d{1,2}$", r"^[\w-]+$", r"\s", r"^\D\S$", "(?i)^É+$"]
CHAR_POOL = ["a", "z", "5", " ", "é", "É", "ß", "я", "б", "€", "一", "龥", "中", "😀", "ÿ", "À", "s", "\n", "\x01", "٣",
             "５", "\u3000", "_", "-", "\u0301"]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(PATTERNS_BEYOND_ASCII), st.lists(st.sampled_from(CHAR_POOL), max_size=4).map("".join),
       st.booleans(), st.sampled_from([None, 2, 3]))
def test_a_pattern_beyond_ascii_is_kept_byte_by_byte(pattern, text, escaped, most):
    """Strings of non-ASCII characters (Cyrillic, accented Latin, "€", CJK, other scripts' digits) under a
    pattern that needs or allows them: the reader takes a string exactly when its pattern and length hold, as
    both Python's regular expressions (jsonschema's) and pydantic's read the pattern (``$`` the end, not also
    before a final newline), unless it holds a character such strings are not written with (beyond U+FFFF, or a
    \\u escape)."""
    import regex
    from pydantic import StringConstraints, TypeAdapter, ValidationError

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern,
                                                     **({"maxLength": most} if most else {})}}}
    written = json.dumps({"s": text}, ensure_ascii=escaped)
    taken = first_refusal(schema, written) is None
    writable = not escaped or text.isascii()
    writable = writable and all(ord(ch) <= 0xFFFF and (ch >= " " or ch in "\b\f\n\r\t") for ch in text)
    try:
        TypeAdapter(Annotated[str, StringConstraints(pattern=pattern)]).validate_python(text)
        pydantic_takes = True
    except ValidationError:
        pydantic_takes = False
    want = regex.search(pattern, text) is not None and pydantic_takes and (most is None or len(text) <= most)
    assert taken == (want and writable), (pattern, written)


@pytest.mark.parametrize("pattern, text, taken", [
    (r"^[0-9]{3}$", "123", True), (r"^[0-9]{3}$", "123\n", False), (r"^a$|^b$", "b\n", False),
    (r"^[$]+$", "$$", True), (r"^a\$$", "a$", True), (r"(?m)^a$", "a\n", True), (r"^[]$]$", "$", True),
])
def test_a_dollar_is_the_end_of_the_string(pattern, text, taken):
    """``$`` ends the string as pydantic and JSON Schema's own dialect read it; Python's would also match
    before a final newline, which pydantic then refuses (the multiline flag keeps Python's reading)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    assert (first_refusal(schema, json.dumps({"s": text}), whole=False) is None) == taken


UNIQUE_ITEMS = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                {"type": ["string", "null"]}, {"type": "string", "maxLength": 1}, {"enum": ["p", "q", "r"]},
                {"enum": [1, 2, "1", True, None]}, {"anyOf": [{"type": "integer"}, {"const": "x"}]}]
ITEM_POOL = ["a", "ab", "", "p", "q", "r", "1", "x", 0, 1, 2, 10, -1, 1.0, 1.5, 2.0, 0.0, -0.0, True, False, None]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(UNIQUE_ITEMS), st.lists(st.sampled_from(ITEM_POOL), max_size=6),
       st.integers(0, 2), st.sampled_from([(",", ":"), (", ", ": ")]))
def test_unique_items_are_kept_as_jsonschema_keeps_them(items, values, min_items, sep):
    """``uniqueItems`` (what pydantic writes for a ``set``): arrays of values drawn from a small pool, so that
    they repeat (1 and 1.0 and -0.0 and 0 among them; true apart from 1), are taken exactly when jsonschema takes
    the document, and every prefix of a taken one is taken."""
    from kvcompile.structured import SchemaError, SchemaPrefix, check_schema

    schema = {"type": "object", "properties": {"s": {"type": "array", "items": items, "uniqueItems": True,
                                                      "minItems": min_items}}, "required": ["s"]}
    try:
        check_schema(schema)
    except SchemaError as e:
        assert "no value follows it" in str(e)
        return
    text = dumps_positional({"s": values}, sep)
    p = SchemaPrefix(schema)
    data = text.encode()
    taken = next((i for i, b in enumerate(data) if not p.feed(b)), len(data))
    assert (taken == len(data) and p.complete) == schema_valid(json.loads(text), schema), (items, text)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("items", UNIQUE_ITEMS, ids=str)
def test_a_constrained_pick_under_unique_items_never_dead_ends(seed, items):
    """Picking every token under a set of values (random scores; closing tokens a little more likely) ends in
    a document jsonschema takes -- the reader never takes a byte after which every way on repeats an item:
    a finite set's values run out (its array must close), a one-character string's last character, 0 as an
    integer (no digit may follow it)."""
    schema = {"type": "object", "properties": {"s": {"type": "array", "items": items, "uniqueItems": True,
                                                      "maxItems": 8}}, "required": ["s"]}
    pieces = ["{", "}", "[", "]", '"', ":", ",", '"s":', "p", "q", "r", "1", "2", "0", "x", "-", ".",
              "true", "false", "null"]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=True)
    assert schema_valid(json.loads(out), schema), out


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, "not for these items (object)"),
    ({"type": "array", "items": {"type": "integer", "maximum": 3}, "uniqueItems": True}, "(integer with bounds)"),
    ({"type": "array", "items": {"type": "string", "pattern": "^a"}, "uniqueItems": True}, "without a pattern"),
    ({"type": "array", "uniqueItems": True}, "not for these items"),
    ({"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "minItems": 3}, "no value follows it"),
    ({"type": "array", "uniqueItems": "yes"}, "uniqueItems must be true or false"),
])
def test_unique_items_the_reader_cannot_keep_apart_are_refused(schema, message):
    from kvcompile.structured import SchemaError, check_schema
    with pytest.raises(SchemaError, match=re.escape(message)):
        check_schema({"type": "object", "properties": {"s": schema}})


@pytest.mark.parametrize("items, text, refused_at", [
    ({"enum": ["p", "q"]}, '{"s":["p","p"]}', '{"s":["p","p'),  # at the value that decides it: p is used
    ({"enum": ["p", "q"]}, '{"s":["p","q",', '{"s":["p","q",'),  # every value is used: the array closes
    ({"enum": [1, 2]}, '{"s":[1,2,', '{"s":[1,2,'),  # (the number 2 is whole at that comma)
    ({"enum": [1, 2]}, '{"s":[2, 1]}', None),
    ({"enum": [12, 3]}, '{"s":[12,1', '{"s":[12,1'),  # only 12 begins with 1, and it is used
    ({"enum": [True, None]}, '{"s":[true,t', '{"s":[true,t'),
    ({"type": "boolean"}, '{"s":[true,false,', '{"s":[true,false,'),
    ({"type": "boolean"}, '{"s":[false,f', '{"s":[false,f'),
    ({"type": ["string", "null"]}, '{"s":[null,"",n', '{"s":[null,"",n'),
    ({"type": "integer"}, '{"s":[0,0', '{"s":[0,0'),  # no digit may follow a 0: it is refused where it begins
    ({"type": "integer"}, '{"s":[0,-0', '{"s":[0,-0'),
    ({"type": "integer"}, '{"s":[1,10,1]}', '{"s":[1,10,1]'),  # 1 may go on (12): refused where it ends
    ({"type": "integer"}, '{"s":[1,10,12]}', None),
    ({"type": "number"}, '{"s":[0,-0.0]}', '{"s":[0,-0.0]'),
    ({"type": "number"}, '{"s":[1,1.0]}', '{"s":[1,1.0]'),
    ({"type": "number"}, '{"s":[1,1.01]}', None),
    ({"type": "string"}, '{"s":["a","a"]}', '{"s":["a","a"'),  # "a" may go on ("ab"): refused at its end
    ({"type": "string", "maxLength": 1}, '{"s":["a","a"]}', '{"s":["a","a'),  # at its last character
    ({"type": "string", "maxLength": 1}, '{"s":["a","\\u0061"]}', '{"s":["a","\\u0061'),  # the same character
    ({"enum": [1, "1", True]}, '{"s":[1,"1",true]}', None),  # apart: a number, a string, a boolean
])
def test_a_repeated_item_is_refused_where_nothing_else_can_follow(items, text, refused_at):
    schema = {"type": "object", "properties": {"s": {"type": "array", "items": items, "uniqueItems": True}}}
    assert first_refusal(schema, text, whole=refused_at is None and text.endswith("}")) == refused_at


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(["integer", "number"]), st.sampled_from([1, 2, 3, 5, 7, 10, 25]),
       st.dictionaries(st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
                       st.integers(-40, 40) | st.sampled_from([0.5, -2.5, 12.5]), max_size=2),
       st.integers(-80, 80) | st.sampled_from([5.0, -10.0, 2.5]))
def test_multiple_of_is_kept_as_jsonschema_keeps_it(kind, step, bounds, value):
    """``multipleOf`` (pydantic's ``Field(multiple_of=...)``), an integer, with and without bounds: an integer
    value is taken exactly when jsonschema takes it; a number under it is written as an integer, so a value
    written with a fraction is refused (under "number" too, where jsonschema would take 5.0)."""
    from kvcompile.structured import SchemaError

    schema = {"type": "object", "properties": {"a": {"type": kind, "multipleOf": step, **bounds}}, "required": ["a"]}
    try:
        from kvcompile.structured import check_schema
        check_schema(schema)
    except SchemaError as e:  # bounds that hold no multiple
        assert "no value follows it" in str(e)
        assert not any(schema_valid({"a": v}, schema) for v in range(-100, 101))
        return
    text = json.dumps({"a": value})
    taken = first_refusal(schema, text) is None
    assert taken == (isinstance(value, int) and schema_valid({"a": value}, schema)), text


def exact_multiple_valid(text: str, schema: dict) -> bool:
    """JSON Schema's ``multipleOf`` in exact arithmetic (a number's decimal value over the step's, an integer),
    the bounds and the rest as jsonschema reads them. (jsonschema's own check divides doubles, so it refuses
    0.07 as a multiple of 0.01; pydantic's allows for the rounding and takes it.)"""
    from fractions import Fraction

    field = schema["properties"]["a"]
    rest = {**schema, "properties": {"a": {k: v for k, v in field.items() if k != "multipleOf"}}}
    value = json.loads(text)["a"]
    number = re.search(r":\s*(-?[0-9.eE+-]+)", text).group(1)
    return (Fraction(number) % Fraction(repr(field["multipleOf"])) == 0) and schema_valid({"a": value}, rest)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["integer", "number"]), st.sampled_from([0.5, 0.25, 0.01, 0.1, 1.5, 0.05, 2.5, 0.001]),
       st.dictionaries(st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
                       st.integers(-4, 4) | st.sampled_from([0.5, -2.5, 0.3, 1.25, 0.07]), max_size=2),
       st.integers(-3000, 3000), st.integers(0, 4))
def test_a_fractions_multiple_of_is_kept_in_exact_arithmetic(kind, step, bounds, digits, places):
    """A fraction's ``multipleOf`` (``Field(multiple_of=0.01)``, a price's): a number written with up to
    four decimals is taken exactly when its decimal value is a multiple of the step's and the bounds hold
    (``exact_multiple_valid``); an integer under it is one when it is a multiple."""
    from kvcompile.structured import SchemaError, check_schema

    schema = {"type": "object", "properties": {"a": {"type": kind, "multipleOf": step, **bounds}}, "required": ["a"]}
    text = '{"a":' + (f"{digits / 10 ** places:.{places}f}" if places else str(digits)) + "}"
    if kind == "integer" and places:
        text = '{"a":' + str(digits) + "}"
    try:
        check_schema(schema)
    except SchemaError as e:  # bounds that hold no multiple
        assert "no value follows it" in str(e)
        from fractions import Fraction

        unit = Fraction(repr(step))  # a multiple inside the bounds would be the first one past a bound
        near = {(math.ceil(Fraction(repr(b)) / unit) + j) * unit for b in bounds.values() for j in (-1, 0, 1)}
        assert not any(exact_multiple_valid('{"a":' + (str(x.numerator) if x.denominator == 1 else f"{float(x)!r}")
                                            + "}", schema) for x in near)
        return
    assert (first_refusal(schema, text) is None) == exact_multiple_valid(text, schema), text


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("step", [0.01, 0.5, 0.25])
def test_a_constrained_pick_under_a_fractions_multiple_of_parses_into_pydantic(seed, step):
    """Random walks under ``Field(multiple_of=step, ge=..., lt=...)`` end in a number pydantic takes."""
    from pydantic import BaseModel, Field

    class Price(BaseModel):
        a: float = Field(multiple_of=step, ge=-3, lt=20)

    from openai.lib._pydantic import to_strict_json_schema

    schema = to_strict_json_schema(Price)
    pieces = ["{", "}", "]", '"', "a", ":", '"a":', *"0123456789", "-", ".", "e", " ", "07", "25"]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=True)
    Price.model_validate_json(out)
    assert exact_multiple_valid(out.decode(), schema), out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("field", [{"type": "integer", "multipleOf": 7}, {"type": "number", "multipleOf": 5},
                                   {"type": "integer", "multipleOf": 7, "minimum": 10, "maximum": 30},
                                   {"type": "integer", "multipleOf": 25, "exclusiveMinimum": -60, "maximum": -1}],
                         ids=str)
def test_a_constrained_pick_under_multiple_of_never_dead_ends(seed, field):
    """Random walks (digits, a sign, a point) under ``multipleOf`` with and without bounds end in a document
    jsonschema takes: no digit is taken after which no multiple inside the bounds can follow."""
    schema = {"type": "object", "properties": {"a": field}, "required": ["a"], "additionalProperties": False}
    pieces = ["{", "}", "]", '"', "a", ":", '"a":', *"0123456789", "-", ".", "e", " "]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=True)
    assert schema_valid(json.loads(out), schema), out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_uri_and_ipv4_formats_write_what_pydantic_takes(data):
    """``format: "uri"`` (pydantic's AnyUrl and HttpUrl both write it) is followed as an http(s) URL pydantic's
    parser takes for either; ``"ipv4"`` as a dotted quad Python's ``ipaddress`` takes (and nothing else: no
    leading zeros). Strings drawn from what the reader takes, and the reader's refusals of near misses."""
    import ipaddress

    from pydantic import AnyUrl, HttpUrl, TypeAdapter

    from kvcompile.structured import FORMATS

    url = data.draw(st.from_regex(FORMATS["uri"], fullmatch=True).filter(lambda t: len(t) <= 400))
    TypeAdapter(HttpUrl).validate_python(url)
    TypeAdapter(AnyUrl).validate_python(url)
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri", "minLength": 1,
                                                     "maxLength": 2083}}}
    assert first_refusal(schema, json.dumps({"u": url})) is None
    quad = ".".join(str(data.draw(st.integers(0, 300))) for _ in range(4))
    schema = {"type": "object", "properties": {"i": {"type": "string", "format": "ipv4"}}}
    try:
        ipaddress.IPv4Address(quad)
        valid = True
    except ValueError:
        valid = False
    assert (first_refusal(schema, json.dumps({"i": quad}), whole=False) is None) == valid, quad


def ipv6_candidates():
    """Strings of hex groups and colons near IPv6 addresses: valid ones, "::" anywhere, too many groups, a
    group of five digits, a lone colon at either end."""
    group = st.text("0123456789abcdefABCDEF", min_size=1, max_size=5)
    return st.lists(st.one_of(group, st.just("")), min_size=1, max_size=10).map(":".join)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_ipv6_and_duration_formats_write_what_pydantic_takes(data):
    """``format: "ipv6"`` (pydantic's IPv6Address writes it) is followed as hex groups with at most one "::",
    every one of them an address Python's ``ipaddress`` and pydantic take, and every such address taken;
    ``"ipvanyaddress"`` as either kind; ``"duration"`` (pydantic's timedelta) as an ISO 8601 duration
    pydantic reads, taking what pydantic writes for any timedelta that is not negative."""
    import datetime
    import ipaddress

    from pydantic import IPvAnyAddress, TypeAdapter

    from kvcompile.structured import FORMATS

    def taken(fmt, text):
        schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}}
        return first_refusal(schema, json.dumps({"a": text}), whole=False) is None

    drawn = data.draw(st.from_regex(FORMATS["ipv6"], fullmatch=True))
    assert TypeAdapter(ipaddress.IPv6Address).validate_python(drawn) == ipaddress.IPv6Address(drawn)
    assert taken("ipv6", drawn) and taken("ipvanyaddress", drawn)
    near = data.draw(ipv6_candidates())
    try:
        ipaddress.IPv6Address(near)
        valid = True
    except ValueError:
        valid = False
    assert taken("ipv6", near) == valid, near
    assert taken("ipvanyaddress", near) == valid, near
    quad = data.draw(st.ip_addresses(v=4)).exploded
    assert taken("ipvanyaddress", quad) and TypeAdapter(IPvAnyAddress).validate_python(quad)

    drawn = data.draw(st.from_regex(FORMATS["duration"], fullmatch=True))
    TypeAdapter(datetime.timedelta).validate_python(drawn)
    assert taken("duration", drawn)
    td = data.draw(st.timedeltas(min_value=datetime.timedelta(0), max_value=datetime.timedelta(days=999_999)))
    written = json.loads(TypeAdapter(datetime.timedelta).dump_json(td))
    assert taken("duration", written), written
    assert not taken("duration", "-" + written)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_the_network_interface_and_name_email_formats_write_what_pydantic_takes(data):
    """The formats pydantic's IPv4/IPv6/IPvAny networks and interfaces and NameEmail write: every string the
    grammar writes is one pydantic takes (a network without host bits set after its prefix), and the networks
    people write on byte or group boundaries, and any interface, are taken."""
    import ipaddress

    from pydantic import IPvAnyInterface, IPvAnyNetwork, NameEmail, TypeAdapter

    from kvcompile.structured import FORMATS

    def taken(fmt, text):
        schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}}
        return first_refusal(schema, json.dumps({"a": text}), whole=False) is None

    kinds = {"ipv4network": ipaddress.IPv4Network, "ipv6network": ipaddress.IPv6Network,
             "ipvanynetwork": IPvAnyNetwork, "ipv4interface": ipaddress.IPv4Interface,
             "ipv6interface": ipaddress.IPv6Interface, "ipvanyinterface": IPvAnyInterface, "name-email": NameEmail}
    fmt = data.draw(st.sampled_from(sorted(kinds)))
    drawn = data.draw(st.from_regex(FORMATS[fmt], fullmatch=True))
    TypeAdapter(kinds[fmt]).validate_python(drawn)
    assert taken(fmt, drawn)
    for fmt, text in (("ipv4network", "10.0.0.0/8"), ("ipv4network", "192.168.1.0/24"),
                      ("ipv6network", "fe80::/16"), ("ipv6network", "2001:db8::/32"), ("ipvanynetwork", "10.1.0.0/16"),
                      ("ipv4interface", "10.1.2.3/8"), ("ipvanyinterface", "fe80::1/10"),
                      ("name-email", "Ada Lovelace <ada@example.com>")):
        assert taken(fmt, text), (fmt, text)
    for fmt, text in (("ipv4network", "10.1.2.3/8"), ("ipv4network", "10.0.0.0/33"), ("ipv6network", "fe80::1/16")):
        assert not taken(fmt, text), (fmt, text)


@pytest.mark.parametrize("seed", range(3))
def test_a_constrained_pick_under_network_and_name_email_formats_parses_into_pydantic(seed):
    """Random walks under a model with an IPv4Network, an IPvAnyInterface and a NameEmail end in a reply pydantic
    takes."""
    import ipaddress

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, IPvAnyInterface, NameEmail

    class Route(BaseModel):
        net: ipaddress.IPv4Network
        via: IPvAnyInterface
        owner: NameEmail

    schema = to_strict_json_schema(Route)
    pieces = ["{", "}", "]", '"', ":", "::", ",", '"net":', '"via":', '"owner":', *"0123456789abcdefghilmnortuvwxyz./",
              "A", " ", "<", ">", "é", "@", "Ada", "ex", ".com", "/8", "/24", "/32", "10.", "0."]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=True)
    Route.model_validate_json(out)


@pytest.mark.parametrize("text", ["P", "PT", "P1DT", "PT1M1H", "PT.5S", "P1W", "P12345678D", "1D", "pt1s"])
def test_a_duration_pydantic_could_refuse_or_read_otherwise_is_not_written(text):
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "duration"}}}
    assert first_refusal(schema, json.dumps({"d": text})) is not None


@pytest.mark.parametrize("seed", range(4))
def test_a_constrained_pick_under_ipv6_and_duration_formats_parses_into_pydantic(seed):
    """Random walks under a model with an IPv6Address, an IPvAnyAddress and a timedelta end in a reply
    pydantic takes."""
    import datetime
    import ipaddress

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, IPvAnyAddress

    class Host(BaseModel):
        six: ipaddress.IPv6Address
        any: IPvAnyAddress
        uptime: datetime.timedelta

    schema = to_strict_json_schema(Host)
    pieces = ["{", "}", "]", '"', ":", "::", ",", '"six":', '"any":', '"uptime":', *"0123456789abcdefABF.",
              *"sixnyuptm", "P", "T", "Y", "D", "H", "M", "S", "fe80", "::1"]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=True)
    Host.model_validate_json(out)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_email_and_hostname_formats_write_what_validators_take(data):
    """``format: "email"`` (pydantic's EmailStr writes it) is followed as addresses email-validator, EmailStr's
    checker, takes; ``"hostname"`` as names jsonschema's checker (fqdn) takes. Strings near them are written
    only where the checker takes them too."""
    import jsonschema
    from email_validator import EmailNotValidError, validate_email
    from pydantic import EmailStr, TypeAdapter

    from kvcompile.structured import FORMATS

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER

    def taken(fmt, text):
        schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}}
        return first_refusal(schema, json.dumps({"a": text}), whole=False) is None

    def valid_email(text):
        try:
            validate_email(text, check_deliverability=False)
            return True
        except EmailNotValidError:
            return False

    drawn = data.draw(st.from_regex(FORMATS["email"], fullmatch=True))
    assert valid_email(drawn)
    TypeAdapter(EmailStr).validate_python(drawn)  # (which writes the domain in lower case)
    assert taken("email", drawn)
    near = data.draw(st.from_regex(r"[a-z.'+-]{1,5}@[a-zA-Z0-9.-]{1,10}", fullmatch=True))
    assert not taken("email", near) or valid_email(near), near
    drawn = data.draw(st.from_regex(FORMATS["hostname"], fullmatch=True))
    assert checker.conforms(drawn, "hostname") and taken("hostname", drawn)
    near = data.draw(st.from_regex(r"[a-z0-9._-]{1,12}", fullmatch=True))
    assert not taken("hostname", near) or checker.conforms(near, "hostname"), near


@pytest.mark.parametrize("fmt, text", [
    ("email", "user@example.com"), ("email", "first.last+tag@mail.example.co.uk"), ("email", "o'brien@shop.ie"),
    ("email", "x@b.internal"), ("hostname", "localhost"), ("hostname", "example.com"),
    ("hostname", "my-cool-site.example.org"),
])
def test_common_emails_and_host_names_are_written(fmt, text):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}}
    assert first_refusal(schema, json.dumps({"a": text})) is None


@pytest.mark.parametrize("fmt, text", [
    ("email", "a@b.test"), ("email", "a@x.LOCAL"), ("email", "a@localhost"), ("email", "a..b@c.de"),
    ("email", ".a@c.de"), ("email", "a@b-.de"), ("email", "a@-b.de"), ("email", "a@b.c1"), ("email", "a@1.2.3.4"),
    ("email", "@b.de"), ("email", "a@b"), ("email", "a b@c.de"), ("email", "a@b.home.arpa"),
    ("hostname", "-a.com"), ("hostname", "a_b.com"), ("hostname", "a..b"), ("hostname", "a-.com"),
])
def test_an_email_or_host_name_the_checker_refuses_is_not_written(fmt, text):
    import jsonschema
    from email_validator import EmailNotValidError, validate_email

    if fmt == "email":
        with pytest.raises(EmailNotValidError):
            validate_email(text, check_deliverability=False)
    else:
        assert not jsonschema.Draft202012Validator.FORMAT_CHECKER.conforms(text, "hostname")
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}}
    assert first_refusal(schema, json.dumps({"a": text})) is not None


@pytest.mark.parametrize("seed", range(4))
def test_a_constrained_pick_under_the_email_format_parses_into_pydantic(seed):
    """Random walks under a model with an EmailStr end in a reply pydantic takes."""
    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, EmailStr

    class Contact(BaseModel):
        email: EmailStr

    schema = to_strict_json_schema(Contact)
    pieces = ["{", "}", "]", '"', ":", '"email":', "@", ".", "-", "+", "..", "test", "local", "com", "xn--", *"abceilmoz09"]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=True)
    Contact.model_validate_json(out)


@pytest.mark.parametrize("url", ["ftp://a.com", "http://a.123", "http://123", "http://xn--abc.com", "http://a--b.com",
                                 "http://x:65536", "http://x/%zz", "http:/x", "http://", "https://a b"])
def test_a_uri_pydantic_could_refuse_or_read_otherwise_is_not_written(url):
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri"}}}
    assert first_refusal(schema, json.dumps({"u": url})) is not None


@pytest.mark.parametrize("seed", range(4))
def test_a_constrained_pick_under_uri_and_ipv4_formats_parses_into_pydantic(seed):
    """Random walks under a model with an HttpUrl and an IPv4Address end in a reply pydantic takes."""
    import ipaddress

    from pydantic import BaseModel, HttpUrl

    class Site(BaseModel):
        url: HttpUrl
        ip: ipaddress.IPv4Address

    from openai.lib._pydantic import to_strict_json_schema

    schema = to_strict_json_schema(Site)
    pieces = ["{", "}", "]", '"', ":", ",", '"url":', '"ip":', "http", "s", "://", *"abcilprtuxyz0123456789.-/?#%:=&",
              "A", "F"]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=True)
    Site.model_validate_json(out)


# --------------------------------------------------------------------------- tuples and the names of a dict's keys
ITEM_LEAVES = [{"type": "integer"}, {"type": "string"}, {"type": "boolean"}, {"enum": ["a", "b"]}, {}]
ITEM_VALUES = [0, 7, "a", "b", "zz", True, None]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(ITEM_LEAVES), max_size=3), st.sampled_from([None, True, False, *ITEM_LEAVES[:3]]),
       st.sampled_from([None, 0, 1, 2, 3]), st.sampled_from([None, 0, 1, 2, 4]),
       st.lists(st.sampled_from(ITEM_VALUES), max_size=4), st.sampled_from([(",", ":"), (", ", ": ")]))
def test_prefix_items_are_kept_as_jsonschema_keeps_them(prefix, items, least, most, values, sep):
    """Arrays under ``prefixItems`` (a pydantic tuple's), with ``items`` missing, true, false or a schema and
    bounds on the count: the reader takes a document exactly when jsonschema does."""
    from kvcompile.structured import SchemaError, SchemaPrefix, check_schema

    array = {"type": "array", "prefixItems": prefix}
    for key, v in (("items", items), ("minItems", least), ("maxItems", most)):
        if v is not None:
            array[key] = v
    schema = {"type": "object", "properties": {"t": array}, "required": ["t"]}
    try:
        check_schema(schema)
    except SchemaError as e:
        assert "no value follows it" in str(e)
        assert all(not schema_valid({"t": values[:n]}, schema) for n in range(len(values) + 1))
        return
    doc = {"t": values}
    p = SchemaPrefix(schema)
    taken = p.feed_all(json.dumps(doc, separators=sep).encode()) and p.complete
    assert taken == schema_valid(doc, schema), (schema, doc)


NAME_RULES = [None, {"enum": ["a", "b", "x1"]}, {"$ref": "#/$defs/N"}, {"pattern": "^[a-c]+$"}, {"maxLength": 2},
              {"type": "string", "minLength": 2, "format": "date"}, {"const": "a"}]
NAME_POOL = ["a", "b", "c", "ab", "x1", "xyz", "2024-01-02", "é"]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(NAME_RULES), st.sampled_from([{}, {"a": {"type": "integer"}}, {"b": {}, "ab": {}}]),
       st.sampled_from([None, {"^x": {"type": "integer"}}, {"b$": {"type": "string"}}]),
       st.sampled_from([True, False, {"type": "string"}]), st.sampled_from([None, 1, 2]),
       st.sampled_from([None, 1, 2, 3]),
       st.dictionaries(st.sampled_from(NAME_POOL), st.sampled_from([1, "s", True]), max_size=4),
       st.sampled_from([(",", ":"), (", ", ": ")]))
def test_the_names_of_properties_are_kept_as_jsonschema_keeps_them(rule, props, patterns, extra, least, most, doc, sep):
    """Objects under ``propertyNames`` (an enum, a $ref to one, a pattern, lengths, a format, a const: what
    pydantic writes for a dict keyed by an enum, a Literal or a constrained string), ``patternProperties``,
    ``additionalProperties`` and ``minProperties`` / ``maxProperties``: the reader takes a document exactly when
    jsonschema does (with the format checked), or the schema is refused with what the reader does not follow."""
    import jsonschema

    from kvcompile.structured import SchemaError, SchemaPrefix, check_schema

    obj = {"type": "object", "properties": props, "additionalProperties": extra}
    for key, v in (("propertyNames", rule), ("patternProperties", patterns), ("minProperties", least),
                   ("maxProperties", most)):
        if v is not None:
            obj[key] = v
    schema = {"type": "object", "properties": {"o": obj}, "required": ["o"], "$defs": {"N": {"enum": ["b", "c"]}}}
    try:
        check_schema(schema)
    except SchemaError as e:
        assert re.search("also matches the patternProperties|properties beside patternProperties|no value follows",
                         str(e)), str(e)
        return
    whole = {"o": doc}
    p = SchemaPrefix(schema)
    taken = p.feed_all(json.dumps(whole, separators=sep, ensure_ascii=False).encode()) and p.complete
    assert taken == schema_valid(whole, schema, jsonschema.FormatChecker()), (schema, whole)


@pytest.mark.parametrize("seed", range(6))
def test_a_constrained_pick_under_tuples_and_keyed_dicts_parses_into_pydantic(seed):
    """Random walks under a model with tuples (prefixItems), dicts keyed by an enum, a Literal and a pattern
    (propertyNames, patternProperties), a dict with a bounded size, bytes, a Path, a secret and a deprecated
    field end in a reply pydantic takes."""
    import enum
    from pathlib import Path
    from typing import Literal

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field, SecretStr, constr

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Row(BaseModel):
        t: tuple[int, str, tuple[bool, int]]
        c: dict[Color, int]
        l: dict[Literal["x", "y"], int]  # noqa: E741
        p: dict[constr(pattern="^[a-z]+$", max_length=3), bool]
        n: dict[str, int] = Field(min_length=1, max_length=2)
        b: bytes
        f: Path
        s: SecretStr
        d: int = Field(deprecated=True)

    schema = to_strict_json_schema(Row)  # (what the openai client sends: no property beside the model's)
    pieces = ["{", "}", "[", "]", '"', ":", ",", '":', "red", "blue", "Z", "23", "-", "true", "false", "/", "é",
              *"abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab = [p.encode() for p in pieces] + [None]
    out = walk(JsonConstraint(vocab, len(vocab) - 1, schema=schema), vocab, seed, sampled=bool(seed % 2))
    Row.model_validate_json(out)
