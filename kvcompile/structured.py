"""JSON mode for ``kvcompile serve`` (OpenAI's ``response_format: {"type": "json_object"}``, and ``"json_schema"``
with a schema): every token a request generates keeps its reply a prefix of one JSON object (that follows the
schema: ``SchemaPrefix``), and once the object is closed the reply ends.

``JsonPrefix`` reads a reply byte by byte (RFC 8259, UTF-8, the top level an object, runs of whitespace
between tokens of at most ``MAX_SPACE`` bytes so that a model cannot pad forever); ``JsonConstraint`` holds a
request's prefix and the vocabulary's bytes, and picks each token (``pick``): the most likely token that keeps
the prefix, or a draw from the distribution restricted to those tokens, and the end-of-sequence token once the
object is complete. The processor list that picks every row's token (``kvcompile.sampling``) calls it.
"""
from __future__ import annotations

import json

import torch

MAX_SPACE = 12  # whitespace bytes in a row (a newline and the indentation of five levels of two spaces)
WS = frozenset(b" \t\n\r")
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_ESCAPES = frozenset(b'"\\/bfnrtu')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
# a number's states (after "-", a leading "0", more digits, ".", the fraction, "e", its sign, the exponent) and
# where each kind of byte leads: "0", other digits "d", "." , "e" (or "E"), "+" (or "-"); the states a number may
# end in
_NUMBER = {"-": {"0": "0", "d": "int"}, "0": {".": ".", "e": "e"}, "int": {"d": "int", ".": ".", "e": "e"},
           ".": {"d": "frac"}, "frac": {"d": "frac", "e": "e"}, "e": {"+": "esign", "d": "exp"},
           "esign": {"d": "exp"}, "exp": {"d": "exp"}}
_NUMBER_BYTES = {ord("."): ".", ord("e"): "e", ord("E"): "e", ord("+"): "+", ord("-"): "+"}
_NUMBER_ENDS = frozenset({"0", "int", "frac", "exp"})

# where the reader is
VALUE, KEY_OR_CLOSE, KEY, COLON, AFTER, VALUE_OR_CLOSE, STRING, NUMBER, LITERAL, DONE, START = range(11)


class JsonPrefix:
    """A reader of a JSON object's bytes that says, byte by byte, whether the bytes so far begin one
    (``feed``) and whether they are one whole (``complete``). Its state is a few small fields; ``copy`` is
    cheap, to try a token's bytes and keep the state only if all of them fit."""

    __slots__ = ("mode", "stack", "space", "key", "esc", "hex", "utf8", "num", "lit")

    def __init__(self):
        self.mode, self.stack, self.space = START, [], 0
        self.key = False  # the string being read is an object's key
        self.esc, self.hex, self.utf8 = False, 0, 0  # after a backslash; \u digits to come; continuation bytes
        self.num = ""  # where a number is: "-", "0", "int", ".", "frac", "e", "esign", "exp"
        self.lit = b""  # bytes of a literal still to come

    def copy(self) -> JsonPrefix:
        out = type(self).__new__(type(self))
        out.mode, out.stack, out.space, out.key = self.mode, list(self.stack), self.space, self.key
        out.esc, out.hex, out.utf8, out.num, out.lit = self.esc, self.hex, self.utf8, self.num, self.lit
        return out

    @property
    def complete(self) -> bool:
        return self.mode == DONE

    def feed_all(self, data: bytes) -> bool:
        return all(self.feed(b) for b in data)

    def feed(self, b: int) -> bool:
        """Read one byte; False when the bytes no longer begin a JSON object (the state is then undefined:
        ``feed`` a copy)."""
        m = self.mode
        if m == STRING:
            return self._string(b)
        if m == NUMBER:
            ok, done = self._number(b)
            if not done:
                return ok
            self.mode = AFTER  # the number ended before this byte, which is read after it
            m = AFTER
        if m == LITERAL:
            if b != self.lit[0]:
                return False
            self.lit = self.lit[1:]
            if not self.lit:
                self.mode = AFTER
            return True
        if b in WS:
            if m in (START, DONE):
                return False
            self.space += 1
            return self.space <= MAX_SPACE
        self.space = 0
        if m == START:
            if b != ord("{"):
                return False
            self.stack.append("o")
            self.mode = KEY_OR_CLOSE
            return True
        if m == DONE:
            return False
        if m in (KEY_OR_CLOSE, KEY):
            if b == ord('"'):
                self.mode, self.key = STRING, True
                return True
            if b == ord("}") and m == KEY_OR_CLOSE:
                return self._close("o")
            return False
        if m == COLON:
            if b == ord(":"):
                self.mode = VALUE
                return True
            return False
        if m == AFTER:
            top = self.stack[-1]
            if b == ord(","):
                self.mode = KEY if top == "o" else VALUE
                return True
            if b == ord("}" if top == "o" else "]"):
                return self._close(top)
            return False
        # VALUE or VALUE_OR_CLOSE
        if b == ord("]") and m == VALUE_OR_CLOSE:
            return self._close("a")
        return self._value(b)

    def _close(self, kind: str) -> bool:
        if not self.stack or self.stack[-1] != kind:
            return False
        self.stack.pop()
        self.mode = AFTER if self.stack else DONE
        return True

    def _value(self, b: int) -> bool:
        if b == ord("{"):
            self.stack.append("o")
            self.mode = KEY_OR_CLOSE
        elif b == ord("["):
            self.stack.append("a")
            self.mode = VALUE_OR_CLOSE
        elif b == ord('"'):
            self.mode, self.key = STRING, False
        elif b in _LITERALS:
            self.mode, self.lit = LITERAL, _LITERALS[b]
        elif b == ord("-"):
            self.mode, self.num = NUMBER, "-"
        elif b in _DIGITS:
            self.mode, self.num = NUMBER, "0" if b == ord("0") else "int"
        else:
            return False
        return True

    def _string(self, b: int) -> bool:
        if self.utf8:
            if b & 0xC0 != 0x80:
                return False
            self.utf8 -= 1
            return True
        if self.hex:
            if b not in _HEX:
                return False
            self.hex -= 1
            return True
        if self.esc:
            if b not in _ESCAPES:
                return False
            self.esc = False
            self.hex = 4 if b == ord("u") else 0
            return True
        if b == ord('"'):
            self.mode = COLON if self.key else AFTER
            return True
        if b == ord("\\"):
            self.esc = True
            return True
        if b < 0x20:
            return False  # control characters are escaped in JSON strings
        if b < 0x80:
            return True
        # the lead byte of a UTF-8 sequence (no overlong two-byte leads, nothing past U+10FFFF)
        if 0xC2 <= b <= 0xDF:
            self.utf8 = 1
        elif 0xE0 <= b <= 0xEF:
            self.utf8 = 2
        elif 0xF0 <= b <= 0xF4:
            self.utf8 = 3
        else:
            return False
        return True

    def _number(self, b: int) -> tuple[bool, bool]:
        """(whether the byte fits, whether the number ended before it)."""
        kind = ("0" if b == ord("0") else "d") if b in _DIGITS else _NUMBER_BYTES.get(b)
        nxt = _NUMBER[self.num].get(kind) or (_NUMBER[self.num].get("d") if kind == "0" else None)
        if nxt is not None:
            self.num = nxt
            return True, False
        if self.num in _NUMBER_ENDS and kind not in ("0", "d"):
            return True, True
        return False, False  # a number cut short, or a digit after a leading 0


# --------------------------------------------------------------------------- a JSON schema
SCHEMA_KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf",
                   "$ref", "$defs", "definitions"}
SCHEMA_NOTES = {"title", "description", "default", "examples", "$schema", "$comment", "$id"}  # read by people only
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class SchemaError(ValueError):
    """A JSON schema the reader does not follow: what, where, and what it does follow."""


def _type_of(value) -> str | None:
    """The JSON type of a scalar ``enum`` or ``const`` value as ``json.dumps`` writes it (a Python int is an
    "integer"; a float, written with a fraction or exponent, a "number"); None for an object or array."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return "number"
    return "string" if isinstance(value, str) else None


class _Schema:
    """A whole schema (``root``, where ``$ref`` pointers lead) and each of its subschemas' alternatives
    (``alternatives``), worked out once."""

    def __init__(self, root: dict):
        self.root, self.memo = root, {}

    def resolve(self, schema: dict, at: str = "schema") -> dict:
        """``schema``, or where its ``$ref`` chain leads ("#", "#/$defs/Name", "#/definitions/Name" or any
        other JSON pointer into the root)."""
        seen = []
        while "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                raise SchemaError(f"{at}.$ref must point into this schema (\"#/$defs/Name\"), got {ref!r}")
            if ref in seen:
                raise SchemaError(f"{at}.$ref: {ref!r} leads back to itself")
            seen.append(ref)
            node = self.root
            for part in ref[2:].split("/") if ref != "#" else ():
                part = part.replace("~1", "/").replace("~0", "~")
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                raise SchemaError(f"{at}.$ref: {ref!r} names no schema here")
            schema = node
        return schema

    def alternatives(self, schema: dict, at: str = "schema", _seen=()) -> tuple:
        """The schemas a value of ``schema`` may follow, each plain (no ``$ref`` or ``anyOf``; an ``enum`` of
        strings only; a non-string ``enum`` or ``const`` value as the bytes ``json.dumps`` writes it, under the
        internal key ``"_literal"``). A value follows ``schema`` when it follows one of them."""
        key = id(schema)
        if key in self.memo:
            return self.memo[key]
        if key in _seen:
            raise SchemaError(f"{at}: its anyOf leads back to itself before any value begins")
        s = self.resolve(schema, at)
        if "anyOf" in s:
            out = tuple(alt for i, a in enumerate(s["anyOf"])
                        for alt in self.alternatives(a, f"{at}.anyOf[{i}]", (*_seen, key)))
        elif "enum" in s or "const" in s:
            values = [s["const"]] if "const" in s else list(s["enum"])
            if "enum" in s and "const" in s:
                values = [v for v in values if v in s["enum"]]
            allowed = _types(s) if "type" in s else frozenset(TYPES)
            values = [v for v in values if _type_of(v) in allowed or (_type_of(v) == "integer" and "number" in allowed)]
            strings = [v for v in values if isinstance(v, str)]
            plain = {k: v for k, v in s.items() if k not in ("enum", "const", "type")}
            out = ((({**plain, "type": "string", "enum": strings},) if strings else ())
                   + tuple({"type": _type_of(v), "_literal": json.dumps(v).encode()}
                           for v in values if not isinstance(v, str)))
        else:
            out = (s,)
        if not out:
            raise SchemaError(f"{at}: no value follows it (its enum, const and type leave nothing)")
        self.memo[key] = out
        return out


def check_schema(schema, at: str = "schema") -> None:
    """Refuse (``SchemaError``) what ``SchemaPrefix`` does not follow. It reads ``type`` (one or a list of the
    JSON types), ``properties``, ``required``, ``additionalProperties`` (true, false or a schema), ``items``,
    ``enum`` and ``const`` (of strings, numbers, booleans and null), ``anyOf``, and ``$ref`` into the schema
    (``$defs``, ``definitions``) -- what OpenAI's strict structured outputs and pydantic's schemas use, but for
    the keywords that bound a value (``pattern``, ``format``, ``minimum``, ``maxLength``, ...) -- and ignores
    titles, descriptions and defaults; the top level is an object. An enum or const value is written as
    ``json.dumps`` writes it (a reply may not spell the const 1 as 1.0 or 1e0)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{at} must be a JSON schema object, got {type(schema).__name__}")
    whole, nodes = _Schema(schema), []
    _check(whole, schema, at, nodes)
    for defs in ("$defs", "definitions"):
        for name, sub in (schema.get(defs) or {}).items():
            _check(whole, sub, f"{at}.{defs}.{name}", nodes)
    for sub, where in nodes:  # once every part is known to be well formed
        whole.alternatives(sub, where)  # a $ref that leads nowhere, an anyOf that loops, nothing to write: refused
    for alt in whole.alternatives(schema, at):
        if _types(alt) != {"object"}:
            raise SchemaError(f"{at}: the top level must be {{\"type\": \"object\", ...}}")


def _check(whole: _Schema, schema, at: str, nodes: list) -> None:
    """The form of ``schema`` and its parts (each added to ``nodes`` with where it stands)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{at} must be a JSON schema object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - SCHEMA_KEYWORDS - SCHEMA_NOTES)
    if unknown:
        raise SchemaError(f"{at}: the keyword {unknown[0]!r} is not followed here (followed: "
                          f"{', '.join(sorted(SCHEMA_KEYWORDS))}, in any nesting)")
    for one in ("$ref", "anyOf"):
        others = sorted(set(schema) - SCHEMA_NOTES - {one, "$defs", "definitions"})
        if one in schema and others:
            raise SchemaError(f"{at}: {one} stands beside {others[0]!r}; write the two as one schema (keywords "
                              f"beside {one} are followed only when they are titles, descriptions or defaults)")
    for defs in ("$defs", "definitions"):
        if defs in schema and not (isinstance(schema[defs], dict) and at == "schema"):
            raise SchemaError(f"{at}.{defs} must map names to schemas, at the top level of the schema")
    nodes.append((schema, at))
    if "anyOf" in schema:
        if not isinstance(schema["anyOf"], list) or not schema["anyOf"]:
            raise SchemaError(f"{at}.anyOf must be a non-empty list of schemas")
        for i, alt in enumerate(schema["anyOf"]):
            _check(whole, alt, f"{at}.anyOf[{i}]", nodes)
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if types is not None and (not isinstance(types, list) or not types or any(t not in TYPES for t in types)):
        raise SchemaError(f"{at}.type must be one of {', '.join(TYPES)} or a list of them, got {schema['type']!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(k, str) for k in props):
        raise SchemaError(f"{at}.properties must map names to schemas")
    for k, v in props.items():
        _check(whole, v, f"{at}.properties.{k}", nodes)
    req = schema.get("required", [])
    if not isinstance(req, list) or any(r not in props for r in req):
        raise SchemaError(f"{at}.required must list names of its properties, got {req!r}")
    extra = schema.get("additionalProperties", True)
    if isinstance(extra, dict):
        _check(whole, extra, f"{at}.additionalProperties", nodes)
    elif not isinstance(extra, bool):
        raise SchemaError(f"{at}.additionalProperties must be true, false or a schema")
    if "items" in schema:
        _check(whole, schema["items"], f"{at}.items", nodes)
    enum = schema.get("enum")
    if enum is not None and not (isinstance(enum, list) and enum):
        raise SchemaError(f"{at}.enum must be a non-empty list")
    for v in [*(enum or ()), *([schema["const"]] if "const" in schema else ())]:
        if _type_of(v) is None:
            raise SchemaError(f"{at}: enum and const values must be strings, numbers, booleans or null, got {v!r}")


def _encoded(text: str) -> bytes:
    """A string's bytes between the quotes of its JSON text (as ``json.dumps`` writes it, UTF-8 as it is)."""
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


def _types(schema: dict) -> frozenset:
    t = schema.get("type")
    if t is None:
        return frozenset(TYPES) if "enum" not in schema else frozenset({"string"})
    return frozenset([t] if isinstance(t, str) else t)


_FIRST = {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean", ord("f"): "boolean",
          ord("n"): "null"}


class SchemaPrefix:
    """A reader of a JSON object's bytes that also follows a JSON schema (``check_schema`` says which keywords):
    every value's type, an object's property names (listed ones, once each; others only where
    ``additionalProperties`` is not false, and following it when it is a schema) and its required ones before it
    closes, an array's items, an enum's or a const's value, an integer's lack of a fraction or exponent, each
    ``anyOf`` alternative at once. The same interface as ``JsonPrefix`` (``feed``, ``feed_all``, ``complete``,
    ``copy``). Strings and values that a schema names (property names, enum values) are read as ``json.dumps``
    writes them, escapes included.

    It holds a reader per alternative the bytes so far still follow (``_Branch``; an ``anyOf`` at the next
    value splits one into several), dropping a reader at the first byte its alternative refuses and merging
    readers that come to the same state."""

    __slots__ = ("branches",)

    def __init__(self, schema: dict):
        first = _Branch(_Schema(schema))
        first.set_expect(schema)
        self.branches = first.split()

    def copy(self) -> SchemaPrefix:
        out = SchemaPrefix.__new__(SchemaPrefix)
        out.branches = [b.copy() for b in self.branches]
        return out

    @property
    def complete(self) -> bool:
        return any(b.complete for b in self.branches)

    def feed_all(self, data: bytes) -> bool:
        return all(self.feed(b) for b in data)

    def feed(self, b: int) -> bool:
        """Read one byte; False when no alternative takes it (the state is then undefined: ``feed`` a copy)."""
        if len(self.branches) == 1:
            one = self.branches[0]
            if not one.feed(b):
                return False
            if not one.flat:
                self.branches = one.split()
            return True
        kept = {}
        for branch in self.branches:
            if branch.feed(b):
                for c in (branch.split() if not branch.flat else (branch,)):
                    kept.setdefault(c.state(), c)
        self.branches = list(kept.values())
        return bool(self.branches)


class _Branch(JsonPrefix):
    """One alternative's reader: a ``JsonPrefix`` that follows plain schemas (``_Schema.alternatives``); each
    schema it comes to next (``set_expect``) is split into its alternatives by ``SchemaPrefix``."""

    __slots__ = ("whole", "frames", "expect", "flat", "buf", "str_enum", "int_only", "const")

    def __init__(self, whole: _Schema):
        super().__init__()
        self.whole = whole
        self.frames = ()  # per open container: ("o", schema, used names, the current name) or ("a", schema)
        self.expect, self.flat = None, True  # the schema of the next value; whether it is plain
        self.buf = b""  # the string being read, as written
        self.str_enum = None  # the encoded strings it may be (None: any)
        self.int_only = False  # the number being read is an integer
        self.const = None  # the bytes still to come of a non-string enum or const value being read

    def copy(self) -> _Branch:
        out = super().copy()
        out.whole, out.frames, out.expect, out.flat = self.whole, self.frames, self.expect, self.flat
        out.buf, out.str_enum, out.int_only, out.const = self.buf, self.str_enum, self.int_only, self.const
        return out

    def set_expect(self, schema: dict) -> None:
        self.expect, self.flat = schema, False

    def split(self) -> list[_Branch]:
        """One reader per alternative of the schema expected next."""
        alts = self.whole.alternatives(self.expect)
        out = [self] + [self.copy() for _ in alts[1:]]
        for branch, alt in zip(out, alts):
            branch.expect, branch.flat = alt, True
        return out

    def state(self) -> tuple:
        """What the reader will take from here (readers with equal states take the same bytes): the fields of
        the value being read only while it is read, the next value's schema only until it begins."""
        m = self.mode
        frames = tuple((f[0], id(f[1]), *f[2:]) for f in self.frames)
        return (m, tuple(self.stack), self.space, self.key, self.esc, self.hex, self.utf8, self.num, self.lit,
                frames, id(self.expect) if m in (START, COLON, VALUE, VALUE_OR_CLOSE) else None,
                (self.buf, self.str_enum and tuple(self.str_enum)) if m == STRING else None,
                self.int_only if m == NUMBER else None, self.const if m in (NUMBER, LITERAL) else None)

    def _names(self):
        """The property names the object being read may still take (encoded), and whether others may come."""
        _, schema, used, _ = self.frames[-1]
        props = schema.get("properties", {})
        return ({_encoded(k): k for k in props if k not in used},
                schema.get("additionalProperties", True) is not False)

    def feed(self, b: int) -> bool:
        m = self.mode
        if self.const is not None and m in (NUMBER, LITERAL):
            if self.const:
                if b != self.const[0]:
                    return False
                self.const = self.const[1:]
                return super().feed(b)
            self.const = None
            if m == NUMBER and not self._ends_number(b):
                return False  # the value is whole: the number may not go on
        if m == STRING:
            if not self.esc and not self.hex and not self.utf8 and b == ord('"'):
                return self._string_end() and super().feed(b)
            if not super().feed(b):
                return False
            self.buf += bytes([b])
            return self.str_enum is None or any(e.startswith(self.buf) for e in self.str_enum)
        if m == NUMBER:
            if self.int_only and b in (ord("."), ord("e"), ord("E")) and self.num in ("0", "int"):
                return False
            if self._ends_number(b):
                m = AFTER  # the number ends before this byte, which is read after it
        if m in (VALUE, VALUE_OR_CLOSE, START) and b not in WS and not (m == VALUE_OR_CLOSE and b == ord("]")):
            if not self._value_start(b):
                return False
        elif m in (KEY_OR_CLOSE, KEY) and b == ord('"'):
            names, others = self._names()
            if not names and not others:
                return False  # no name left to write
            self.buf, self.str_enum = b"", None if others else list(names)
        elif m == AFTER and b == ord(",") and self.frames and self.frames[-1][0] == "o":
            names, others = self._names()
            if not names and not others:
                return False  # the object can take no other property: it closes
        elif m in (KEY_OR_CLOSE, AFTER) and b == ord("}") and self.frames and self.frames[-1][0] == "o":
            _, schema, used, _ = self.frames[-1]
            if not set(schema.get("required", ())) <= used:
                return False
        if not super().feed(b):
            return False
        if m in (KEY_OR_CLOSE, AFTER, VALUE_OR_CLOSE) and b in (ord("}"), ord("]")):
            self.frames = self.frames[:-1]  # the container closed
        elif m == AFTER and b == ord(",") and self.frames[-1][0] == "a":
            self.set_expect(self.frames[-1][1].get("items", {}))
        return True

    def _ends_number(self, b: int) -> bool:
        """Whether the number being read ends before byte ``b`` (read on a copy of the JSON state)."""
        return JsonPrefix._number(JsonPrefix.copy(self), b)[1]

    def _value_start(self, b: int) -> bool:
        """A value begins with byte ``b``: its type must be one the expected (plain) schema allows."""
        schema = self.expect
        kind = _FIRST.get(b, "number" if b == ord("-") or b in _DIGITS else None)
        allowed = _types(schema)
        if kind is None:
            return True  # not a value's first byte: the JSON reader refuses it
        literal = schema.get("_literal")
        if literal is not None and b != literal[0]:
            return False
        self.const = None if literal is None else literal[1:]
        if kind == "number":
            if not allowed & {"number", "integer"}:
                return False
            self.int_only = "number" not in allowed
        elif kind not in allowed:
            return False
        if kind == "object":
            self.frames = self.frames + (("o", schema, frozenset(), None),)
        elif kind == "array":
            self.frames = self.frames + (("a", schema),)
            self.set_expect(schema.get("items", {}))
        elif kind == "string":
            enum = schema.get("enum")
            self.buf, self.str_enum = b"", None if enum is None else [_encoded(e) for e in enum]
        return True

    def _string_end(self) -> bool:
        """The string being read ends: a property name must be one the object may take (its value's schema is
        then expected); an enum's value must be whole."""
        if self.str_enum is not None and self.buf not in self.str_enum:
            return False
        if self.key:
            kind, schema, used, _ = self.frames[-1]
            name = json.loads(b'"' + self.buf + b'"')
            if name in used:
                return False
            props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
            if name not in props and extra is False:
                return False
            self.frames = self.frames[:-1] + ((kind, schema, used | {name}, name),)
            self.set_expect(props.get(name, extra if isinstance(extra, dict) else {}))
        return True


class JsonConstraint:
    """A request's JSON mode: its reply so far (``prefix``: a JSON object's, following ``schema`` when one is
    given), the bytes of every token of the vocabulary (``vocab[i]``: None for a token that never stands in
    JSON text, such as special tokens), the token that ends the reply (``eos``) and every token that would end
    it (``stops``: the model's end-of-sequence tokens, which never stand in JSON text even where their bytes
    could)."""

    def __init__(self, vocab: list[bytes | None], eos: int, stops=(), schema: dict | None = None):
        self.vocab, self.eos, self.stops = vocab, eos, frozenset(stops) | {eos}
        self.prefix = JsonPrefix() if schema is None else SchemaPrefix(schema)

    def fits(self, token: int) -> bool:
        data = self.vocab[token] if token < len(self.vocab) and token not in self.stops else None
        return bool(data) and self.prefix.copy().feed_all(data)

    def took(self, token: int) -> None:
        """The reply goes on with ``token`` (one ``pick`` gave)."""
        if token != self.eos:
            if not self.prefix.feed_all(self.vocab[token]):
                raise AssertionError(f"token {token} does not continue the reply's JSON")

    def pick(self, scores: torch.Tensor, probs: torch.Tensor | None = None, draw=None) -> int:
        """The token for one row: the end of the reply once its object is complete; else, greedy (``probs``
        None), the highest-scoring token that keeps the reply a JSON prefix; sampling, a draw from ``probs``
        restricted to such tokens (``draw(probs) -> token``: rejection, each refused token's probability set to
        0 and drawn again, which draws from the restricted distribution; after 64 refusals the most probable
        fitting token). ``None`` when no token fits, which a vocabulary holding every byte as a token (byte-level
        BPE, as SmolLM2's and Llama 3's) never leaves: the reader takes a byte only where a document can go
        on."""
        if self.prefix.complete:
            return self.eos
        order = scores
        if probs is not None:
            p = probs.clone()
            for _ in range(64):
                if float(p.sum()) <= 0:
                    break
                t = int(draw(p))
                if self.fits(t):
                    return t
                p[t] = 0
            order = p
        best = int(order.argmax())  # most often fits: no sort of the vocabulary then
        if self.fits(best):
            return best
        for t in torch.argsort(order, descending=True, stable=True).tolist():
            if self.fits(t):
                return t
        return None


# --------------------------------------------------------------------------- a tokenizer's bytes
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's; SmolLM2's and most Llama-3-era tokenizers'): each of the 256 byte
    values is written as one printable character; this maps the characters back to the bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (``tokenizer``: a Rust ``tokenizers.Tokenizer``): exact for a byte-level
    BPE vocabulary, where one token may hold part of a character; otherwise its decoded text's UTF-8."""
    from tokenizers import decoders

    piece = tokenizer.id_to_token(token_id)
    if isinstance(tokenizer.decoder, decoders.ByteLevel) and piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


_VOCABS: dict[tuple[int, int], tuple] = {}  # (id of the tokenizer, size): (the tokenizer, its table)


def vocab_bytes(tokenizer, size: int) -> list[bytes | None]:
    """The bytes of each of ``size`` token ids (``tokenizer``: a Rust ``tokenizers.Tokenizer``; ids past its
    vocabulary and special tokens: None), once per tokenizer (held with its table, so that its id is not
    reused by another)."""
    key = (id(tokenizer), size)
    if key not in _VOCABS:
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        _VOCABS[key] = (tokenizer, [None if i >= n or tokenizer.id_to_token(i) in special
                                    else token_bytes(tokenizer, i) for i in range(size)])
    return _VOCABS[key][1]
