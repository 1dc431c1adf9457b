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
SCHEMA_KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum"}
SCHEMA_NOTES = {"title", "description", "default", "examples", "$schema", "$comment"}  # read by people only
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class SchemaError(ValueError):
    """A JSON schema the reader does not follow: what, where, and what it does follow."""


def check_schema(schema, at: str = "schema") -> None:
    """Refuse (``SchemaError``) what ``SchemaPrefix`` does not follow: it reads ``type`` (one or a list of the
    JSON types), ``properties``, ``required``, ``additionalProperties`` (true or false), ``items`` and
    ``enum`` (of strings) -- the keywords of OpenAI's strict structured outputs but for ``anyOf`` and
    ``$ref`` -- and ignores titles, descriptions and defaults; the top level is an object."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{at} must be a JSON schema object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - SCHEMA_KEYWORDS - SCHEMA_NOTES)
    if unknown:
        raise SchemaError(f"{at}: the keyword {unknown[0]!r} is not followed here (followed: "
                          f"{', '.join(sorted(SCHEMA_KEYWORDS))}, in any nesting)")
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if types is not None and (not isinstance(types, list) or not types or any(t not in TYPES for t in types)):
        raise SchemaError(f"{at}.type must be one of {', '.join(TYPES)} or a list of them, got {schema['type']!r}")
    if at == "schema" and types != ["object"]:
        raise SchemaError("schema: the top level must be {\"type\": \"object\", ...}")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(k, str) for k in props):
        raise SchemaError(f"{at}.properties must map names to schemas")
    for k, v in props.items():
        check_schema(v, f"{at}.properties.{k}")
    req = schema.get("required", [])
    if not isinstance(req, list) or any(r not in props for r in req):
        raise SchemaError(f"{at}.required must list names of its properties, got {req!r}")
    if not isinstance(schema.get("additionalProperties", True), bool):
        raise SchemaError(f"{at}.additionalProperties must be true or false (a schema there is not followed)")
    if "items" in schema:
        check_schema(schema["items"], f"{at}.items")
    enum = schema.get("enum")
    if enum is not None and not (isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum)):
        raise SchemaError(f"{at}.enum must be a non-empty list of strings (other enums are not followed)")


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


class SchemaPrefix(JsonPrefix):
    """A ``JsonPrefix`` that also follows a JSON schema (``check_schema`` says which keywords): every value's
    type, an object's property names (listed ones, once each; others only where ``additionalProperties`` is
    not false) and its required ones before it closes, an array's items, a string's enum, an integer's lack of
    a fraction or exponent. Strings that a schema names (property names, enum values) are read as
    ``json.dumps`` writes them, escapes included."""

    __slots__ = ("frames", "expect", "buf", "str_enum", "int_only")

    def __init__(self, schema: dict):
        super().__init__()
        self.frames = ()  # per open container: ("o", schema, used names, the current name) or ("a", schema)
        self.expect = schema  # the schema of the next value
        self.buf = b""  # the string being read, as written
        self.str_enum = None  # the encoded strings it may be (None: any)
        self.int_only = False  # the number being read is an integer

    def copy(self) -> SchemaPrefix:
        out = super().copy()
        out.frames, out.expect, out.buf, out.str_enum, out.int_only = (self.frames, self.expect, self.buf,
                                                                        self.str_enum, self.int_only)
        return out

    def _names(self):
        """The property names the object being read may still take (encoded), and whether others may come."""
        _, schema, used, _ = self.frames[-1]
        props = schema.get("properties", {})
        return ({_encoded(k): k for k in props if k not in used},
                schema.get("additionalProperties", True) is not False)

    def feed(self, b: int) -> bool:
        m = self.mode
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
            if JsonPrefix._number(JsonPrefix.copy(self), b)[1]:
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
            self.expect = self.frames[-1][1].get("items", {})
        return True

    def _value_start(self, b: int) -> bool:
        """A value begins with byte ``b``: its type must be one the expected schema allows."""
        schema = self.expect
        kind = _FIRST.get(b, "number" if b == ord("-") or b in _DIGITS else None)
        allowed = _types(schema)
        if kind is None:
            return True  # not a value's first byte: the JSON reader refuses it
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
            self.expect = schema.get("items", {})
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
            props = schema.get("properties", {})
            if name not in props and schema.get("additionalProperties", True) is False:
                return False
            self.frames = self.frames[:-1] + ((kind, schema, used | {name}, name),)
            self.expect = props.get(name, {})
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
