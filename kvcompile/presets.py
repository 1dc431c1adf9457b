"""The named policies: the presets people write (``kivi+rot+sink:4``, ``int8``, ``tok+rot:2``), and how a name, a
short form or a policy file becomes a ``Policy``.

``named(text)`` is what every place that takes a policy by name reads (``kvcompile serve --policy``, ``eval``,
``plan``, the vLLM plugin's ``additional_config``): ``"default"`` (``default_policy``), ``"full"``, ``SCHEME:BITS``
(``SCHEMES``), a short form (``int8`` for a scheme with one width, ``kivi4`` for ``kivi:4``; ``spelled``) or a
policy file (``*.json``, written by ``Policy.save`` or ``kvcompile calibrate``). Part of the core: it imports only
the policy module.
"""
from __future__ import annotations

import re
from typing import Callable

from .errors import PolicyError
from .policy import Policy, Quant

WIDTHS = (2, 3, 4, 8)  # the bit widths a scheme may be asked for

# Each scheme maps a bit width to a policy (None: that width is not meaningful for the scheme).


def naive(bits: int) -> Policy:
    """The naive scheme: symmetric round-to-nearest of each head's key and value at every token."""
    q = Quant(f"int{bits}", "token", None, symmetric=True)
    return Policy(q, q)


def _kivi(bits, **kw):
    return Policy.kivi(bits, **kw)


def _tok(bits, symmetric=False, sink=0, scale_dtype="float16"):
    q = Quant(f"int{bits}", "token", None, symmetric=symmetric, scale_dtype=scale_dtype)
    return Policy(q, q, residual=0, sink=sink, rotate=True)


def _only(bits_wanted: int, make: Callable[[], Policy]) -> Callable[[int], Policy | None]:
    return lambda bits: make() if bits == bits_wanted else None


SCHEMES: dict[str, Callable[[int], Policy | None]] = {
    "naive": naive,
    "kivi": lambda b: _kivi(b),
    "kivi+rot": lambda b: _kivi(b, rotate=True),
    "fp8": _only(8, lambda: Policy.fp8("fp8_e4m3", residual=128)),
    "fp8-r0": _only(8, lambda: Policy.fp8("fp8_e4m3", residual=0)),
    "int8": _only(8, lambda: Policy.int8()),
    # The policy's other tools, one at a time and combined (only widths below 8 are meaningful for them):
    # sinks keep the first tokens (the attention sink, whose huge key would set the scale of its whole
    # channel group) in full precision; g16 halves the group size (twice the scale overhead); l0 keeps the
    # first layer at 8 bits (per-layer override).
    "kivi+sink": lambda b: _kivi(b, sink=4) if b < 8 else None,
    "kivi-g16": lambda b: _kivi(b, group=16) if b < 8 else None,
    "kivi+rot+sink": lambda b: _kivi(b, sink=4, rotate=True),
    "kivi+sink+l0": lambda b: _kivi(b, sink=4).override({0: _kivi(8, sink=4)}) if b < 8 else None,
    # Bits moved from values to keys at the bytes of 2-bit KIVI: keys int3 and values int2, both in groups of
    # 64 (half the scale overhead), an 80-token residual (so the ring, residual + group - 1, is no longer
    # than KIVI's 128 + 31); bytes/token at or below kivi+rot+sink:2 at every length. Keys are the side
    # that 2-bit passkey retrieval is sensitive to (docs/eval.txt).
    "kivi-k3v2": _only(2, lambda: Policy(Quant("int3", "channel", 64), Quant("int2", "token", 64), residual=80,
                                         sink=4, rotate=True)),
    # Pre-RoPE keys (KVQuant; Policy.pre_rope): per-channel key scales fit the outlier channels before the
    # rotary embedding smears them over channel pairs. Only the compiled path stores them (the FX pass finds the
    # embedding), so these need the compiled model; +rot rotates values only (keys cannot be Hadamard-rotated).
    "kivi+pre+sink": lambda b: _kivi(b, sink=4, pre_rope=True) if b < 8 else None,
    "kivi+pre+rot+sink": lambda b: _kivi(b, sink=4, rotate=True, pre_rope=True) if b < 8 else None,
    # 8-bit formats with the same tools: rotation spreads the keys' outlier channels over the head.
    "int8+rot": _only(8, lambda: Policy.int8(rotate=True)),
    "fp8+rot+sink": _only(8, lambda: Policy.fp8("fp8_e4m3", residual=128, sink=4, rotate=True)),
    # Serving policies (kvcompile.serving): no full-precision window per request. Keys and values per token
    # over the whole head (one scale, and a zero point unless +sym, per 64 channels) after the Hadamard
    # rotation, which spreads the keys' outlier channels so that per-token keys quantize; residual 0 and a
    # flush group of 1, so a request slot holds no ring. +sink keeps the first 4 tokens in full precision.
    "tok+rot": lambda b: _tok(b),
    "tok+rot+sym": lambda b: _tok(b, symmetric=True),
    "tok+rot+sink": lambda b: _tok(b, sink=4),
    "tok+rot+sym+sink": lambda b: _tok(b, symmetric=True, sink=4),
    "fp8-r0+rot": _only(8, lambda: Policy.fp8("fp8_e4m3", residual=0, rotate=True)),
    # fp8 with one fixed scale, 1.0, none stored (Quant axis="tensor"): one byte an element and nothing else, the
    # bytes of vLLM's own fp8 cache; fp8-tensor is its arithmetic exactly, +rot spreads the keys' outlier
    # channels first (a quarter of its held-out loss on SmolLM2: docs/vllm.md)
    "fp8-tensor": _only(8, lambda: Policy.fp8("fp8_e4m3", residual=0, axis="tensor")),
    "fp8-tensor+rot": _only(8, lambda: Policy.fp8("fp8_e4m3", residual=0, axis="tensor", rotate=True)),
    # fp8 scales (Quant.scale_dtype="fp8_e4m3"): each group's scale rounded up to one byte, an int8 zero point;
    # half the scale overhead of the fp16 scale and zero point.
    "kivi+rot+sink+fp8s": lambda b: _kivi(b, sink=4, rotate=True, scale_dtype="fp8_e4m3") if b < 8 else None,
    "kivi-r0+rot+sink+fp8s": lambda b: (_kivi(b, residual=0, sink=4, rotate=True, scale_dtype="fp8_e4m3")
                                        if b < 8 else None),
    # KIVI's groups without a window or sinks: what an engine's pages hold with a ring for the pending key group
    # alone (kvcompile inside vLLM: docs/vllm.md), with fp16 or one-byte scales
    "kivi-r0+rot": lambda b: _kivi(b, residual=0, rotate=True) if b < 8 else None,
    "kivi-r0+rot+fp8s": lambda b: _kivi(b, residual=0, rotate=True, scale_dtype="fp8_e4m3") if b < 8 else None,
    "tok+rot+fp8s": lambda b: _tok(b, scale_dtype="fp8_e4m3"),
    # ... and groups of 64 (keys: 64 tokens a channel; values: the whole head of SmolLM2), a quarter of the
    # fp16 scales' overhead: the most requests per byte of the KIVI layouts once requests are long enough for
    # the window (residual + group - 1 = 191 tokens) to be a small part of them (docs/results.md, long requests)
    "kivi-g64+rot+sink+fp8s": lambda b: (_kivi(b, group=64, sink=4, rotate=True, scale_dtype="fp8_e4m3")
                                         if b < 8 else None),
}


def scheme_policy(name: str, bits: int) -> Policy | None:
    """The policy of scheme ``name`` at ``bits`` (None: that width is not meaningful for the scheme)."""
    try:
        make = SCHEMES[name]
    except KeyError:
        raise PolicyError(f"unknown scheme {name!r}: expected one of {sorted(SCHEMES)}") from None
    return make(bits)


def parse_entry(entry: str) -> tuple[str, int]:
    """``"kivi:4"`` -> ``("kivi", 4)``."""
    name, _, bits = entry.rpartition(":")
    if not name or not bits.isdigit():
        raise PolicyError(f"{entry!r}: expected SCHEME:BITS, e.g. kivi:4 (schemes: {', '.join(SCHEMES)})")
    return name, int(bits)


def is_policy_file(entry: str) -> bool:
    """An entry that names a policy file (``Policy.save``, ``kvcompile calibrate``), not ``SCHEME:BITS``."""
    return entry.endswith(".json")


def default_policy() -> Policy:
    """The demo's policy: 4-bit KIVI with 4 attention-sink tokens in full precision and a Hadamard rotation.

    Measured on SmolLM2 (docs/eval.json): +0.0011 nats/token on held-out text (the best 4-bit policy there),
    passkey retrieval equal to full precision at 1K-8K, 0.37x the bf16 bytes at 2K context.
    """
    return Policy.kivi(4, sink=4, rotate=True)


def widths(name: str) -> list[int]:
    """The bit widths scheme ``name`` has a policy for."""
    return [b for b in WIDTHS if SCHEMES[name](b) is not None]


def entry_policy(text: str) -> Policy:
    """``SCHEME:BITS`` -> its policy; a ``PolicyError`` that lists the choices for anything else."""
    name, bits = parse_entry(text)
    pol = scheme_policy(name, bits)
    if pol is None:
        raise PolicyError(f"scheme {name!r} has no {bits}-bit policy: use {name}:{' or '.join(map(str, widths(name)))}")
    return pol


def spelled(text: str) -> str:
    """The short forms people type for a preset, as ``SCHEME:BITS``: a scheme with one width alone (``int8``,
    ``fp8`` -> ``int8:8``, ``fp8:8``), or its width written on (``kivi4`` -> ``kivi:4``). Anything else as given."""
    if ":" in text:
        return text
    if text in SCHEMES:
        ws = widths(text)
        if len(ws) == 1:
            return f"{text}:{ws[0]}"
        raise PolicyError(f"{text!r} needs a width, as SCHEME:BITS: {', '.join(f'{text}:{b}' for b in ws)}")
    m = re.fullmatch(r"(.+?)[:_-]*(\d+)", text)
    if m and m.group(1) in SCHEMES:
        return f"{m.group(1)}:{m.group(2)}"
    return text


def named(text: str) -> Policy:
    """The policy a name stands for: ``default``, ``full``, ``SCHEME:BITS`` or a short form (``spelled``), or a
    policy file (``*.json``, written by ``Policy.save`` or ``kvcompile calibrate``). A ``PolicyError`` saying what
    was found and what is accepted for anything else."""
    if not isinstance(text, str):
        raise PolicyError(f"a policy name must be a string (a preset such as 'kivi+rot+sink:4', 'int8', 'full', or "
                          f"a policy file *.json); got {type(text).__name__} {text!r}")
    if text == "default":
        return default_policy()
    if text == "full":
        return Policy.full()
    return Policy.load(text) if is_policy_file(text) else entry_policy(spelled(text))
