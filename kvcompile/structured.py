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

import functools
import itertools
import json
import math
from fractions import Fraction

try:  # Python's own parser of regular expressions (``_named_chars``)
    from re import _constants as _sre_consts, _parser as _sre_parser
except ImportError:  # Python 3.10
    import sre_constants as _sre_consts
    import sre_parse as _sre_parser

import torch

from .errors import ArgumentError, KVCompileError

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
_CONTINUATION = (0x80, 0xBF)  # a UTF-8 continuation byte; after these lead bytes, the second is narrower
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}

# where the reader is
VALUE, KEY_OR_CLOSE, KEY, COLON, AFTER, VALUE_OR_CLOSE, STRING, NUMBER, LITERAL, DONE, START = range(11)


class JsonPrefix:
    """A reader of a JSON object's bytes that says, byte by byte, whether the bytes so far begin one
    (``feed``) and whether they are one whole (``complete``). Its state is a few small fields; ``copy`` is
    cheap, to try a token's bytes and keep the state only if all of them fit."""

    __slots__ = ("mode", "stack", "space", "key", "esc", "hex", "utf8", "u8next", "num", "lit")

    def __init__(self):
        self.mode, self.stack, self.space = START, [], 0
        self.key = False  # the string being read is an object's key
        self.esc, self.hex, self.utf8 = False, 0, 0  # after a backslash; \u digits to come; continuation bytes
        self.u8next = _CONTINUATION  # the bytes the next continuation byte may be
        self.num = ""  # where a number is: "-", "0", "int", ".", "frac", "e", "esign", "exp"
        self.lit = b""  # bytes of a literal still to come

    def copy(self) -> JsonPrefix:
        out = type(self).__new__(type(self))
        out.mode, out.stack, out.space, out.key = self.mode, list(self.stack), self.space, self.key
        out.esc, out.hex, out.utf8, out.num, out.lit = self.esc, self.hex, self.utf8, self.num, self.lit
        out.u8next = self.u8next
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
            if not self.u8next[0] <= b <= self.u8next[1]:
                return False
            self.utf8, self.u8next = self.utf8 - 1, _CONTINUATION
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
        # the lead byte of a UTF-8 sequence (no overlong form, no surrogate, nothing past U+10FFFF)
        if 0xC2 <= b <= 0xDF:
            self.utf8 = 1
        elif 0xE0 <= b <= 0xEF:
            self.utf8 = 2
        elif 0xF0 <= b <= 0xF4:
            self.utf8 = 3
        else:
            return False
        self.u8next = _SECOND_BYTE.get(b, _CONTINUATION)
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
                   "oneOf", "allOf", "$ref", "$defs", "definitions", "minimum", "maximum", "exclusiveMinimum",
                   "exclusiveMaximum", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
                   "uniqueItems", "multipleOf", "prefixItems", "propertyNames", "patternProperties",
                   "minProperties", "maxProperties"}
# read by people only; a oneOf's discriminator (OpenAPI's, which pydantic writes) is a hint the reader need not
# follow: it checks by itself that a oneOf's alternatives are apart; deprecated, readOnly and writeOnly are
# annotations (pydantic writes them for deprecated fields, computed fields and secrets)
SCHEMA_NOTES = {"title", "description", "default", "examples", "$schema", "$comment", "$id", "discriminator",
                "deprecated", "readOnly", "writeOnly"}
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_NUMBER_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_DATE = (r"(?:(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"(?:{_OCTET}\.){{3}}{_OCTET}"
_URL_CHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
_LABEL = r"[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*"
# an http(s) URL whose host is a dotted quad or names whose last begins with a letter (WHATWG parsers, as
# pydantic's, read a host ending in a number as an IPv4 address), no "--" (no "xn--" punycode labels), a port
# up to 65535, then a path, a query and a fragment of RFC 3986's characters and %-escapes
_URI = (rf"https?://(?:{_IPV4}|(?:{_LABEL}\.)*[A-Za-z](?:[A-Za-z0-9]*(?:-[A-Za-z0-9]+)*))"
        r"(?::(?:[0-9]|[1-9][0-9]{1,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?"
        rf"(?:/{_URL_CHAR}*)*(?:\?(?:{_URL_CHAR}|[/?])*)?(?:#(?:{_URL_CHAR}|[/?])*)?")
_HEX4 = r"[0-9a-fA-F]{1,4}"
# an IPv6 address in hex groups, "::" standing for one or more zero groups (no embedded dotted quad, no zone)
_IPV6 = "(?:" + "|".join([rf"(?:{_HEX4}:){{7}}{_HEX4}", rf"(?:{_HEX4}:){{1,7}}:"]
                         + [rf"(?:{_HEX4}:){{1,{n}}}(?::{_HEX4}){{1,{7 - n}}}" for n in range(6, 0, -1)]
                         + [rf":(?:(?::{_HEX4}){{1,7}}|:)"]) + ")"
# an ISO 8601 duration as pydantic's timedelta reads and writes one: years (of 365 days), days, then after "T"
# hours, minutes and seconds (up to six fraction digits), each present part in that order, at least one;
# bounded in digits so that it always fits a timedelta; never negative
_SECONDS = r"[0-9]{1,6}(?:\.[0-9]{1,6})?S"
_CLOCK = rf"T(?:[0-9]{{1,6}}H(?:[0-9]{{1,6}}M)?(?:{_SECONDS})?|[0-9]{{1,6}}M(?:{_SECONDS})?|{_SECONDS})"
_DURATION = rf"P(?:[0-9]{{1,4}}Y(?:[0-9]{{1,6}}D)?(?:{_CLOCK})?|[0-9]{{1,6}}D(?:{_CLOCK})?|{_CLOCK})"
# a host name's label: letters and digits, up to two inner hyphens never two together (no "xn--" punycode), at
# most 46 characters (RFC 1123: 63); the last label of a name begins with a letter (a name ending in a number
# reads as an IPv4 address to some parsers). Every bound is a count (a lookahead scanning to the end would make
# every prefix look partial to the regex module).
_HOST_LABEL = r"[A-Za-z0-9]{1,20}(?:-[A-Za-z0-9]{1,12}){0,2}"
_LAST_LABEL = r"[A-Za-z][A-Za-z0-9]{0,19}(?:-[A-Za-z0-9]{1,12}){0,2}"
_HOSTNAME = rf"(?:{_HOST_LABEL}\.){{0,3}}{_LAST_LABEL}"  # at most 187 characters (RFC 1123: 253)
# an e-mail address as pydantic's EmailStr (email-validator) takes one: a dot-atom local part of at most 64
# characters, "@", one to three labels and a top-level domain of letters that is not a special-use name (RFC
# 6761's arpa, invalid, local, localhost, onion, test, in any case); at most 226 characters in all (RFC 5321: 254)
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_TLD = r"(?!(?i:arpa|invalid|local|localhost|onion|test)(?![A-Za-z]))[A-Za-z]{2,20}"
_EMAIL = rf"{_ATEXT}{{1,32}}(?:\.{_ATEXT}{{1,15}}){{0,2}}@(?:{_HOST_LABEL}\.){{1,3}}{_TLD}"
# the formats followed, each as the strings it takes: RFC 3339's full-date (a real day: February 29 in leap
# years only), full-time and date-time ("T" and "Z" in capitals, at most six fraction digits -- microseconds --,
# no leap second), a UUID's 8-4-4-4-12 hex digits, an IPv4 address's dotted quad (no leading zeros), an IPv6
# address (``_IPV6``), either (pydantic's IPvAnyAddress writes "ipvanyaddress"), a duration (``_DURATION``:
# pydantic's timedelta writes "duration"), a URI as an http(s) URL (``_URI``: what pydantic's AnyUrl and
# HttpUrl, which write "uri", both take), a host name (``_HOSTNAME``) and an e-mail address (``_EMAIL``);
# "binary", "path" and "password" (pydantic's bytes, Path and SecretStr, which take any string) bound nothing
# networks (pydantic's IPv4Network, IPv6Network and IPvAnyNetwork take no host bits after the prefix): an address
# alone or with the whole-length prefix, or a prefix on a byte (IPv4) or group (IPv6) boundary with zeros after
# it; interfaces (IPv*Interface: an address on a network) any address with any prefix length, or none
_V4_PREFIX, _V6_PREFIX = r"(?:3[0-2]|[12]?[0-9])", r"(?:12[0-8]|1[01][0-9]|[1-9]?[0-9])"
_V4_NET = (rf"(?:{_IPV4}(?:/32)?|{_OCTET}\.0\.0\.0/8|(?:{_OCTET}\.){{2}}0\.0/16|(?:{_OCTET}\.){{3}}0/24"
           r"|0\.0\.0\.0/0)")
_V6_NET = "(?:" + "|".join([rf"{_IPV6}(?:/128)?", "::/0"]
                           + [rf"(?:{_HEX4}:){{{k}}}:/{16 * k}" for k in range(1, 8)]) + ")"
_V4_IFACE, _V6_IFACE = rf"{_IPV4}(?:/{_V4_PREFIX})?", rf"{_IPV6}(?:/{_V6_PREFIX})?"
# pydantic's NameEmail: an address, or a name of letters and single spaces before it in angle brackets
_NAME_EMAIL = rf"(?:[A-Za-z]{{1,20}}(?: [A-Za-z]{{1,20}}){{0,3}} <{_EMAIL}>|{_EMAIL})"
FORMATS = {"date": _DATE, "time": _TIME, "date-time": _DATE + "T" + _TIME,
           "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
           "ipv4": _IPV4, "ipv6": _IPV6, "ipvanyaddress": f"(?:{_IPV4}|{_IPV6})", "duration": _DURATION,
           "uri": _URI, "hostname": _HOSTNAME, "email": _EMAIL, "name-email": _NAME_EMAIL,
           "ipv4network": _V4_NET, "ipv6network": _V6_NET, "ipvanynetwork": f"(?:{_V4_NET}|{_V6_NET})",
           "ipv4interface": _V4_IFACE, "ipv6interface": _V6_IFACE, "ipvanyinterface": f"(?:{_V4_IFACE}|{_V6_IFACE})",
           "binary": None, "path": None, "password": None}
_SIMPLE_ESCAPES = '"\\/\b\f\n\r\t'
_SURROGATE = frozenset(b"89abcdefABCDEF")  # a surrogate escape: its second hex digit, after a "d"


class DeadEnd(KVCompileError, ValueError):
    """No token of the vocabulary continues a constrained reply (``JsonConstraint.pick``)."""


class SchemaError(ArgumentError):
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


# --------------------------------------------------------------------------- bounds on a value
def _regexes(schema: dict) -> tuple:
    """A string's patterns, (compiled, whole) pairs: its ``pattern`` found anywhere in it (as JSON Schema reads
    a pattern, with Python's regular expressions as Python's validators do, ``$`` the end, ``_end_is_end``), its
    ``format`` the whole of it."""
    import regex

    out = ()
    if "pattern" in schema:
        out += ((regex.compile(_end_is_end(schema["pattern"])), False),)
    if FORMATS.get(schema.get("format")):
        out += ((regex.compile(FORMATS[schema["format"]]), True),)
    return out


@functools.lru_cache(maxsize=256)
def _end_is_end(pattern: str) -> str:
    """``pattern`` with each ``$`` that stands outside a class, unescaped, written ``\\Z``: the end of the string
    and nothing else, as JSON Schema's own dialect (ECMA-262) and pydantic's engine read it, where Python's
    also matches before a final newline (which pydantic then refuses). Unchanged under the multiline flag or
    with a POSIX class (whose brackets this reading does not follow)."""
    import regex

    if "[:" in pattern or regex.search(r"\(\?[a-zA-Z]*m", pattern):  # (?m), (?im), (?m:...): multiline
        return pattern
    out, i, inside = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if inside:
            inside = c != "]"
        elif c == "[":
            inside = True
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            if pattern[j:j + 1] == "]":  # a ] first in a class is one of its characters
                out.append(pattern[i:j + 1])
                i = j + 1
                continue
        elif c == "$":
            c = "\\Z"
        out.append(c)
        i += 1
    return "".join(out)


def _matches(regexes: tuple, text: str, partial: bool = False) -> bool:
    """``text`` follows each pattern (``partial``: it begins a string that does)."""
    return all((r.fullmatch if whole else r.search)(text, partial=partial) is not None for r, whole in regexes)


@functools.lru_cache(maxsize=256)
def _chars_beginning(begun: bytes) -> tuple[str, ...]:
    """The characters whose UTF-8 bytes begin with ``begun`` (a two- or three-byte character's lead byte and
    maybe its second byte: at most 4096 of them, U+0080 to U+FFFF)."""
    out = []
    for tail in itertools.product(range(0x80, 0xC0), repeat=(2 if begun[0] < 0xE0 else 3) - len(begun)):
        try:
            out.append((begun + bytes(tail)).decode())
        except UnicodeDecodeError:  # an overlong form or a surrogate's
            pass
    return tuple(out)


# the categories that name their characters (``_named_chars``), as a pattern writes them
_CATEGORIES = {_sre_consts.CATEGORY_DIGIT: r"\d", _sre_consts.CATEGORY_WORD: r"\w", _sre_consts.CATEGORY_SPACE: r"\s"}


@functools.lru_cache(maxsize=8)
def _category_chars(name) -> tuple:
    """The characters from U+0080 to U+FFFF a category may match, as ``(first, last)`` ranges: those it
    matches in either regular expression engine here (``regex``, which compiles the patterns, and ``re``)."""
    import re

    import regex

    engines, out = (regex.compile(_CATEGORIES[name]), re.compile(_CATEGORIES[name])), []
    for x in range(0x80, 0x10000):
        if 0xD800 <= x <= 0xDFFF or not any(e.fullmatch(chr(x)) for e in engines):
            continue
        if out and out[-1][1] == x - 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _some_char_fits(regexes: tuple, text: str, begun: bytes, partial: bool) -> bool:
    """Some character whose UTF-8 bytes begin with ``begun`` may follow ``text`` under the patterns (tried
    among those the patterns name, when ``_named_chars`` knows them all)."""
    chars = _chars_beginning(begun)  # (never empty: the reader takes only the bytes of some character)
    first, last = ord(chars[0]), ord(chars[-1])  # (they run in order without a gap: a range of code points)
    for r, whole in regexes:
        named = _named_chars(r.pattern, whole)
        if named is not None:  # only the characters it names can follow
            chars = [chr(x) for lo, hi in named for x in range(max(lo, first), min(hi, last) + 1)]
    return any(_matches(regexes, text + c, partial=partial) for c in chars)


@functools.lru_cache(maxsize=256)
def _named_chars(pattern: str, whole: bool) -> tuple | None:
    """The characters beyond ASCII a string can hold that ``pattern`` matches (whole, or searched for: then
    anchored at both ends), as ``(first, last)`` code point ranges, when the pattern names every one it can
    match (literals, ranges and the categories ``\\d``, ``\\w`` and ``\\s``, as ``_category_chars`` bounds
    them); None when it may match others too (``.``, a negated class, character or category, case folding, a
    POSIX class) or Python's parser does not read it."""
    import re

    C = _sre_consts
    try:
        tree = _sre_parser.parse(pattern)
    except re.error:
        return None
    if "[:" in pattern:  # regex reads [[:alpha:]] as a class of letters, Python as characters
        return None
    if tree.state.flags & (C.SRE_FLAG_IGNORECASE | C.SRE_FLAG_MULTILINE):
        return None
    items = list(tree)
    anchored = (items[:1] in ([(C.AT, C.AT_BEGINNING)], [(C.AT, C.AT_BEGINNING_STRING)])
                and items[-1:] in ([(C.AT, C.AT_END)], [(C.AT, C.AT_END_STRING)]))
    if not (whole or anchored):
        return None  # searched for, it may have any characters before or after what it matches
    out = []

    def walk(items) -> bool:
        for op, av in items:
            if op is C.LITERAL:
                out.append((av, av))
            elif op is C.IN:
                for kind, x in av:
                    if kind is C.LITERAL:
                        out.append((x, x))
                    elif kind is C.RANGE:
                        out.append(x)
                    elif kind is C.CATEGORY and x in _CATEGORIES:
                        out.extend(_category_chars(x))
                    else:  # a negated class or category
                        return False
            elif op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
                if not walk(av[2]):
                    return False
            elif op is C.SUBPATTERN:
                if av[1] & C.SRE_FLAG_IGNORECASE or not walk(av[3]):
                    return False
            elif op is C.BRANCH:
                if not all(walk(b) for b in av[1]):
                    return False
            elif op in (C.ASSERT, C.ASSERT_NOT):
                pass  # a lookaround consumes nothing: what it looks at, the rest of the pattern names
            elif op is getattr(C, "ATOMIC_GROUP", None):
                if not walk(av):
                    return False
            elif op not in (C.AT, C.GROUPREF):  # anchors match no character; a group's text was matched before
                return False
        return True

    return tuple((max(lo, 0x80), hi) for lo, hi in out if hi >= 0x80) if walk(tree) else None


def _number_bounds(schema: dict):
    """Where a number's value must lie, exactly, or None when the schema bounds nothing: the integers
    ``(lo, hi)`` a number written as an integer may be, and the reals ``(lo, lo_in, hi, hi_in)`` a number
    written with a fraction may be (``*_in``: the end itself is in), as fractions (None: unbounded). A
    validator reads "3" as the integer 3 and "0.1" as the nearest double, and compares either exactly with the
    bound as written; the reals whose nearest double keeps a bound run to the midpoint between that double and
    the next one out (the midpoint itself in when it rounds inside). The integers are ``(lo, hi, step)``: the
    integers that are multiples of ``multipleOf`` are those of its numerator's (``_step``), else every one; the
    reals carry a fifth field, a fraction's ``multipleOf`` (None: an integer's, whose numbers are written as
    integers, or none)."""
    if not any(k in schema for k in (*_NUMBER_BOUNDS, "multipleOf")):
        return None
    step = _step(schema)
    ilo = ihi = flo = fhi = None
    lo_in = hi_in = True
    for key in _NUMBER_BOUNDS:
        if key not in schema:
            continue
        b, low, strict = Fraction(schema[key]), key.endswith("inimum"), key.startswith("exclusive")
        f = float(schema[key])  # the double nearest the bound, moved to the first one that keeps it
        if low and (Fraction(f) < b or (strict and Fraction(f) == b)):
            f = math.nextafter(f, math.inf)
        if not low and (Fraction(f) > b or (strict and Fraction(f) == b)):
            f = math.nextafter(f, -math.inf)
        mid = (Fraction(f) + Fraction(math.nextafter(f, -math.inf if low else math.inf))) / 2
        mid_in = (float(mid) >= f) if low else (float(mid) <= f)
        if low:
            i = math.floor(b) + 1 if strict else math.ceil(b)
            ilo = i if ilo is None else max(ilo, i)
            if flo is None or mid > flo:
                flo, lo_in = mid, mid_in
        else:
            i = math.ceil(b) - 1 if strict else math.floor(b)
            ihi = i if ihi is None else min(ihi, i)
            if fhi is None or mid < fhi:
                fhi, hi_in = mid, mid_in
    return ((ilo, ihi, 1 if step is None else step.numerator),
            (flo, lo_in, fhi, hi_in, None if step is None or step.denominator == 1 else step))


def _step(schema: dict) -> Fraction | None:
    """A ``multipleOf`` as the exact decimal the schema writes (0.01 is 1/100, not the double nearest it; a
    multiple is what it is in exact arithmetic, as JSON Schema defines it), or None."""
    step = schema.get("multipleOf")
    return None if step is None else Fraction(repr(step)) if isinstance(step, float) else Fraction(step)


def _integer_only(schema: dict, allowed) -> bool:
    """A number of this schema is written as an integer: its types allow no other, or an integer
    ``multipleOf`` asks for one."""
    step = _step(schema)
    return "number" not in allowed or (step is not None and step.denominator == 1)


def _meets(a, b, bounds, integer: bool) -> bool:
    """Some value of [a, b) (b None: no end; integers only when ``integer``, with ``bounds`` ``(lo, hi, step)``:
    a multiple of step) lies inside ``bounds`` (``(lo, lo_in, hi, hi_in)`` otherwise; ``lo`` not None)."""
    if integer:
        lo, hi, step = bounds
        x = -(-math.ceil(max(a, lo)) // step) * step
        return (b is None or x < b) and (hi is None or x <= hi)
    lo, lo_in, hi, hi_in, step = bounds
    if step is not None:  # the least multiple of step from max(a, lo) on, past lo when lo is out
        x = math.ceil(max(a, lo) / step) * step
        if x == lo and not lo_in:
            x += step
        return (b is None or x < b) and (hi is None or x < hi or (x == hi and hi_in))
    if a > lo or (a == lo and lo_in):  # a itself is the least value inside
        return hi is None or a < hi or (a == hi and hi_in)
    # lo is past a: lo itself when it is in, else the values just above it
    return (b is None or lo < b) and (hi is None or lo < hi or (lo == hi and lo_in and hi_in))


def _number_reaches(text: bytes, bounds, integer: bool) -> bool:
    """Whether the number ``text`` begins (a sign, digits, a point, digits: no exponent) can end inside
    ``bounds`` (``_number_bounds``); written as an integer only, when ``integer``."""
    neg = text[:1] == b"-"
    whole, dot, frac = text[neg:].partition(b".")
    for as_int, pair in ((True, bounds[0]), (False, bounds[1])):
        if (as_int and dot) or (integer and not as_int):
            continue
        if neg:  # -m inside the bounds: the magnitude m inside them mirrored
            if as_int:
                pair = (None if pair[1] is None else -pair[1], None if pair[0] is None else -pair[0], pair[2])
            else:
                pair = (None if pair[2] is None else -pair[2], pair[3], None if pair[0] is None else -pair[0], pair[1],
                        pair[4])
        if pair[0] is None or pair[0] < 0:  # a magnitude is at least 0
            pair = (0, *pair[1:]) if as_int else (0, True, *pair[2:])
        hi = pair[1] if as_int else pair[2]
        if dot:  # the decimals that begin whole.frac
            a = Fraction(int(whole + frac), 10 ** len(frac))
            runs = [(a, a + Fraction(1, 10 ** len(frac)))]
        elif not whole:
            runs = [(0, None)]
        elif whole == b"0":
            runs = [(0, 1)]
        elif hi is None:
            return True  # digits to come make it as large as it needs to be
        else:  # n followed by k more digits: n * 10**k <= m < (n + 1) * 10**k
            n = int(whole)
            runs = [(n * 10 ** k, (n + 1) * 10 ** k) for k in range(len(str(math.floor(hi))) + 1)]
        if any(_meets(a, b, pair, as_int) for a, b in runs):
            return True
    return False


def _number_inside(text: bytes, bounds) -> bool:
    """The whole number ``text`` (no exponent) lies inside ``bounds``."""
    if b"." not in text:
        lo, hi, step = bounds[0]
        x = int(text)
        return (lo is None or x >= lo) and (hi is None or x <= hi) and x % step == 0
    lo, lo_in, hi, hi_in, step = bounds[1]
    x = Fraction(text.decode())
    return ((lo is None or x > lo or (x == lo and lo_in)) and (hi is None or x < hi or (x == hi and hi_in))
            and (step is None or x % step == 0))


def _takes(schema: dict, value) -> bool:
    """A scalar enum or const ``value`` keeps the schema's bounds (compared as a validator compares them)."""
    if isinstance(value, str):
        return (len(value) >= schema.get("minLength", 0) and len(value) <= schema.get("maxLength", len(value))
                and _matches(_regexes(schema), value))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    return (value >= schema.get("minimum", value) and value <= schema.get("maximum", value)
            and ("multipleOf" not in schema or Fraction(repr(value)) % _step(schema) == 0)
            and ("exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"])
            and ("exclusiveMaximum" not in schema or value < schema["exclusiveMaximum"]))


def _possible(schema: dict, kind: str) -> bool:
    """Whether any value of type ``kind`` keeps the schema's bounds (numbers: exactly; strings and arrays: their
    counts in order, and a pattern that something begins)."""
    if kind in ("number", "integer"):
        bounds = _number_bounds(schema)
        integer = _integer_only(schema, {kind})
        return bounds is None or any(_number_reaches(t, bounds, integer) for t in (b"", b"-"))
    if kind == "string":
        return (schema.get("minLength", 0) <= schema.get("maxLength", math.inf)
                and _matches(_regexes(schema), "", partial=True))
    if kind == "array":
        return schema.get("minItems", 0) <= _max_items(schema)
    if kind == "object":
        return schema.get("minProperties", 0) <= schema.get("maxProperties", math.inf)
    return True


def _item_schema(array: dict, i: int) -> dict:
    """The schema of an array's item ``i`` (0-based): its ``prefixItems`` entry, else its ``items`` (any value
    when that is missing or true; ``items: false`` is kept by ``_max_items``)."""
    prefix = array.get("prefixItems", ())
    if i < len(prefix):
        return prefix[i]
    items = array.get("items", {})
    return items if isinstance(items, dict) else {}


def _max_items(array: dict):
    """The most items an array may hold: its ``maxItems``, and no more than its ``prefixItems`` when ``items``
    is false."""
    most = array.get("maxItems", math.inf)
    return min(most, len(array.get("prefixItems", ()))) if array.get("items") is False else most


def _literals(alts: tuple):
    """The values a property's alternatives take, when each is a literal (an enum or const); else None."""
    out = set()
    for a in alts:
        if "_literal" in a:
            v = json.loads(a["_literal"])
        elif "enum" in a:
            out.update(("string", e) for e in a["enum"])
            continue
        else:
            return None
        out.add(("boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else "other", v))
    return out


def _item_key(data: bytes) -> tuple:
    """What tells an array's item from the others under ``uniqueItems``, as a validator compares them: its
    value, numbers by value (1 and 1.0 are one), booleans apart from numbers (true is not 1)."""
    v = json.loads(data)
    return ("b", v) if isinstance(v, bool) else ("z",) if v is None else ("s", v) if isinstance(v, str) else ("n", v)


def _unique_domain(alts: tuple) -> frozenset | None:
    """Every value an item of these alternatives may be (``_item_key``s), or None when there is no end to them."""
    out = set()
    for a in alts:
        if "_literal" in a:
            out.add(_item_key(a["_literal"]))
            continue
        for t in _types(a):
            if t == "string" and "enum" in a:
                out.update(("s", e) for e in a["enum"])
            elif t == "string" and a.get("maxLength", 1) == 0:
                out.add(("s", ""))
            elif t == "boolean":
                out.update({("b", True), ("b", False)})
            elif t == "null":
                out.add(("z",))
            else:
                return None
    return frozenset(out)


class _Schema:
    """A whole schema (``root``, where ``$ref`` pointers lead) and each of its subschemas' alternatives
    (``alternatives``), worked out once."""

    def __init__(self, root: dict):
        self.root, self.memo = root, {}

    def resolve(self, schema: dict, at: str = "schema") -> dict:
        """``schema``, or where its ``$ref`` chain leads ("#", "#/$defs/Name", "#/definitions/Name" or any
        other JSON pointer into the root), through any ``allOf`` of one schema."""
        seen = []
        while "$ref" in schema or "allOf" in schema:
            if "allOf" in schema:
                schema = schema["allOf"][0]
                continue
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
        """The schemas a value of ``schema`` may follow, each plain (no ``$ref``, ``anyOf``, ``oneOf`` or
        ``allOf``; an ``enum`` of strings only; a non-string ``enum`` or ``const`` value as the bytes
        ``json.dumps`` writes it, under the internal key ``"_literal"``; ``type`` narrowed to the types a
        value can have within the schema's bounds). A value follows ``schema`` when it follows one of them."""
        key = id(schema)
        if key in self.memo:
            return self.memo[key]
        if key in _seen:
            raise SchemaError(f"{at}: its anyOf leads back to itself before any value begins")
        s = self.resolve(schema, at)
        if "anyOf" in s or "oneOf" in s:
            word = "anyOf" if "anyOf" in s else "oneOf"
            members = [self.alternatives(a, f"{at}.{word}[{i}]", (*_seen, key)) for i, a in enumerate(s[word])]
            if word == "oneOf":
                self._apart(members, f"{at}.oneOf")
            out = tuple(alt for m in members for alt in m)
        elif "enum" in s or "const" in s:
            values = [s["const"]] if "const" in s else list(s["enum"])
            if "enum" in s and "const" in s:
                values = [v for v in values if v in s["enum"]]
            allowed = _types(s) if "type" in s else frozenset(TYPES)
            values = [v for v in values if (_type_of(v) in allowed or (_type_of(v) == "integer" and "number" in allowed))
                      and _takes(s, v)]
            strings = [v for v in values if isinstance(v, str)]
            plain = {k: v for k, v in s.items() if k not in ("enum", "const", "type")}
            out = ((({**plain, "type": "string", "enum": strings},) if strings else ())
                   + tuple({"type": _type_of(v), "_literal": json.dumps(v).encode()}
                           for v in values if not isinstance(v, str)))
        else:
            kinds = [t for t in TYPES if t in _types(s) and _possible(s, t)]
            out = () if not kinds else (s,) if len(kinds) == len(_types(s)) else ({**s, "type": kinds},)
        if not out:
            raise SchemaError(f"{at}: no value follows it (its enum, const, type and bounds leave nothing)")
        self.memo[key] = out
        return out

    def names(self, obj: dict, at: str = "schema") -> tuple:
        """How an object's property names are read: ``(names, lens, regexes)``, ``names`` the ``(encoded, name)``
        pairs it may take (None: any name that keeps to ``lens`` and ``regexes``, as a string value's are kept).
        A name keeps to ``propertyNames`` (one schema of strings), and one that is not listed in ``properties``
        needs ``additionalProperties`` or, where that is false, to match the ``patternProperties`` pattern."""
        key = ("names", id(obj))
        if key in self.memo:
            return self.memo[key]
        props, patterns = obj.get("properties", {}), obj.get("patternProperties", {})
        rule = {}
        if "propertyNames" in obj:
            alts = [a for a in self.alternatives(obj["propertyNames"], f"{at}.propertyNames") if "string" in _types(a)]
            if len(alts) != 1:
                raise SchemaError(f"{at}.propertyNames: followed when it is one schema of strings (an enum, a pattern, "
                                  f"lengths or a format), not {len(alts)} alternatives of strings")
            rule = alts[0]
        pattern = _regexes({"pattern": next(iter(patterns))}) if patterns else ()
        closed = obj.get("additionalProperties", True) is False
        if closed and pattern and props:
            raise SchemaError(f"{at}: properties beside patternProperties with additionalProperties false is not "
                              f"followed (a name would be a listed one or match the pattern); write one of them")
        for name in props:
            if pattern and _matches(pattern, name):
                raise SchemaError(f"{at}: the property {name!r} also matches the patternProperties pattern (both "
                                  f"schemas would apply); write them as one")

        def takes(name: str) -> bool:
            return (_takes(rule, name) and ("enum" not in rule or name in rule["enum"])
                    and (name in props or not closed or (pattern and _matches(pattern, name))))

        for name in obj.get("required", ()):
            if not takes(name):
                raise SchemaError(f"{at}: no value follows it (its required property {name!r} does not keep to its "
                                  f"propertyNames)")
        free = not closed or bool(pattern)
        if "enum" in rule or not free:
            pool = rule.get("enum", props) if free else props
            names = tuple((_encoded(n), n) for n in pool if takes(n))
            if len(names) < obj.get("minProperties", 0):
                raise SchemaError(f"{at}: no value follows it (minProperties {obj['minProperties']} of "
                                  f"{len(names)} names it may take)")
            out = (names, None, ())
        else:
            regexes = _regexes(rule) + (pattern if closed else ())  # (else an unmatched name is an additional one)
            lens = (rule.get("minLength", 0), rule.get("maxLength", math.inf))
            out = (None, lens if lens != (0, math.inf) or regexes or "format" in rule else None, regexes)
        self.memo[key] = out
        return out

    @staticmethod
    def value_schema(obj: dict, name: str) -> dict | None:
        """The schema of property ``name``'s value in object ``obj`` (None: the object takes no such name)."""
        props, patterns = obj.get("properties", {}), obj.get("patternProperties", {})
        if name in props:
            return props[name]
        if patterns and _matches(_regexes({"pattern": next(iter(patterns))}), name):
            return next(iter(patterns.values()))
        extra = obj.get("additionalProperties", True)
        return None if extra is False else extra if isinstance(extra, dict) else {}

    def unique_domain(self, array: dict) -> frozenset | None:
        """``_unique_domain`` of an array schema's items, worked out once."""
        key = ("unique", id(array))
        if key not in self.memo:
            self.memo[key] = _unique_domain(self.alternatives(array.get("items", {})))
        return self.memo[key]

    def _apart(self, members: list, at: str) -> None:
        """Refuse a oneOf whose alternatives may take one value (a document would then follow neither: oneOf asks
        for exactly one); apart are alternatives of different types, different enum or const values, or objects
        with a required property of different values in each (a discriminated union's tag)."""
        for i, mi in enumerate(members):
            for j in range(i):
                for p in mi:
                    for q in members[j]:
                        if not self._disjoint(p, q):
                            raise SchemaError(
                                f"{at}: its alternatives {j} and {i} may take the same value, so the reader cannot "
                                f"keep to exactly one (followed: alternatives of different types or values, or "
                                f"objects told apart by a required property's const, as a discriminated union's); "
                                f"write anyOf if a value may follow either")

    def _disjoint(self, p: dict, q: dict) -> bool:
        def kinds(s):
            t = set(_types(s))
            return t | {"integer"} if "number" in t else t

        shared = kinds(p) & kinds(q)
        if not shared:
            return True
        lp, lq = _literals((p,)), _literals((q,))
        if lp is not None and lq is not None:
            return not (lp & lq)
        if shared != {"object"}:
            return False
        for name in set(p.get("required", ())) & set(q.get("required", ())):
            a = _literals(self.alternatives(p["properties"][name]))
            b = _literals(self.alternatives(q["properties"][name]))
            if a is not None and b is not None and not (a & b):
                return True
        return False


def check_schema(schema, at: str = "schema") -> None:
    """Refuse (``SchemaError``) what ``SchemaPrefix`` does not follow. It reads ``type`` (one or a list of the
    JSON types), ``properties``, ``required``, ``additionalProperties`` (true, false or a schema), ``items``,
    ``prefixItems``, ``propertyNames`` and ``patternProperties`` (``_Schema.names``), ``minProperties``,
    ``maxProperties``, ``enum`` and ``const`` (of strings, numbers, booleans and null), ``anyOf``, ``oneOf`` (of alternatives it
    can tell apart), ``allOf`` of one schema, ``$ref`` into the schema (``$defs``, ``definitions``), and the
    bounds: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, ``minLength``,
    ``maxLength``, ``minItems``, ``maxItems``, ``pattern`` and ``format`` (``FORMATS``), ``multipleOf`` (an
    integer's numbers are written as integers; a fraction's multiples are exact, ``_step``), and
    ``uniqueItems`` (a ``set``'s:
    ``_check_unique`` says of which items) -- what OpenAI's structured outputs and pydantic's schemas use but
    ``allOf`` of several and the like -- and ignores titles, descriptions and defaults; the top level is
    an object. An enum or const value is written as ``json.dumps`` writes it (a reply may not spell the const 1
    as 1.0 or 1e0); a bounded number is written without an exponent; a string with a pattern or format is
    written without ``\\u`` escapes or characters beyond U+FFFF."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{at} must be a JSON schema object, got {type(schema).__name__}")
    whole, nodes = _Schema(schema), []
    _check(whole, schema, at, nodes)
    for defs in ("$defs", "definitions"):
        for name, sub in (schema.get(defs) or {}).items():
            _check(whole, sub, f"{at}.{defs}.{name}", nodes)
    for sub, where in nodes:  # once every part is known to be well formed
        whole.alternatives(sub, where)  # a $ref that leads nowhere, an anyOf that loops, nothing to write: refused
    for sub, where in nodes:
        if sub.get("uniqueItems") is True:
            _check_unique(whole, sub, where)
        if "object" in _types(sub) and not any(k in sub for k in ("$ref", "anyOf", "oneOf", "allOf")):
            whole.names(sub, where)
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
    for one in ("$ref", "anyOf", "oneOf", "allOf"):
        others = sorted(set(schema) - SCHEMA_NOTES - {one, "$defs", "definitions"})
        if one in schema and others:
            raise SchemaError(f"{at}: {one} stands beside {others[0]!r}; write the two as one schema (keywords "
                              f"beside {one} are followed only when they are titles, descriptions or defaults)")
    for defs in ("$defs", "definitions"):
        if defs in schema and not (isinstance(schema[defs], dict) and at == "schema"):
            raise SchemaError(f"{at}.{defs} must map names to schemas, at the top level of the schema")
    nodes.append((schema, at))
    for word in ("anyOf", "oneOf", "allOf"):
        if word in schema:
            if not isinstance(schema[word], list) or not schema[word]:
                raise SchemaError(f"{at}.{word} must be a non-empty list of schemas")
            if word == "allOf" and len(schema[word]) > 1:
                raise SchemaError(f"{at}.allOf of {len(schema[word])} schemas is not followed (one schema is); "
                                  f"write them as one schema")
            for i, alt in enumerate(schema[word]):
                _check(whole, alt, f"{at}.{word}[{i}]", nodes)
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
    if "items" in schema and not isinstance(schema["items"], bool):  # (true: any item; false: none)
        _check(whole, schema["items"], f"{at}.items", nodes)
    prefix = schema.get("prefixItems", [])
    if not isinstance(prefix, list):
        raise SchemaError(f"{at}.prefixItems must be a list of schemas, got {prefix!r}")
    for i, sub in enumerate(prefix):
        _check(whole, sub, f"{at}.prefixItems[{i}]", nodes)
    if "propertyNames" in schema:
        _check(whole, schema["propertyNames"], f"{at}.propertyNames", nodes)
    patterns = schema.get("patternProperties", {})
    if not isinstance(patterns, dict) or len(patterns) > 1:
        raise SchemaError(f"{at}.patternProperties is followed with one pattern (a name matching two would follow "
                          f"both schemas), got {patterns!r}")
    for pattern, sub in patterns.items():
        _check_pattern(pattern, f"{at}.patternProperties")
        _check(whole, sub, f"{at}.patternProperties[{pattern!r}]", nodes)
    enum = schema.get("enum")
    if enum is not None and not (isinstance(enum, list) and enum):
        raise SchemaError(f"{at}.enum must be a non-empty list")
    for v in [*(enum or ()), *([schema["const"]] if "const" in schema else ())]:
        if _type_of(v) is None:
            raise SchemaError(f"{at}: enum and const values must be strings, numbers, booleans or null, got {v!r}")
    for key in _NUMBER_BOUNDS:
        v = schema.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == math.inf:
            raise SchemaError(f"{at}.{key} must be a number, got {v!r}"
                              + (" (JSON Schema 2020-12's form; draft 4's true/false beside minimum or maximum is "
                                 "not followed)" if isinstance(v, bool) else ""))
    for key in _COUNTS:
        v = schema.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise SchemaError(f"{at}.{key} must be a non-negative integer, got {v!r}")
    step = schema.get("multipleOf", 1)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step < math.inf:
        raise SchemaError(f"{at}.multipleOf must be a positive number, got {step!r}")
    if "uniqueItems" in schema and not isinstance(schema["uniqueItems"], bool):
        raise SchemaError(f"{at}.uniqueItems must be true or false, got {schema['uniqueItems']!r}")
    if "format" in schema and schema["format"] not in FORMATS:
        raise SchemaError(f"{at}.format {schema['format']!r} is not followed (followed: {', '.join(FORMATS)})")
    if "pattern" in schema:
        _check_pattern(schema["pattern"], f"{at}.pattern")


def _check_pattern(pattern, at: str) -> None:
    """A pattern (of ``pattern`` or ``patternProperties``) must be a regular expression ``regex`` compiles."""
    import regex

    if not isinstance(pattern, str):
        raise SchemaError(f"{at} must be a string, got {pattern!r}")
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise SchemaError(f"{at} {pattern!r} is no regular expression: {e}") from None


def _check_unique(whole: _Schema, schema: dict, at: str) -> None:
    """``uniqueItems`` is followed where every item can be kept apart from the ones before it without looking
    ahead: items that are strings (to a ``maxLength``: the last character may not repeat an item; no
    ``pattern`` or ``format``), numbers without bounds, booleans, null, or enum and const values -- what
    pydantic writes for a ``set`` of such values; an array of an enum's values holds each at most once."""
    if "prefixItems" in schema or isinstance(schema.get("items"), bool):
        raise SchemaError(f"{at}.uniqueItems is followed beside one schema of items, not beside prefixItems")
    alts = whole.alternatives(schema.get("items", {}), f"{at}.items")
    for a in alts:
        if "_literal" in a:
            continue
        kinds = _types(a)
        if kinds & {"object", "array"} or ("string" in kinds and ("pattern" in a or "format" in a)) or (
                kinds & {"integer", "number"} and any(k in a for k in _NUMBER_BOUNDS)):
            raise SchemaError(f"{at}.uniqueItems is followed for items that are strings (without a pattern or "
                              f"format), numbers without bounds, booleans, null or enum values; not for these "
                              f"items ({', '.join(sorted(kinds))}"
                              f"{' with bounds' if kinds <= {'integer', 'number'} else ''})")
    domain = _unique_domain(alts)
    if domain is not None and schema.get("minItems", 0) > len(domain):
        raise SchemaError(f"{at}: no value follows it (minItems {schema['minItems']} of unique items, of which "
                          f"there are {len(domain)})")


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
    closes, an array's items and their count, an enum's or a const's value, an integer's lack of a fraction or
    exponent, a number's bounds (refused at the first digit no number inside them begins with), a string's
    length, pattern and format (at the first character none continues), each ``anyOf`` or ``oneOf``
    alternative at once. The same interface as ``JsonPrefix`` (``feed``, ``feed_all``, ``complete``,
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

    __slots__ = ("whole", "frames", "expect", "flat", "buf", "str_enum", "int_only", "const", "bounds", "lens",
                 "regexes", "chars")

    def __init__(self, whole: _Schema):
        super().__init__()
        self.whole = whole
        # per open container: ("o", schema, used names, the current name) or ("a", schema, items begun), and
        # for an array of unique items (the items' ``_item_key``s so far, the bytes of the item being read)
        self.frames = ()
        self.expect, self.flat = None, True  # the schema of the next value; whether it is plain
        self.buf = b""  # the string being read, as written (or a bounded number)
        self.str_enum = None  # the encoded strings it may be (None: any)
        self.int_only = False  # the number being read is an integer
        self.const = None  # the bytes still to come of a non-string enum or const value being read
        self.bounds = None  # the number being read: its bounds (``_number_bounds``), None when unbounded
        self.lens, self.regexes, self.chars = None, (), 0  # the string being read: (minLength, maxLength),
        # its patterns (``_regexes``), and the characters it has begun

    def copy(self) -> _Branch:
        out = super().copy()
        out.whole, out.frames, out.expect, out.flat = self.whole, self.frames, self.expect, self.flat
        out.buf, out.str_enum, out.int_only, out.const = self.buf, self.str_enum, self.int_only, self.const
        out.bounds, out.lens, out.regexes, out.chars = self.bounds, self.lens, self.regexes, self.chars
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
        return (m, tuple(self.stack), self.space, self.key, self.esc, self.hex, self.utf8, self.u8next, self.num,
                self.lit, frames, id(self.expect) if m in (START, COLON, VALUE, VALUE_OR_CLOSE) else None,
                (self.buf, self.str_enum and tuple(self.str_enum), self.lens, self.regexes, self.chars)
                if m == STRING else None,
                (self.int_only, self.bounds, self.buf if self.bounds else None) if m == NUMBER else None,
                self.const if m in (NUMBER, LITERAL) else None)

    def _names(self) -> tuple:
        """The object being read: the encoded names it may still take (None: any that keeps to its name rule,
        ``_Schema.names``), and whether it may take another property at all."""
        _, schema, used, _ = self.frames[-1]
        if len(used) >= schema.get("maxProperties", math.inf):
            return [], False
        names = self.whole.names(schema)[0]
        if names is None:
            return None, True
        left = [e for e, n in names if n not in used]
        return left, bool(left)

    def feed(self, b: int) -> bool:
        if any(len(f) == 5 for f in self.frames):
            return self._unique_feed(b)
        return self._feed(b)

    def _unique_feed(self, b: int) -> bool:
        """``_feed`` inside an array of unique items: each item's bytes are kept while it is read, and it is
        refused at the byte that would make it repeat an item before it -- at its first byte where that decides
        it (an enum's or a literal's value, true, false, null, an integer's 0), at its last character where its
        length can grow no more, at its end otherwise (a string's closing quote: it could go on instead; the
        byte after a number: more digits could come); a ``,`` when the items' values are all used."""
        m, top = self.mode, self.frames[-1]
        item = top[0] == "a" and len(top) == 5  # the innermost container is such an array
        if item and m == NUMBER and top[4] is not None:
            if self._ends_number(b):  # the number is whole before this byte
                key = _item_key(top[4])
                if key in top[3]:
                    return False
                self.frames = self.frames[:-1] + ((*top[:3], top[3] | {key}, None),)
                m, top = AFTER, self.frames[-1]  # this byte is read after it
            elif b == ord("0") and top[4] == b"-" and self.int_only and ("n", 0) in top[3]:
                return False  # -0 is 0, and an integer's 0 can have no other digits
        starts = item and m in (VALUE, VALUE_OR_CLOSE) and b not in WS and not (m == VALUE_OR_CLOSE and b == ord("]"))
        if item and m == AFTER and b == ord(","):
            domain = self.whole.unique_domain(top[1])
            if domain is not None and domain <= top[3]:
                return False  # every value an item may be is there: the array closes
        at = len(self.frames) - 1
        if not self._feed(b):
            return False
        frames = list(self.frames)
        for i, f in enumerate(frames):
            if len(f) == 5 and f[4] is not None:
                frames[i] = (*f[:4], f[4] + bytes([b]))
        if starts:
            frames[at] = (*frames[at][:4], bytes([b]))
            seen = frames[at][3]
            if b == ord('"') and self.str_enum is not None:
                self.str_enum = [e for e in self.str_enum if ("s", _decoded(e)) not in seen]
                if not self.str_enum:
                    return False
            elif self.const is not None and self.mode in (NUMBER, LITERAL):  # an enum's or a const's value
                if _item_key(bytes([b]) + self.const) in seen:
                    return False
            elif b in _LITERALS and _item_key(bytes([b]) + _LITERALS[b]) in seen:
                return False
            elif b == ord("0") and self.int_only and ("n", 0) in seen:
                return False
        self.frames = tuple(frames)
        top = frames[-1]
        if self.mode == STRING and top[0] == "a" and len(top) == 5 and self.lens is not None and (
                self.chars >= self.lens[1] and not (self.esc or self.hex or self.utf8)):
            if ("s", _decoded(self.buf)) in top[3]:  # as long as it may be: it would close as an item before
                return False
        if self.mode == AFTER and top[0] == "a" and len(top) == 5 and top[4] is not None:  # an item ended
            key = _item_key(top[4])
            if key in top[3]:
                return False
            self.frames = self.frames[:-1] + ((*top[:3], top[3] | {key}, None),)
        return True

    def _feed(self, b: int) -> bool:
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
            return self._string_byte(b)
        if m == NUMBER:
            if self.int_only and b in (ord("."), ord("e"), ord("E")) and self.num in ("0", "int"):
                return False
            if self._ends_number(b):
                if self.bounds is not None and not _number_inside(self.buf, self.bounds):
                    return False
                m = AFTER  # the number ends before this byte, which is read after it
            elif self.bounds is not None:
                if b in (ord("e"), ord("E")) or not super().feed(b):
                    return False  # a bounded number is written without an exponent
                self.buf += bytes([b])
                return _number_reaches(self.buf, self.bounds, self.int_only)
        top = self.frames[-1] if self.frames else (None, None)
        if m in (VALUE, VALUE_OR_CLOSE, START) and b not in WS and not (m == VALUE_OR_CLOSE and b == ord("]")):
            if m == VALUE_OR_CLOSE:  # an array's first item
                if _max_items(top[1]) < 1:
                    return False
                self.frames = self.frames[:-1] + (("a", top[1], 1, *top[3:]),)
            if not self._value_start(b):
                return False
        elif m in (KEY_OR_CLOSE, KEY) and b == ord('"'):
            names, more = self._names()
            if not more:
                return False  # no name left to write
            _, lens, regexes = self.whole.names(top[1])
            self.buf, self.str_enum, self.lens, self.regexes, self.chars = b"", names, lens, regexes, 0
        elif m == AFTER and b == ord(",") and top[0] == "o":
            if not self._names()[1]:
                return False  # the object can take no other property: it closes
        elif m == AFTER and b == ord(",") and top[0] == "a":
            if top[2] >= _max_items(top[1]):
                return False  # the array holds as many items as it may: it closes
            self.frames = self.frames[:-1] + (("a", top[1], top[2] + 1, *top[3:]),)
        elif m in (KEY_OR_CLOSE, AFTER) and b == ord("}") and top[0] == "o":
            if not set(top[1].get("required", ())) <= top[2] or len(top[2]) < top[1].get("minProperties", 0):
                return False
        elif m in (VALUE_OR_CLOSE, AFTER) and b == ord("]") and top[0] == "a":
            if top[2] < top[1].get("minItems", 0):
                return False
        if not super().feed(b):
            return False
        if m in (KEY_OR_CLOSE, AFTER, VALUE_OR_CLOSE) and b in (ord("}"), ord("]")):
            self.frames = self.frames[:-1]  # the container closed
        elif m == AFTER and b == ord(",") and self.frames[-1][0] == "a":
            self.set_expect(_item_schema(self.frames[-1][1], self.frames[-1][2] - 1))
        return True

    def _string_byte(self, b: int) -> bool:
        """A byte of a string (a property name or a value), kept to its enum, lengths and patterns. A string with
        bounds takes no ``\\u`` escape of a surrogate (each escape is then one character, as a validator counts
        them); one with patterns is written without ``\\u`` escapes and without characters beyond U+FFFF, each
        character kept to what the patterns can still take from its first byte on (a character of several bytes:
        some character that begins with its bytes so far)."""
        starts = not (self.esc or self.hex or self.utf8)  # the byte begins a character (or ends the string)
        if starts and b == ord('"'):
            return self._string_end() and super().feed(b)
        bounded = self.lens is not None  # (a string with patterns has lengths (0, inf) at least)
        if bounded:
            if self.regexes and ((self.esc and b == ord("u")) or (starts and b >= 0xF0)):
                return False
            if self.hex == 3 and self.buf[-1:] in (b"d", b"D") and b in _SURROGATE:
                return False  # \uD800 to \uDFFF: half a character
            if starts and self.chars >= self.lens[1]:
                return False  # as long as it may be: it closes
        if not super().feed(b):
            return False
        self.buf += bytes([b])
        if self.str_enum is not None and not any(e.startswith(self.buf) for e in self.str_enum):
            return False
        if not bounded:
            return True
        self.chars += starts
        if not self.regexes:
            return True
        last = self.chars == self.lens[1]  # nothing may follow this character: the string must be whole with it
        if self.esc:  # after a backslash: some escape must fit
            text = _decoded(self.buf[:-1])
            return any(_matches(self.regexes, text + c, partial=not last) for c in _SIMPLE_ESCAPES)
        if self.utf8:  # inside a character of several bytes: some character that begins with them must fit
            begun = 1 + (b < 0xC0)  # its lead byte, and this one when it is the second
            return _some_char_fits(self.regexes, _decoded(self.buf[:-begun]), self.buf[-begun:], not last)
        return _matches(self.regexes, _decoded(self.buf), partial=not last)

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
            self.int_only = _integer_only(schema, allowed)
            self.bounds = None if literal is not None else _number_bounds(schema)
            self.buf = bytes([b])
            return self.bounds is None or _number_reaches(self.buf, self.bounds, self.int_only)
        if kind not in allowed:
            return False
        if kind == "object":
            self.frames = self.frames + (("o", schema, frozenset(), None),)
        elif kind == "array":
            # an array of unique items also holds the items' keys so far and the bytes of the one being read
            self.frames = self.frames + (("a", schema, 0) + ((frozenset(), None) if schema.get("uniqueItems") else ()),)
            self.set_expect(_item_schema(schema, 0))
        elif kind == "string":
            enum = schema.get("enum")
            self.buf, self.str_enum = b"", None if enum is None else [_encoded(e) for e in enum]
            lens = (schema.get("minLength", 0), schema.get("maxLength", math.inf))
            self.lens = lens if lens != (0, math.inf) or "pattern" in schema or "format" in schema else None
            self.regexes, self.chars = _regexes(schema), 0
        return True

    def _string_end(self) -> bool:
        """The string being read ends: a property name must be one the object may take (its value's schema is
        then expected); an enum's value must be whole; a bounded string long enough and whole to its patterns."""
        if self.str_enum is not None and self.buf not in self.str_enum:
            return False
        if self.lens is not None and not (self.chars >= self.lens[0] and _matches(self.regexes, _decoded(self.buf))):
            return False
        if self.key:
            kind, schema, used, _ = self.frames[-1]
            name = json.loads(b'"' + self.buf + b'"')
            if name in used:
                return False
            value = self.whole.value_schema(schema, name)
            if value is None:
                return False
            self.frames = self.frames[:-1] + ((kind, schema, used | {name}, name),)
            self.set_expect(value)
        return True


def _decoded(written: bytes) -> str:
    """A string's text from the bytes written between its quotes (whole characters and escapes)."""
    return json.loads(b'"' + written + b'"')


class JsonConstraint:
    """A request's JSON mode: its reply so far (``prefix``: a JSON object's, following ``schema`` when one is
    given), the bytes of every token of the vocabulary (``vocab[i]``: None for a token that never stands in
    JSON text, such as special tokens), the token that ends the reply (``eos``) and every token that would end
    it (``stops``: the model's end-of-sequence tokens, which never stand in JSON text even where their bytes
    could)."""

    def __init__(self, vocab: list[bytes | None], eos: int, stops=(), schema: dict | None = None):
        self.vocab, self.eos, self.stops = vocab, eos, frozenset(stops) | {eos}
        self.prefix = JsonPrefix() if schema is None else SchemaPrefix(schema)
        self.taken: list[int] = []  # the reply's tokens so far

    def fits(self, token: int) -> bool:
        data = self.vocab[token] if token < len(self.vocab) and token not in self.stops else None
        return bool(data) and self.prefix.copy().feed_all(data)

    def took(self, token: int) -> None:
        """The reply goes on with ``token`` (one ``pick`` gave)."""
        if token != self.eos:
            if not self.prefix.feed_all(self.vocab[token]):
                raise AssertionError(f"token {token} does not continue the reply's JSON")
            self.taken.append(token)

    def pick(self, scores: torch.Tensor, probs: torch.Tensor | None = None, draw=None) -> int:
        """The token for one row: the end of the reply once its object is complete; else, greedy (``probs``
        None), the highest-scoring token that keeps the reply a JSON prefix; sampling, a draw from ``probs``
        restricted to such tokens (``draw(probs) -> token``: rejection, each refused token's probability set to
        0 and drawn again, which draws from the restricted distribution; after 64 refusals the most probable
        fitting token). The most likely token (or the first draw) usually fits; when it does not, only tokens
        whose first byte the reply can take next are tried (``_open``). ``DeadEnd`` when no token fits: a
        vocabulary holding every byte as a token (byte-level BPE, as SmolLM2's and Llama 3's) leaves none, as
        the reader takes a byte only where a document can go on -- except in a string with a ``pattern`` that
        needs a character such strings are not written with there (one beyond U+FFFF, or one that needs a
        ``\\u`` escape)."""
        if self.prefix.complete:
            return self.eos
        if probs is None:
            order = scores
            best = int(order.argmax())
            if self.fits(best):
                return best
            open_ = self._open(order.numel())
        else:
            p = probs.clone()
            t = int(draw(p))
            if self.fits(t):
                return t
            open_ = self._open(p.numel())
            p[t] = 0
            p[~open_] = 0  # never fit: the restricted distribution is the same without them
            for _ in range(63):
                if float(p.sum()) <= 0:
                    break
                t = int(draw(p))
                if self.fits(t):
                    return t
                p[t] = 0
            order = p
        ids = open_.nonzero().squeeze(1)
        for t in ids[torch.argsort(order[ids], descending=True, stable=True)].tolist():
            if self.fits(t):
                return t
        so_far = b"".join(self.vocab[t] for t in self.taken[-60:])[-60:].decode("utf-8", "replace")
        raise DeadEnd(f"no token of the vocabulary continues the reply ({so_far!r} so far) under its JSON schema; "
                      f"with a vocabulary of every byte, that is where a string's pattern needs a character "
                      f"not written under a pattern (one beyond U+FFFF, such as an emoji, or a control "
                      f"character that needs a \\u escape): let the pattern take another there, or drop it")

    def _open(self, n: int) -> torch.Tensor:
        """Which of ``n`` token ids begin with a byte the reply can take next (bool ``[n]``)."""
        takes = torch.tensor([self.prefix.copy().feed(b) for b in range(256)] + [False])
        first = _first_bytes(self.vocab)
        out = torch.zeros(n, dtype=torch.bool)
        m = min(n, first.numel())
        out[:m] = takes[first[:m]]
        return out


_FIRST_BYTES: dict[int, tuple] = {}  # id of a vocabulary's byte table: (the table, its tokens' first bytes)


def _first_bytes(vocab: list) -> torch.Tensor:
    """The first byte of each token of ``vocab`` (256 for a token with none), once per table (the few most
    recent kept, with the table so that its id is not reused)."""
    key = id(vocab)
    if key not in _FIRST_BYTES:
        if len(_FIRST_BYTES) >= 8:
            _FIRST_BYTES.pop(next(iter(_FIRST_BYTES)))
        _FIRST_BYTES[key] = (vocab, torch.tensor([v[0] if v else 256 for v in vocab], dtype=torch.long))
    return _FIRST_BYTES[key][1]


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
