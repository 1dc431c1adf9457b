"""JSON mode for ``kvcompile serve`` (OpenAI's ``response_format: {"type": "json_object"}``, and ``"json_schema"``
with a schema), on llguidance: every token a request generates keeps its reply a prefix of one JSON object (one
that follows the schema, when it gives one), and once the document is whole the reply ends.

llguidance (the grammar engine of vLLM, SGLang and llama.cpp) compiles the schema -- for JSON mode, ``{"type":
"object"}`` -- into a grammar (``grammar``) and, at each step, computes which token ids of the model's vocabulary
keep the reply a prefix of a document the grammar takes (``JsonConstraint.allowed``), from the tokenizer's own
``tokenizer.json`` (``tokenizer_info``: nothing is downloaded). The processor list that picks every row's token
(``kvcompile.sampling``) gives the other tokens a logit of -inf before the row's greedy or sampled pick, so a
constrained row's token is the best allowed one or a draw from the distribution restricted to allowed tokens;
the end-of-sequence tokens are allowed only once the document is whole (``JsonConstraint.mask_``).

A schema llguidance does not follow is refused (``SchemaError``, naming the keyword or format), never followed
loosely: its compiler runs with ``lenient`` off, so an unimplemented keyword (``uniqueItems``, ``not``,
``propertyNames``, ...) or format is an error rather than dropped. A schema that is not valid JSON Schema
(draft 2020-12: ``"exclusiveMinimum": true``, a list as ``items``, ...) is refused by ``jsonschema``'s check
against the meta-schema first, as llguidance would read some of those as something else.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from .errors import ArgumentError, KVCompileError, UnsupportedError

MAX_SPACE = 12  # whitespace bytes in a row (a newline and the indentation of five levels of two spaces)
# llguidance's JSON options: whitespace between tokens in runs of at most MAX_SPACE bytes (unbounded, a model can
# pad a reply with it until max_tokens); no keyword or format dropped (``lenient``) and no oneOf read as anyOf
# (``coerce_one_of``) -- either would follow a schema loosely; and any character may be written as a \u escape
# (pairs for those beyond U+FFFF), as JSON allows, where no pattern bounds the string (llguidance's default takes
# escapes of control characters only)
OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_SPACE}}}", "lenient": False, "coerce_one_of": False,
           "json_allow_general_unicode_escapes": True}
ANY_OBJECT = {"type": "object"}  # JSON mode without a schema
# llguidance's "date" takes February 29 in every year and its times a 60th second (RFC 3339's leap second), which
# pydantic's date and datetime -- and Python's -- refuse, as they refuse the year 0000: a pattern beside those
# formats keeps replies to real days of years 0001 to 9999 and seconds 00 to 59 (llguidance follows both)
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_SECONDS = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
DATES = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}[Tt]{_SECONDS}", "time": f"^{_SECONDS}"}
_VALUES = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data, not schemas
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # name: schema


class SchemaError(ArgumentError):
    """A JSON schema that is not followed here: what llguidance or the meta-schema check refused."""


class DeadEnd(KVCompileError, RuntimeError):
    """No token of the vocabulary continues a constrained reply."""


def grammar(schema: dict | None = None) -> str:
    """llguidance's grammar for replies that follow ``schema`` (None: any JSON object), or ``SchemaError`` saying
    what is not followed (llguidance's own words: ``Unimplemented keys: ["uniqueItems"]``, ``Unknown format:
    ipvanyaddress``, a regular expression it does not read, a schema no document follows, ...)."""
    from llguidance import LLMatcher

    schema = ANY_OBJECT if schema is None else schema
    if not isinstance(schema, dict):
        raise SchemaError(f"the schema must be a JSON object, got {type(schema).__name__}")
    if "x-guidance" in schema:
        raise SchemaError("'x-guidance' (llguidance's options) is set by the server (whitespace runs of at most "
                          f"{MAX_SPACE} bytes, every keyword followed or refused); leave it out of the schema")
    _check_meta(schema)
    # the options go into the schema's text rather than through ``overrides``: with overrides llguidance reads
    # the schema and writes it back, and its reader is not correctly rounded (a const of 1801439850948199.0 came
    # back as 1801439850948199.2); its grammar keeps the text as given, and numbers are read exactly from it
    try:  # (a request's JSON may spell a lone surrogate, "\\ud800", which llguidance would write as bad UTF-8)
        text = json.dumps({**_real_dates(_exact_numbers(schema)), "x-guidance": OPTIONS}, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise SchemaError(f"the schema holds {e.object[e.start:e.end]!r}, half of a surrogate pair, which no "
                          f"UTF-8 text can write") from None
    out = LLMatcher.grammar_from_json_schema(text.decode())
    refused = LLMatcher.validate_grammar(out)
    if refused:
        raise SchemaError(f"the schema is not followed here: {refused} (docs/usage.md lists the keywords and "
                          f"formats that are); drop that part or write it with them")
    return out


def _real_dates(node):
    """``node`` (a schema, or a part of one) with ``DATES``' pattern beside every ``format`` it names (in
    ``allOf`` where the schema has a pattern of its own: a string follows both)."""
    if isinstance(node, list):
        return [_real_dates(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _VALUES:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):  # (a property may be named "enum" or "format")
            out[k] = {name: _real_dates(sub) for name, sub in v.items()}
        else:
            out[k] = _real_dates(v)
    exact = DATES.get(out.get("format")) if isinstance(out.get("format"), str) else None
    if exact is not None:
        if "pattern" in out:
            out["allOf"] = [*out.get("allOf", []), {"pattern": exact}]
        else:
            out["pattern"] = exact
    return out


_UNREAD = frozenset({"default", "examples", "title", "description", "$comment"})  # data nothing is checked against


def _exact_numbers(node, where: str = "", written: bool = False):
    """``node`` with every number llguidance would read as another number refused (``SchemaError``), an integral
    one given as an integer (``5.0`` as ``5``, equal in JSON Schema), which it reads exactly. llguidance 1.9.1
    reads a schema's numbers as serde_json does by default, not correctly rounded (``_llguidance_reads``): about
    one random double in five comes out a step away, and a const, an enum member or a bound would then be another
    number than the schema's. Values replies write (``written``: const and enum members) that are whole and beyond
    2**53 are refused too: llguidance writes them through a double as integer digits (9223372036854775809 as
    9223372036854776000, 1e300 as 1 and 300 zeros)."""
    if isinstance(node, list):
        return [_exact_numbers(x, f"{where}[{i}]", written) for i, x in enumerate(node)]
    if isinstance(node, dict):
        return {k: v if k in _UNREAD else _exact_numbers(v, f"{where}[{k!r}]", written or k in ("const", "enum"))
                for k, v in node.items()}
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return node
    if written and node == int(node) and abs(node) > 2**53:
        raise SchemaError(f"the number {node!r} at schema{where} is a value replies write, and llguidance (the "
                          f"JSON engine) writes such a value through a double, with the digits of an integer: "
                          f"an integer beyond 2**53 ({2**53}) in magnitude or a whole double that large would be "
                          f"written as another number; a const or enum takes numbers up to 2**53")
    if isinstance(node, float) and node.is_integer() and abs(node) < 2**63:
        node = int(node)
    read = _llguidance_reads(json.dumps(node))
    if read != node:
        near = next(x for x in (float(f"{node:.{k}g}") for k in range(15, 0, -1))
                    if _llguidance_reads(json.dumps(x)) == x)
        raise SchemaError(f"the number {node!r} at schema{where or ' (the top level)'} would be read by llguidance "
                          f"(the JSON engine) as {read!r}, and replies would follow that number instead: it reads "
                          f"numbers of up to 15 significant digits and 22 decimal places exactly; round it (to "
                          f"{near!r}, for instance)")
    return node


def _llguidance_reads(text: str) -> float | int | None:
    """The number llguidance 1.9.1 takes ``text`` (a JSON number) for: serde_json's default reading, the digits
    as one 64-bit integer, then as a double multiplied or divided by a power of ten (exact for at most 15
    digits and exponents up to 22, a step off for about one double in five beyond). None where the digits
    overflow 64 bits. Checked against llguidance's own reading in tests/test_json_mode.py."""
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text)
    digits, _, exp = body.lower().partition("e")
    whole, _, frac = digits.partition(".")
    significand, power = int(whole + frac), (int(exp) if exp else 0) - len(frac)
    if significand >= 2**64:
        return None
    if not frac and not exp:  # an integer: read exactly (i64, or u64 when positive)
        return sign * significand if sign * significand >= -2**63 else None
    x = float(significand)
    while abs(power) > 308 and x != 0.0:  # (serde's table of powers ends at 1e308)
        if power > 0:
            return sign * math.inf
        x, power = x / 1e308, power + 308
    if x != 0.0:
        x = x * float(f"1e{power}") if power >= 0 else x / float(f"1e{-power}")
    return sign * x


def _check_meta(schema: dict) -> None:
    """``schema`` is valid JSON Schema (draft 2020-12, what OpenAI's structured outputs and pydantic write):
    checked by ``jsonschema`` against the meta-schema, its first error reported with where it is."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    error = best_match(Draft202012Validator(Draft202012Validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "".join(f"[{p!r}]" for p in error.absolute_path) or " (the top level)"
        raise SchemaError(f"the schema is not valid JSON Schema (draft 2020-12) at schema{where}: {error.message}")


_INFOS: dict[tuple, tuple] = {}  # (id of a tokenizer, vocabulary size, end tokens): (the tokenizer, its info)


def tokenizer_info(tokenizer, vocab: int, stops: tuple[int, ...]):
    """llguidance's view of ``tokenizer`` (a transformers fast tokenizer; its Rust tokenizer's JSON, read
    locally) over a model vocabulary of ``vocab`` ids (ids past the tokenizer's are never allowed), the reply
    ending on any of ``stops``. Built once per tokenizer (about a second for SmolLM2's 49,152 tokens), held with
    the tokenizer so that its id is not reused."""
    import llguidance.hf

    key = (id(tokenizer), vocab, tuple(stops))
    if key not in _INFOS:
        try:
            info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(stops))
        except ValueError as e:
            raise UnsupportedError(f"JSON mode needs the model's tokenizer as llguidance reads it ({e}): serve a "
                                   f"model with a fast (tokenizer.json) tokenizer") from None
        _INFOS[key] = (tokenizer, info)
    return _INFOS[key][1]


class JsonConstraint:
    """One request's JSON mode: llguidance's matcher of ``grammar`` (``grammar()``) over ``info``
    (``tokenizer_info``), advanced by each token the reply takes (``took``)."""

    def __init__(self, info, grammar_: str):
        from llguidance import LLMatcher, LLParserLimits

        # terse errors: a request's failure message names what went wrong, not the parser's state and grammar
        self.matcher = LLMatcher(info, grammar_, log_level=0, limits=LLParserLimits(verbose_errors=False))
        if self.matcher.is_error():
            raise SchemaError(f"the schema is not followed here: {self.matcher.get_error()}")
        self.vocab, self.stops = info.vocab_size, list(info.eos_tokens)
        self._bits = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """Which token ids may come next (bool ``[vocab]``): those that keep the reply a prefix of a document
        the grammar takes; an end token only once the document is whole (an end token whose bytes could stand
        in a string is text to llguidance, and picking it would end the reply mid-object). ``DeadEnd`` when
        none may."""
        return torch.from_numpy(self._allowed())

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [V]`` with every token that may not come next at -inf, in place (ids past the vocabulary
        llguidance knows, the model's padding, included)."""
        blocked = torch.from_numpy(~self._allowed())
        logits[:self.vocab].masked_fill_(blocked.to(logits.device), float("-inf"))
        if logits.numel() > self.vocab:
            logits[self.vocab:] = float("-inf")
        return logits

    def _allowed(self) -> np.ndarray:
        # numpy, not torch, on the 49K-entry rows: torch's any() and ~ of a bool row took about 100 us each here
        # (thread CPU time, one thread), numpy's a few
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bits.unsqueeze(0), 0)
        if self.matcher.is_error():
            raise DeadEnd(f"llguidance could not continue the reply: {self.matcher.get_error()}")
        # bit i of 32-bit word w is token 32 w + i: the words' bytes little-endian, each byte's bits low first
        words = self._bits.numpy().astype("<i4", copy=False)
        out = np.unpackbits(words.view(np.uint8), count=self.vocab, bitorder="little").view(np.bool_)
        if not self.matcher.is_accepting():
            out[self.stops] = False
        if not out.any():
            raise DeadEnd("no token of the vocabulary continues the reply under its JSON schema (a vocabulary "
                          "without some byte as a token of its own can leave none)")
        return out

    def took(self, token: int) -> None:
        """The reply goes on with ``token`` (one ``allowed`` allowed)."""
        if not self.matcher.consume_token(token):
            raise DeadEnd(f"token {token} does not continue the reply's JSON: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The reply is a whole document (and may end)."""
        return self.matcher.is_accepting()
