"""JSON mode for ``kvcompile serve`` (OpenAI's ``response_format: {"type": "json_object"}``): every token a
request generates keeps its reply a prefix of one JSON object, and once the object is closed the reply ends.

``JsonPrefix`` reads a reply byte by byte (RFC 8259, UTF-8, the top level an object, runs of whitespace
between tokens of at most ``MAX_SPACE`` bytes so that a model cannot pad forever); ``JsonConstraint`` holds a
request's prefix and the vocabulary's bytes, and picks each token (``pick``): the most likely token that keeps
the prefix, or a draw from the distribution restricted to those tokens, and the end-of-sequence token once the
object is complete. The processor list that picks every row's token (``kvcompile.sampling``) calls it.
"""
from __future__ import annotations

import torch

MAX_SPACE = 4  # whitespace bytes in a row (between tokens of the JSON text)
WS = frozenset(b" \t\n\r")
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_ESCAPES = frozenset(b'"\\/bfnrtu')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")

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
        out = JsonPrefix.__new__(JsonPrefix)
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
        n, digit = self.num, b in _DIGITS
        if n == "-":
            if digit:
                self.num = "0" if b == ord("0") else "int"
                return True, False
            return False, False
        if n in ("0", "int"):
            if digit and n == "int":
                return True, False
            if b == ord("."):
                self.num = "."
                return True, False
            if b in (ord("e"), ord("E")):
                self.num = "e"
                return True, False
            return (not digit), True  # "0" followed by a digit is no number
        if n == ".":
            if digit:
                self.num = "frac"
                return True, False
            return False, False
        if n == "frac":
            if digit:
                return True, False
            if b in (ord("e"), ord("E")):
                self.num = "e"
                return True, False
            return True, True
        if n == "e":
            if b in (ord("+"), ord("-")):
                self.num = "esign"
                return True, False
            if digit:
                self.num = "exp"
                return True, False
            return False, False
        if n == "esign":
            if digit:
                self.num = "exp"
                return True, False
            return False, False
        # "exp"
        return (True, False) if digit else (True, True)


class JsonConstraint:
    """A request's JSON mode: its reply so far (``prefix``), the bytes of every token of the vocabulary
    (``vocab[i]``: None for a token that never stands in JSON text, such as special tokens), the token that
    ends the reply (``eos``) and every token that would end it (``stops``: the model's end-of-sequence tokens,
    which never stand in JSON text even where their bytes could)."""

    def __init__(self, vocab: list[bytes | None], eos: int, stops=()):
        self.vocab, self.eos, self.stops = vocab, eos, frozenset(stops) | {eos}
        self.prefix = JsonPrefix()

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
        fitting token). ``None`` when no token fits (it cannot happen with a vocabulary holding the JSON
        punctuation as single tokens)."""
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
        for t in torch.argsort(order, descending=True, stable=True).tolist():
            if self.fits(t):
                return t
        return None


_VOCABS: dict[tuple[int, int], tuple] = {}  # (id of the tokenizer, size): (the tokenizer, its table)


def vocab_bytes(tokenizer, size: int) -> list[bytes | None]:
    """The bytes of each of ``size`` token ids (``tokenizer``: a Rust ``tokenizers.Tokenizer``; ids past its
    vocabulary and special tokens: None), once per tokenizer (held with its table, so that its id is not
    reused by another)."""
    key = (id(tokenizer), size)
    if key not in _VOCABS:
        from .serve import token_bytes

        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        _VOCABS[key] = (tokenizer, [None if i >= n or tokenizer.id_to_token(i) in special
                                    else token_bytes(tokenizer, i) for i in range(size)])
    return _VOCABS[key][1]
