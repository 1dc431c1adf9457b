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
                                  '{"a":     1}'])
def test_what_is_no_json_object_is_refused(text):
    assert read(text.encode()) != (len(text.encode()), True)


def vocabulary():
    pieces = ["{", "}", "[", "]", '"', ":", ",", " ", "a", "b", "1", "0", "-", ".", "e", "true", "null", '"a"',
              '{"', '":', '",', "x\n", "\\", "é"]
    return [p.encode() for p in pieces] + [None]  # a special token, never in JSON text


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("sampled", [False, True])
def test_a_constrained_pick_ends_in_a_json_object(seed, sampled):
    """Picking every token under the constraint -- the best-scoring fitting one, or a draw restricted to fitting
    ones -- with random scores at each step gives a JSON object, then the end token, and never a token that
    does not fit (the end token included, before the object is whole)."""
    vocab = vocabulary()
    eos = len(vocab) - 1
    closers = torch.tensor([vocab.index(p) for p in (b"}", b"]", b'"')])
    c = JsonConstraint(vocab, eos)
    g = torch.Generator().manual_seed(seed)
    out = b""
    for _ in range(400):
        scores = torch.randn(len(vocab), generator=g) * 3
        scores[eos] += 5  # the end token is tempting: it must wait for the object's end
        scores[closers] += 2  # and the random walk's depth drifts down, so that it ends
        probs = torch.softmax(scores, -1) if sampled else None
        t = c.pick(scores, probs, (lambda p: torch.multinomial(p, 1, generator=g)) if sampled else None)
        if t == eos:
            break
        c.took(t)
        out += vocab[t]
    else:
        pytest.fail(f"no end after 400 tokens: {out!r}")
    assert isinstance(json.loads(out), dict), out
    assert c.pick(torch.zeros(len(vocab))) == eos  # once whole, only the end


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
