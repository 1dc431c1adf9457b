"""JSON mode (``kvcompile.json_mode``, on llguidance), without a server: replies picked token by token under the
constraint -- greedy, sampled, and drawn by a seed -- from random scores, with SmolLM2's tokenizer (byte-level
BPE, 49,152 tokens) and a tiny tokenizer trained here, parse as JSON objects and validate against their schema
(``jsonschema``, formats by Python's own parsers, pydantic models by pydantic); documents are taken or refused
as JSON Schema says; a schema llguidance cannot follow is refused naming what it does not follow."""
from __future__ import annotations

import datetime
import ipaddress
import json
import math
import re
import uuid

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompile.json_mode import (MAX_SPACE, DeadEnd, JsonConstraint, SchemaError, _llguidance_reads, grammar,
                                 tokenizer_info)
from kvcompile.sampling import seeded_draw

TOKENIZERS = ["smol_tokenizer", "tiny_tokenizer"]
MODES = ["greedy", "sampled", "seeded"]


def constraint(tok, schema=None, vocab: int | None = None) -> JsonConstraint:
    return JsonConstraint(tokenizer_info(tok, vocab or len(tok), (tok.eos_token_id,)), grammar(schema))


def loads(text: str):
    """``json.loads`` without Python's NaN and Infinity, which are no JSON."""
    def refuse(c):
        raise ValueError(f"{c} is not JSON")

    return json.loads(text, parse_constant=refuse)


def pieces(tok, texts) -> list[int]:
    """The ids of the tokens that are exactly one of ``texts``."""
    ids = [tok(x, add_special_tokens=False).input_ids for x in texts]
    return [i[0] for i in ids if len(i) == 1]


def walk(tok, schema, seed: int, mode: str, steps: int = 800) -> str:
    """A reply picked under the constraint from random scores (at random steps the closing tokens, '"', '}', ']'
    and the end, pushed far up so that the walk ends): the argmax, a draw by torch's generator, or a draw by
    ``seeded_draw``, as the server's rows pick. Every token picked is one the constraint allowed. Its text, once
    the end token is picked."""
    c = constraint(tok, schema)
    g = torch.Generator().manual_seed(seed)
    eos, push = tok.eos_token_id, pieces(tok, ['"', "}", "]"]) + [tok.eos_token_id]
    taken = []
    for step in range(steps):
        scores = torch.randn(len(tok), generator=g) * 3
        if torch.rand((), generator=g) < 0.4:
            scores[push] += 40
        c.mask_(scores)
        if mode == "greedy":
            t = int(scores.argmax())
        else:
            probs = torch.softmax(scores, -1)
            t = int(torch.multinomial(probs, 1, generator=g)) if mode == "sampled" else seeded_draw(probs, seed, step)
        assert scores[t] > -torch.inf
        if t == eos:
            return tok.decode(taken, clean_up_tokenization_spaces=False)
        c.took(t)
        taken.append(t)
    pytest.fail(f"no end after {steps} tokens: {tok.decode(taken)!r}")


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_a_constrained_reply_is_one_json_object(tokenizer, mode, seed, request):
    """JSON mode without a schema: the reply is a JSON object (any values, any nesting), and once it is whole
    only an end token may follow."""
    tok = request.getfixturevalue(tokenizer)
    assert isinstance(loads(walk(tok, None, seed, mode)), dict)


def accepts(tok, schema, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` was allowed in turn, the document is then whole: an end token is allowed)."""
    c = constraint(tok, schema)
    for t in tok(text, add_special_tokens=False).input_ids:
        if not c.allowed()[t]:
            return False, False
        c.took(t)
    return True, bool(c.allowed()[tok.eos_token_id])


@pytest.mark.parametrize("text, prefix, whole", [
    ('{"a": [1, -2.5e3, true, null, "x\\n\\u00e9"], "b": {}}', True, True),
    ('{"a":1}', True, True),
    ("{}", True, True),
    ('{"a": {"b": [', True, False),
    ('{"a": "caf\u00e9 \u20ac', True, False),  # characters beyond ASCII, as they are
    ('{"a": 01}', False, False),
    ('{"a": 1,}', False, False),
    ("{a: 1}", False, False),
    ('{"a": tru}', False, False),
    ('{"a": "\x01"}', False, False),  # a control character is escaped in JSON
    ("[1]", False, False),  # JSON mode's document is an object
    (" {}", False, False),  # no whitespace around it
    ('{"a": NaN}', False, False),
    ('{"a":' + " " * MAX_SPACE + "1}", True, True),
    ('{"a":' + " " * (MAX_SPACE + 1) + "1}", False, False),  # whitespace runs are bounded
])
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_json_mode_takes_what_json_takes(tokenizer, text, prefix, whole, request):
    assert accepts(request.getfixturevalue(tokenizer), None, text) == (prefix, whole)


def test_an_end_token_that_is_ordinary_text_is_not_allowed_before_the_end(tiny_tokenizer):
    """A model whose end token is an ordinary token (its bytes could stand in a JSON string): picking it would end
    the reply mid-object, so it is allowed only once the object is whole."""
    end = tiny_tokenizer.convert_tokens_to_ids("a")
    c = JsonConstraint(tokenizer_info(tiny_tokenizer, len(tiny_tokenizer), (end,)), grammar())
    for t in tiny_tokenizer('{"x": "', add_special_tokens=False).input_ids:
        c.took(t)
    allowed = c.allowed()
    assert not allowed[end] and allowed[tiny_tokenizer.convert_tokens_to_ids("b")]
    for t in tiny_tokenizer('"}', add_special_tokens=False).input_ids:
        c.took(t)
    assert c.allowed().nonzero().flatten().tolist() == [end]


def test_ids_past_the_tokenizer_are_never_allowed(tiny_tokenizer):
    """A model's vocabulary may be larger than its tokenizer's (padded embeddings): those ids get -inf."""
    c = constraint(tiny_tokenizer, None, vocab=len(tiny_tokenizer) + 9)
    scores = torch.zeros(len(tiny_tokenizer) + 9)
    scores[len(tiny_tokenizer):] = 100.0
    c.mask_(scores)
    assert torch.isinf(scores[len(tiny_tokenizer):]).all() and int(scores.argmax()) < len(tiny_tokenizer)


# --------------------------------------------------------------------------- a JSON schema
# text of any character but those of planes 4 to 15 (U+40000 to U+FFFFF, unassigned or private use): llguidance
# 1.9.1's mask lets a token through that its parser then refuses where a property name or a const holds one (the
# request then fails with that error, test_a_token_llguidance_mis_masks_fails_the_request_naming_it)
texts = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=["Cs"]), max_size=5)
enum_values = st.one_of(texts, st.integers(-99, 99), st.booleans(), st.none(),
                        st.floats(allow_nan=False, allow_infinity=False))
bound_values = st.one_of(st.integers(-20, 20), st.sampled_from([0.5, -0.5, 1e-7, 2.0, 0.1]))
leaf_schemas = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "number", "integer", "boolean", "null")] + [{}]),
    st.lists(texts, min_size=1, max_size=3, unique=True).map(lambda e: {"type": "string", "enum": e}),
    st.lists(enum_values, min_size=1, max_size=3).map(lambda e: {"enum": e}),
    enum_values.map(lambda v: {"const": v, "title": "a const"}),
    st.lists(st.sampled_from(["string", "integer", "null", "boolean"]), min_size=2, max_size=2, unique=True)
    .map(lambda t: {"type": t}),
    # bounds: numbers' ranges, strings' lengths, patterns and formats, arrays' counts
    st.tuples(st.sampled_from(["integer", "number"]),
              st.dictionaries(st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
                              bound_values, max_size=2),
              st.sampled_from([{}, {"multipleOf": 2}, {"multipleOf": 5}, {"multipleOf": 0.5}, {"multipleOf": 0.1}]))
    .map(lambda t: {"type": t[0], **t[1], **t[2]}),
    st.tuples(st.integers(0, 3), st.integers(0, 4)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
    st.sampled_from(["^[a-c]{2,4}$", "^x+[0-9]?$", "^(ab|cd)*$", "^[A-Z][a-z]*$", "^[0-9]{3}-[0-9]{2}$"]).map(
        lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(["date", "time", "date-time", "uuid", "ipv4", "ipv6"]).map(
        lambda f: {"type": "string", "format": f}),
    st.tuples(st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": {"type": "integer"}, "minItems": t[0], "maxItems": t[0] + t[1]}))
TAGGED = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer", "maximum": 3}},
                     "required": ["kind", "n"], "additionalProperties": False},
                    {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}, "s": {"type": "string"}},
                     "required": ["kind"], "additionalProperties": False}],
          "discriminator": {"propertyName": "kind"}}


def _object_schema(children):
    return st.dictionaries(texts, children, max_size=4).flatmap(
        lambda props: st.tuples(st.just(props), st.lists(st.sampled_from(sorted(props)) if props else st.nothing(),
                                                         unique=True), st.booleans() | children)).map(
        lambda t: {"type": "object", "properties": t[0], "required": t[1], "additionalProperties": t[2]})


def _nested(leaves, max_leaves):
    return st.recursive(leaves, lambda inner: _object_schema(inner) | inner.map(
        lambda i: {"type": "array", "items": i}) | st.lists(inner, min_size=1, max_size=3).map(
        lambda alts: {"anyOf": alts, "description": "one of"}), max_leaves=max_leaves)


@st.composite
def schemas(draw):
    """An object schema of the keywords llguidance follows, in any nesting, with a definition ``D`` that its
    parts may point to (``$ref``) and a oneOf told apart by a tag."""
    definition = draw(_nested(leaf_schemas | st.just(TAGGED), 4))
    schema = draw(_object_schema(_nested(leaf_schemas | st.just({"$ref": "#/$defs/D"}), 6)))
    return {**schema, "$defs": {"D": definition}}


def _date(t: str) -> bool:
    return bool(re.fullmatch(r"\d{4}-\d\d-\d\d", t)) and _parses(datetime.date.fromisoformat, t)


def _time(t: str) -> bool:
    m = re.fullmatch(r"(\d\d:\d\d:\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)", t)
    return bool(m) and _parses(datetime.time.fromisoformat, m[1] + (m[2] or "")[:7])


def _parses(parse, text: str) -> bool:
    try:
        parse(text)
    except ValueError:
        return False
    return True


# the formats as RFC 3339 and 4122 and Python's ipaddress read them, checked by Python's parsers
FORMATS = {"date": _date, "time": _time,
           "date-time": lambda t: len(t) > 11 and t[10] in "Tt" and _date(t[:10]) and _time(t[11:]),
           "uuid": lambda t: len(t) == 36 and _parses(uuid.UUID, t),
           "ipv4": lambda t: _parses(ipaddress.IPv4Address, t), "ipv6": lambda t: _parses(ipaddress.IPv6Address, t)}


def validate(doc, schema) -> None:
    """``jsonschema``'s verdict, formats checked (``FORMATS``)."""
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    for name, ok in FORMATS.items():
        checker.checks(name)(lambda t, ok=ok: not isinstance(t, str) or ok(t))
    jsonschema.Draft202012Validator(schema, format_checker=checker).validate(doc)


@given(schemas(), st.integers(0, 2**16), st.sampled_from(MODES))
def test_a_reply_under_a_drawn_schema_validates(smol_tokenizer, schema, seed, mode):
    """Schemas of types, enums and consts of any JSON scalar, anyOf, a tagged oneOf, $ref, additional properties
    of a schema, numbers' bounds and multiples, strings' lengths, patterns and formats, arrays' counts, in any
    nesting: a reply picked under one validates against it (or llguidance finds that no document does)."""
    try:
        grammar(schema)
    except SchemaError as e:  # a part whose enum, const, type and bounds leave no value, which is required; or
        assert "nsatisfiable" in str(e) or refused_for_a_number(e, schema), e  # a number llguidance misreads
        return
    validate(loads(walk(smol_tokenizer, schema, seed, mode)), schema)


@given(schemas(), st.integers(0, 2**16), st.sampled_from(MODES))
def test_a_reply_under_a_drawn_schema_validates_with_a_tiny_tokenizer(tiny_tokenizer, schema, seed, mode):
    try:
        grammar(schema)
    except SchemaError as e:
        assert "nsatisfiable" in str(e) or refused_for_a_number(e, schema), e
        return
    validate(loads(walk(tiny_tokenizer, schema, seed, mode)), schema)


PET = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
       "properties": {"name": {"type": "string", "enum": ["cat", "dog"]}, "age": {"type": "integer"},
                      "tags": {"type": "array", "items": {"type": "string"}}, "weight": {"type": ["number", "null"]},
                      "vet": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                              "additionalProperties": False}}}


@pytest.mark.parametrize("text, prefix, whole", [
    ('{"name":"cat","age":3,"tags":["a"],"weight":null,"vet":{"ok":true}}', True, True),
    ('{"name": "dog", "age": 12}', True, True),
    ('{"name":"cat","age":-0,"weight":1.5e-3}', True, True),
    ('{"name":"cow","age":3}', False, False),  # no enum value
    ('{"nam":1}', False, False),
    ('{"name":"cat","age":3.5}', False, False),  # an integer has no fraction
    ('{"name":"cat"}', False, False),  # "age" is required
    ('{"name":"cat","age":3,"zz":1}', False, False),  # no other names
    ('{"name":"cat","name":"dog","age":1}', False, False),  # a name once
    ('{"name":"cat","age":3,"tags":[1]}', False, False),
    ('{"name":"cat","age":3,"vet":{}}', False, False),
    ('{"name":1}', False, False),
    # llguidance writes the properties in the schema's order: a document in another order, which the schema
    # takes, is not written (docs/usage.md says so)
    ('{"age":3,"name":"cat"}', False, False),
])
def test_a_schema_takes_what_jsonschema_takes(smol_tokenizer, text, prefix, whole):
    """Documents against a schema of an enum, a required integer, optional arrays, a nullable number and a nested
    object, written by hand; each valid one is checked with ``jsonschema`` too."""
    if whole:
        validate(loads(text), PET)
    assert accepts(smol_tokenizer, PET, text) == (prefix, whole)


def llguidance_echo(number) -> float | int:
    """The number llguidance's own reader makes of ``number`` (it writes back a schema it was given options
    for)."""
    from llguidance import LLMatcher

    out = LLMatcher.grammar_from_json_schema(json.dumps({"const": number}), overrides={"lenient": False})
    return json.loads(out)["grammars"][0]["json_schema"]["const"]


@given(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**63, 2**64 - 1)
       | st.floats(-1e6, 1e6).map(lambda x: round(x, 7)))
def test_the_model_of_llguidances_number_reader_is_its_reader(number):
    assert _llguidance_reads(json.dumps(number)) == llguidance_echo(number)


@pytest.mark.parametrize("value", [1801439850948199.0, 0.30000000000000004, 2.0, -0.5, 2**53, -2.0**53, 1e-300])
def test_a_const_number_is_followed_to_its_last_digit(smol_tokenizer, value):
    """A const is the number written, not one a step away: llguidance reads 1801439850948199.0 as
    1801439850948199.25, so an integral one goes to it as an integer; 0.30000000000000004 it reads exactly."""
    schema = {"type": "object", "properties": {"a": {"const": value}}, "required": ["a"],
              "additionalProperties": False}
    assert loads(walk(smol_tokenizer, schema, 0, "greedy")) == {"a": value}
    if isinstance(value, float) and not value.is_integer():
        assert accepts(smol_tokenizer, schema, json.dumps({"a": math.nextafter(value, math.inf)}))[1] is False
        assert accepts(smol_tokenizer, schema, json.dumps({"a": math.nextafter(value, -math.inf)}))[1] is False


@pytest.mark.parametrize("value, read", [(123456789012345.67, 123456789012345.69),
                                         (-2.5e-308, -2.5000000000000003e-308)])
def test_a_number_llguidance_would_read_as_another_is_refused(value, read):
    """Where llguidance would follow another number than the schema's, the schema is refused, saying which
    number, where, what it would be read as, and a rounding that is read exactly."""
    assert llguidance_echo(value) == read != value
    schema = {"type": "object", "properties": {"x": {"type": "number", "maximum": 1, "enum": [0, value]}}}
    with pytest.raises(SchemaError, match=rf"the number {re.escape(repr(value))} at schema\['properties'\]\['x'\]"
                                          rf"\['enum'\]\[1\] would be read by llguidance .* as {re.escape(repr(read))}"):
        grammar(schema)
    rounded = float(_suggestion(schema))
    assert llguidance_echo(rounded) == rounded and abs(rounded - value) <= abs(value) * 1e-14 + 1e-300
    grammar({**schema, "properties": {"x": {"enum": [0, rounded]}}})


@pytest.mark.parametrize("value", [2**53 + 1, 2**63 + 1, 1e300, -2.0**60])
def test_a_const_beyond_2_53_is_refused(value):
    """llguidance writes a const or enum number through a double, as integer digits: 2**63 + 1 as
    9223372036854776000, 1e300 as 1 and 300 zeros (another number than the double 1e300). Refused."""
    with pytest.raises(SchemaError, match=r"a const or enum takes numbers up to 2\*\*53"):
        grammar({"type": "object", "properties": {"a": {"const": value}}})


def _suggestion(schema) -> str:
    try:
        grammar(schema)
    except SchemaError as e:
        return re.search(r"\(to (\S+), for instance\)", str(e))[1]
    raise AssertionError("not refused")


def refused_for_a_number(e: SchemaError, schema) -> bool:
    """``e`` refuses a number of ``schema`` that llguidance does read as another, or a whole one beyond 2**53
    that replies would write."""
    m = re.match(r"the number (\S+) at schema", str(e))
    if not (m and m[1] in json.dumps(schema) + repr(schema)):
        return False
    x = float(m[1])
    return llguidance_echo(x) != x or ("const or enum takes numbers up to 2**53" in str(e) and x.is_integer()
                                       and abs(x) > 2**53)


BOUNDED = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": -5, "exclusiveMaximum": 120},
    "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "s": {"type": "string", "minLength": 2, "maxLength": 3},
    "a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
    "d": {"type": "string", "format": "date"}, "c": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "m": {"type": "integer", "multipleOf": 5}, "u": {"type": "string", "format": "uuid"}, "pet": TAGGED,
    "t": {"type": "string", "format": "date-time"}, "w": {"type": "string", "format": "date", "pattern": "^2"}}}


@pytest.mark.parametrize("text, ok", [
    ('{"n":-5,"x":1,"s":"ab","a":[1,2],"d":"2024-02-29","c":"ABC","m":-15,'
     '"u":"0f8fad5b-d9cb-469f-a165-70867728950e","pet":{"kind":"a","n":3}}', True),
    ('{"n":119}', True), ('{"x":0.000001}', True), ('{"s":"a\\nb"}', True), ('{"pet":{"kind":"c","s":"x"}}', True),
    ('{"n":120}', False), ('{"n":-6}', False), ('{"n":5.5}', False),
    ('{"x":0}', False), ('{"x":1.01}', False), ('{"x":-0.5}', False),
    ('{"s":"a"}', False), ('{"s":"abcd"}', False),
    ('{"a":[]}', False), ('{"a":[1,2,3]}', False),
    ('{"d":"2023-02-29"}', False), ('{"d":"2023-13-01"}', False), ('{"d":"2023-1-01"}', False),
    ('{"c":"ABCD"}', False), ('{"c":"AbC"}', False),
    ('{"m":7}', False), ('{"u":"0f8fad5bd9cb"}', False),
    ('{"pet":{"kind":"a","n":4}}', False), ('{"pet":{"kind":"d"}}', False), ('{"pet":{"kind":"a"}}', False),
    # dates as pydantic and Python read them: real days of years 0001 to 9999, seconds 00 to 59 (RFC 3339 also
    # allows a leap second, 60, and the year 0000, which they refuse)
    ('{"t":"2024-02-29t23:59:59.123456789+05:30"}', True), ('{"t":"2024-01-01T10:00:60Z"}', False),
    ('{"d":"2000-02-29"}', True), ('{"d":"1900-02-29"}', False), ('{"d":"0000-01-01"}', False),
    ('{"w":"2024-02-29"}', True), ('{"w":"2023-02-29"}', False), ('{"w":"1024-02-29"}', False),  # and a pattern
])
def test_bounds_are_kept_as_jsonschema_keeps_them(smol_tokenizer, text, ok):
    """Numbers' ranges and multiples, strings' lengths, a pattern and formats, an array's counts and a oneOf
    told apart by a tag: a document is whole exactly when ``jsonschema`` (with the formats' parsers) takes it."""
    import jsonschema

    try:
        validate(loads(text), BOUNDED)
        valid = True
    except jsonschema.ValidationError:
        valid = False
    assert valid == ok
    assert accepts(smol_tokenizer, BOUNDED, text)[1] == ok


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"type": "object", "not": {"required": ["a"]}}, '"not"'),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"type": "integer"}}}}, "contains"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if"'),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "idn-email"}}}, "idn-email"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "ipvanyaddress"}}}, "ipvanyaddress"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)ab$"}}}, "look-around"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}}},
     "oneOf"),  # alternatives that overlap: oneOf is not anyOf
    ({"type": "object", "properties": {"a": {}}, "maxProperties": 1}, "maxProperties"),
    ({"type": "object", "patternProperties": {"^a": {}, "^ab": {}}}, "not disjoint"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}, "/$defs/B"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "https://example.com/s.json"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}, "required": ["a"]},
     "nsatisfiable"),
    ({"type": "object", "x-guidance": {"lenient": True}, "not": {}}, "x-guidance"),
    # not JSON Schema 2020-12, which llguidance would read as something else: the meta-schema check refuses them
    ({"type": "object", "properties": {"a": {"minimum": 0, "exclusiveMinimum": True}}},
     "at schema['properties']['a']['exclusiveMinimum']: True is not of type 'number'"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": [{"type": "string"}]}}},
     "schema['properties']['a']['items']"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0}}}, "multipleOf"),
    ({"type": "object", "properties": {"a": {"maxLength": -1}}}, "maxLength"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "'text' is not valid"),
    ({"type": "object", "required": "a"}, "required"),
])
def test_a_schema_llguidance_does_not_follow_is_refused_naming_what(schema, named):
    """Never followed loosely: an unimplemented keyword or format is refused (llguidance's ``lenient`` off, and
    a schema's own "x-guidance" refused), and so is a schema that is not valid JSON Schema."""
    with pytest.raises(SchemaError, match=re.escape(named)):
        grammar(schema)


def test_dates_are_kept_to_real_days_wherever_they_stand(smol_tokenizer):
    """The exact-date pattern goes beside every date format, a property's named "enum" or "format" included, and
    never into a const's or an enum's values (data: a const object is written as it is)."""
    day = {"type": "string", "format": "date"}
    schema = {"type": "object", "properties": {"enum": day, "format": {"type": "array", "items": day},
                                               "c": {"const": {"format": "date"}}},
              "$defs": {"D": day}, "additionalProperties": {"$ref": "#/$defs/D"}}
    for text, whole in (('{"enum":"2024-02-29"}', True), ('{"enum":"2023-02-29"}', False),
                        ('{"format":["2023-02-29"]}', False), ('{"x":"2023-02-29"}', False),
                        ('{"c":{"format":"date"}}', True)):
        assert accepts(smol_tokenizer, schema, text)[1] == whole, text


def test_a_schema_is_a_json_object_of_text_utf_8_can_write():
    with pytest.raises(SchemaError, match="must be a JSON object, got list"):
        grammar([{"type": "object"}])
    with pytest.raises(SchemaError, match="half of a surrogate pair"):  # what '"\\ud800"' in a request's JSON reads as
        grammar(json.loads('{"type": "object", "properties": {"\\ud800": {}}}'))


@pytest.mark.parametrize("model", ["pet_model", "bounded_model"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(2))
def test_a_reply_under_a_pydantic_models_schema_parses_into_the_model(smol_tokenizer, model, mode, seed, request):
    """The schema the openai client sends for a pydantic model (``client.chat.completions.parse``: nested models
    as $defs and $ref, Optional fields, Literals and enums, a dict; numbers with ge / lt, lengths, a pattern, a
    date, a datetime, a UUID, a discriminated union, a multiple): a reply parses into the model."""
    from openai.lib._pydantic import to_strict_json_schema

    cls = request.getfixturevalue(model)
    assert isinstance(cls.model_validate_json(walk(smol_tokenizer, to_strict_json_schema(cls), seed, mode)), cls)


def test_a_token_the_constraint_did_not_allow_is_an_error(tiny_tokenizer):
    c = constraint(tiny_tokenizer, {"type": "object", "properties": {"z": {"const": "x"}}, "required": ["z"]})
    for t in tiny_tokenizer('{"z":"', add_special_tokens=False).input_ids:
        c.took(t)
    assert c.allowed().nonzero().flatten().tolist() == [tiny_tokenizer.convert_tokens_to_ids("x")]
    with pytest.raises(DeadEnd, match="does not continue the reply"):
        c.took(tiny_tokenizer.convert_tokens_to_ids("a"))


def test_a_vocabulary_that_cannot_write_what_the_schema_needs_fails_the_request_naming_it():
    """A vocabulary without some byte as a token (here no token holds "Z") cannot write what the schema needs:
    llguidance's mask then lets a closing quote through, and taking it is an error that says so (the server fails
    that request with it: ``sampling.guarded``) rather than a reply that breaks the schema. (Byte-level
    vocabularies, SmolLM2's and the tiny one above, hold every byte.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(['{"z": "a b"}'] * 5, trainers.BpeTrainer(vocab_size=60, special_tokens=["<|end|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end|>")
    assert "Z" not in "".join(tok.get_vocab())
    with pytest.raises(DeadEnd, match="forced bytes: got 'Z'"):
        walk(tok, {"type": "object", "properties": {"z": {"const": "Z"}}, "required": ["z"]}, 0, "greedy")


def test_a_token_llguidance_mis_masks_fails_the_request_naming_it(smol_tokenizer):
    """llguidance 1.9.1 lets a token through its mask that its parser refuses, where a property name or a const
    holds a character of planes 4 to 15 (U+40000 to U+FFFFF): taking it is an error (the request fails with it),
    never a reply that breaks the schema. (docs/usage.md lists it; characters of the first four planes, emoji
    included, are written.)"""
    with pytest.raises(DeadEnd, match="doesn't satisfy the grammar"):
        walk(smol_tokenizer, {"type": "object", "properties": {"a": {"const": "\U00040000"}}, "required": ["a"]},
             0, "greedy")
    text = walk(smol_tokenizer, {"type": "object", "properties": {"a": {"const": "\U0001F600"}}, "required": ["a"]},
                0, "greedy")
    assert loads(text) == {"a": "\U0001F600"}
