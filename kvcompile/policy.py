"""What a user writes: how each layer's KV cache is stored.

``Quant`` says how one tensor (keys or values) is stored; ``Policy`` says how one layer's cache is stored;
``Policy.override`` chooses per layer. All are frozen dataclasses validated at construction, so a bad value
fails where it is written and compile caches can key on them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .errors import PolicyError

# format -> bits per stored element.
FORMAT_BITS = {
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "int4": 4,
    "int3": 3,
    "int2": 2,
    "none": 0,  # full precision: the element keeps the model's dtype
}
AXES = ("token", "channel", "tensor")
KIVI_GROUP = 32  # Policy.kivi's default: tokens per key scale, channels per value scale (fitting the head)
SCALE_DTYPES = ("float16", "float32", "fp8_e4m3")
# Upper bounds on sizes, so that a value no model can use fails where it is written, not later as an allocator
# error: no model holds more positions than MAX_TOKENS (the longest context today, Llama 4 Scout's, is 10M
# tokens), nor heads wider than MAX_HEAD_DIM channels (256 at most among the families kvcompile serves).
MAX_TOKENS = 2**24      # a residual window, sinks, a per-channel group (tokens per scale)
MAX_HEAD_DIM = 1024     # a per-token group (channels per scale)


# The version field of a policy file (``Policy.save``); a later format bumps it and keeps reading this one.
POLICY_FILE_FIELD = "kvcompile_policy"
POLICY_FILE_VERSION = 1




def _fail(field_name: str, value: Any, allowed: str) -> None:
    raise PolicyError(f"{field_name}={value!r} is not valid: {allowed}.")


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class Quant:
    """How one tensor (keys or values) of one layer is stored.

    format:    "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int3", "int2" or "none" (full precision).
    axis:      "token"   -> one scale per token over ``group`` consecutive channels
                            (``group=None`` means the whole head: per-token-head).
               "channel" -> one scale per channel over ``group`` consecutive tokens (KIVI keys).
               "tensor"  -> fp8 only: one scale for the whole tensor, 1.0, not stored -- each element is the
                            format's nearest value, saturating (vLLM's fp8 cache without checkpoint scales):
                            one byte per element and nothing else, so an engine's page holds as many tokens as
                            vLLM's fp8. A token-head holding NaN or +-inf reads NaN (its codes are the NaN code).
    group:     a positive power of two; required for axis="channel".
    symmetric: absmax scaling with no zero point. ``None`` picks the format's natural choice:
               asymmetric (min/max) for integers, symmetric for fp8 (the only fp8 mode).
    scale_dtype: "float16" (default; 16 bits per scale and per zero point), "float32" (exact, twice the
               overhead) or "fp8_e4m3" (8 bits per scale, rounded up to fp8, and an int8 zero point: half the
               overhead; ``kvcompile.quant`` gives the rule).
    fit:       axis="token" only: ``group`` is the most channels a scale covers, and a head whose head_dim it does
               not divide takes the largest power of two that does (32 -> 16 for head_dim 80, 8 for 120).
               ``Policy.kivi``'s default group fits; a group given explicitly is kept or refused (``check``).
    """

    format: str = "int8"
    axis: str = "token"
    group: int | None = None
    symmetric: bool | None = None
    scale_dtype: str = "float16"
    fit: bool = False

    def __post_init__(self):
        # isinstance first: an unhashable value (a list) must fail here with the field's name, not as a raw
        # TypeError from the membership test
        if not isinstance(self.format, str) or self.format not in FORMAT_BITS:
            _fail("Quant.format", self.format, f"expected one of {sorted(FORMAT_BITS)}")
        if not isinstance(self.axis, str) or self.axis not in AXES:
            _fail("Quant.axis", self.axis, 'expected "token" (one scale per token), "channel" (one per channel) or '
                                           '"tensor" (fp8: one fixed scale, not stored)')
        if self.axis == "tensor" and self.quantized:
            if not self.is_fp8:
                _fail("Quant.axis", self.axis, f'"tensor" (one fixed scale, 1.0, not stored) is for fp8 formats only: '
                                               f'{self.format} needs a scale that fits its values; use axis="token"')
            if self.group is not None:
                _fail("Quant.group", self.group, 'axis="tensor" has one scale for the whole tensor: leave group None')
            if self.scale_dtype != "float16" or self.symmetric is False:
                what = ("Quant.scale_dtype", self.scale_dtype) if self.scale_dtype != "float16" else \
                    ("Quant.symmetric", self.symmetric)
                _fail(*what, 'axis="tensor" stores no scale (it is 1.0) and no zero point: leave it at its default')
        if self.group is not None and not _is_pow2(self.group):
            _fail("Quant.group", self.group, "expected a positive power of two (an int, e.g. 32) or None for a "
                                             "whole head")
        if self.group is not None and self.group > (MAX_TOKENS if self.axis == "channel" else MAX_HEAD_DIM):
            _fail("Quant.group", self.group,
                  f"expected at most {MAX_TOKENS:,} tokens per scale (axis='channel'; KIVI uses 32 to 128)"
                  if self.axis == "channel" else
                  f"expected at most {MAX_HEAD_DIM} channels per scale (axis='token': a group lies within one "
                  f"head, and no model's head is wider), or None for the whole head")
        if self.axis == "channel" and self.group is None and self.format != "none":
            _fail("Quant.group", None, 'axis="channel" needs a token group size, e.g. group=32')
        if not isinstance(self.scale_dtype, str) or self.scale_dtype not in SCALE_DTYPES:
            _fail("Quant.scale_dtype", self.scale_dtype, f"expected one of {SCALE_DTYPES}")
        if not isinstance(self.fit, bool) or (self.fit and (self.axis != "token" or self.group is None)):
            _fail("Quant.fit", self.fit, 'expected True (the group shrinks to divide head_dim; axis="token" with a '
                                         'group only) or False')
        # a real bool only: bool("no") and bool("false") are True, so a string here would silently mean the
        # opposite of what it says
        if self.symmetric is not None and not isinstance(self.symmetric, bool):
            _fail("Quant.symmetric", self.symmetric, "expected True (absmax, no zero point), False (min/max with "
                                                     "a zero point) or None (the format's natural choice)")
        sym = self.symmetric
        if sym is None:
            sym = self.is_fp8
        if self.is_fp8 and not sym:
            _fail("Quant.symmetric", self.symmetric, "fp8 formats are symmetric only (one absmax scale)")
        object.__setattr__(self, "symmetric", bool(sym))

    @property
    def bits(self) -> int:
        return FORMAT_BITS[self.format]

    @property
    def is_fp8(self) -> bool:
        return self.format.startswith("fp8")

    @property
    def is_int(self) -> bool:
        return self.format.startswith("int")

    @property
    def quantized(self) -> bool:
        return self.format != "none"

    @property
    def stores_scale(self) -> bool:
        """Whether the store keeps a scale per group (every quantized format but axis="tensor", whose scale is
        1.0 and not stored)."""
        return self.quantized and self.axis != "tensor"

    @property
    def has_zero(self) -> bool:
        return self.is_int and not self.symmetric

    @property
    def zero_counts_steps(self) -> bool:
        """Whether the zero point is an int8 count of steps (``x^ = (code - zero) * scale``): with fp8 scales.
        Otherwise it is the group's minimum, stored as the scale is (``x^ = code * scale + zero``)."""
        return self.scale_dtype == "fp8_e4m3"

    def group_for(self, head_dim: int) -> int:
        """The resolved group size for a head of ``head_dim`` channels (``fit``: the largest power of two up to
        ``group`` that divides it)."""
        if self.group is None and self.axis != "channel":
            return head_dim
        g = int(self.group or 1)
        while self.fit and head_dim % g:
            g //= 2
        return g

    def for_head_dim(self, head_dim: int) -> "Quant":
        """This format with its group resolved for ``head_dim`` (``fit`` made explicit): the layout a store of
        that head size uses."""
        return replace(self, group=self.group_for(head_dim), fit=False) if self.fit else self

    def check(self, head_dim: int, what: str = "Quant") -> None:
        """Validate against a model's head dimension (called when a policy is applied)."""
        if not self.quantized:
            return
        if self.axis != "channel":
            g = self.group_for(head_dim)
            if head_dim % g:
                raise PolicyError(
                    f"{what}.group={g} does not divide head_dim={head_dim}: axis='token' groups split each "
                    f"head into head_dim/group channel groups. Use a power of two that divides {head_dim}, "
                    f"or group=None for one scale per token-head."
                )
        per_byte_multiple = {8: 1, 4: 2, 2: 4, 3: 8}[self.bits]
        if head_dim % per_byte_multiple:
            raise PolicyError(
                f"{what}.format={self.format!r} packs {per_byte_multiple} codes per whole byte run along head_dim, "
                f"but head_dim={head_dim} is not a multiple of {per_byte_multiple}."
            )

    def key(self) -> str:
        """A short name that spells out this format (used in kernel and compile cache keys)."""
        if not self.quantized:
            return "none"
        if self.axis == "tensor":
            return f"{self.format}.tensor"
        sym = "sym" if self.symmetric else "asym"
        g = "head" if self.group is None else f"{self.group}{'~' if self.fit else ''}"
        sd = {"float16": "f16", "float32": "f32", "fp8_e4m3": "e4m3"}[self.scale_dtype]
        return f"{self.format}.{self.axis}.{g}.{sym}.{sd}"


_NONE = Quant("none")


@dataclass(frozen=True)
class Policy:
    """How one layer's KV cache is stored.

    key, value: a ``Quant`` each.
    residual:   the most recent tokens kept in full precision (KIVI's streaming window).
    sink:       the first tokens kept in full precision (attention sinks).
    rotate:     apply an orthonormal Hadamard rotation over head_dim to keys, values and queries before
                quantization (exact in full precision; it spreads outlier channels): block-diagonal, in blocks
                of the largest power of two dividing head_dim (the whole head when it is one; 16 channels for
                head_dim 80, 32 for 96; ``kvcompile.store.rotation_block``). With ``pre_rope`` it applies to
                values only (docs/design.md, "Pre-RoPE keys").
    pre_rope:   store keys before the rotary embedding (KVQuant): per-channel key scales fit the sharp outlier
                channels there; attention rotates each dequantized key by its position. Only the compiled path
                can (the FX pass finds the rotary embedding on the key write); a layer whose rotary embedding
                the pass does not recognise stores post-RoPE keys, and ``kvcompile.explain`` says so.
    overrides:  per-layer choices added with ``override``; read them through ``resolve``.
    """

    key: Quant = _NONE
    value: Quant = _NONE
    residual: int = 0
    sink: int = 0
    rotate: bool = False
    overrides: tuple = field(default=(), compare=True)
    pre_rope: bool = False

    def __post_init__(self):
        for name in ("key", "value"):
            if not isinstance(getattr(self, name), Quant):
                _fail(f"Policy.{name}", getattr(self, name), "expected a kvcompile.Quant")
        for name in ("residual", "sink"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_TOKENS:
                _fail(f"Policy.{name}", v, f"expected a number of tokens from 0 to {MAX_TOKENS:,} (no model holds "
                                           f"more positions)")
        if not isinstance(self.rotate, bool):
            _fail("Policy.rotate", self.rotate, "expected True or False")
        if not isinstance(self.pre_rope, bool):
            _fail("Policy.pre_rope", self.pre_rope, "expected True (keys stored before the rotary embedding) or "
                                                    "False")
        _check_overrides(self.overrides)

    # ------------------------------------------------------------------ presets
    @classmethod
    def kivi(cls, bits: int = 4, group: int | None = None, residual: int = 128, scale_dtype: str = "float16",
             **kw) -> "Policy":
        """KIVI: keys per channel, values per token, asymmetric, recent tokens in full precision.
        ``group``: tokens per key scale and channels per value scale; by default 32, the value groups fitting
        the head (``Quant.fit``: 16 channels for head_dim 80). ``scale_dtype="fp8_e4m3"``: half the scale
        overhead (``Quant.scale_dtype``)."""
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (2, 3, 4, 8):
            _fail("Policy.kivi(bits)", bits, "expected 2, 3, 4 or 8")
        fmt = f"int{bits}"
        fit, group = group is None, KIVI_GROUP if group is None else group
        return cls(Quant(fmt, "channel", group, scale_dtype=scale_dtype),
                   Quant(fmt, "token", group, scale_dtype=scale_dtype, fit=fit), residual=residual, **kw)

    @classmethod
    def fp8(cls, format: str = "fp8_e4m3", residual: int = 128, axis: str = "token", **kw) -> "Policy":
        """fp8 keys and values with one scale per token-head (``axis="tensor"``: no scale stored, 1.0, vLLM's
        fp8 arithmetic; with ``rotate=True`` the rotation spreads the keys' outlier channels first); recent
        tokens in full precision."""
        if format not in ("fp8_e4m3", "fp8_e5m2"):
            _fail("Policy.fp8(format)", format, 'expected "fp8_e4m3" or "fp8_e5m2"')
        if axis not in ("token", "tensor"):
            _fail("Policy.fp8(axis)", axis, 'expected "token" (a scale per token-head) or "tensor" (none stored)')
        return cls(Quant(format, axis), Quant(format, axis), residual=residual, **kw)

    @classmethod
    def int8(cls, residual: int = 0, **kw) -> "Policy":
        """int8 keys and values, asymmetric, one scale and zero point per token-head."""
        return cls(Quant("int8", "token"), Quant("int8", "token"), residual=residual, **kw)

    @classmethod
    def full(cls) -> "Policy":
        """No quantization, through the same path (the control in every comparison)."""
        return cls()

    # ------------------------------------------------------------------ per layer
    def override(self, choices: Mapping[Any, "Policy | None"]) -> "Policy":
        """Choose other policies for some layers; later keys win over earlier ones.

        Keys: a layer index (negative counts from the end), a ``range`` of indices, a module name
        (``"model.layers.3"`` or any dotted prefix of the attention module's path), or ``"re:<regex>"``
        searched in the module path. A value of ``None`` keeps that layer in full precision.
        """
        if isinstance(choices, Mapping):
            pairs = dict(choices)
        else:
            try:  # (selector, policy) pairs are accepted too, as dict() reads them
                pairs = dict(choices)
            except (TypeError, ValueError):
                pairs = None
        if pairs is None or isinstance(choices, (str, bytes)):
            _fail("Policy.override(choices)", choices, "expected a dict {layer selector: Policy or None}, e.g. "
                                                        "policy.override({0: Policy.int8(), -1: None})")
        items = []
        for sel, pol in pairs.items():
            items.append((_normalize_selector(sel), Policy.full() if pol is None else _check_leaf(pol, sel)))
        return replace(self, overrides=self.overrides + tuple(items))

    def base(self) -> "Policy":
        return replace(self, overrides=())

    def choices(self) -> list["Policy"]:
        """Every policy a layer may get: the base, then each override's (before ``resolve`` names the layers)."""
        return [self.base()] + [pol for _, pol in self.overrides]

    def resolve(self, layer_names: Iterable[str]) -> list["Policy"]:
        """One concrete policy per layer, in order. A key that matches no layer is an error."""
        names = list(layer_names)
        out = [self.base()] * len(names)
        for sel, pol in self.overrides:
            hit = [i for i, n in enumerate(names) if _matches(sel, i, n, len(names))]
            if not hit:
                raise PolicyError(
                    f"policy override {_show_selector(sel)} matches none of the {len(names)} attention layers "
                    f"found ({names[0] if names else '-'} ... {names[-1] if names else '-'}); use an index in "
                    f"[-{len(names)}, {len(names)}), a range, a module name or 're:<regex>'."
                )
            for i in hit:
                out[i] = pol
        return out

    def check(self, head_dim: int) -> None:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            _fail("Policy.check(head_dim)", head_dim, "expected the model's head dimension, a positive int")
        self.key.check(head_dim, "Policy.key")
        self.value.check(head_dim, "Policy.value")
        for sel, pol in self.overrides:
            pol.check(head_dim)

    def for_head_dim(self, head_dim: int) -> "Policy":
        """This (base) policy with its groups resolved for ``head_dim`` (``Quant.for_head_dim``): the layout a
        store of that head size uses (``LayerSpec`` keeps this form)."""
        k, v = self.key.for_head_dim(head_dim), self.value.for_head_dim(head_dim)
        return self if (k, v) == (self.key, self.value) else replace(self, key=k, value=v)

    @property
    def ring(self) -> int:
        """Positions a sequence keeps in full precision beside its packed ones, its newest: ``residual + flush - 1``
        (the store's ring: the residual window and a per-channel group waiting to fill)."""
        return self.residual + self.flush - 1

    @property
    def flush(self) -> int:
        """Tokens move from the full-precision residual into packed storage in whole multiples of this.

        A per-channel tensor gets one scale per ``group`` tokens, so it can only be quantized once a whole
        group of tokens is complete (KIVI); per-token tensors flush token by token.
        """
        gs = [q.group for q in (self.key, self.value) if q.quantized and q.axis == "channel"]
        return max(gs) if gs else 1  # groups are powers of two, so the largest is their lcm

    def packed_tokens(self, tokens: int) -> int:
        """How many of a ``tokens``-token sequence's positions this (base) policy stores quantized: the store's
        ``Q(L) - S = floor(max(0, L - sink - residual) / flush) * flush``; the rest stay in full precision
        (sinks and the residual ring). 0 when neither keys nor values are quantized."""
        _check_tokens("Policy.packed_tokens(tokens)", tokens)
        if not (self.key.quantized or self.value.quantized):
            return 0
        return self.boundary(tokens) - self.sink

    def boundary(self, tokens):
        """Q(L): once a sequence holds ``L = tokens`` tokens, its positions ``[sink, Q(L))`` are in packed
        storage (the store's layout, ``kvcompile.store``): ``sink + floor(max(0, L - sink - residual) / flush) *
        flush``. The one place this rule is written. ``tokens``: an int, or an integer tensor (Q of each)."""
        f = self.flush
        if hasattr(tokens, "clamp_min"):  # a tensor (this module does not import torch)
            return self.sink + (tokens - self.sink - self.residual).clamp_min(0) // f * f
        return self.sink + (max(0, tokens - self.sink - self.residual) // f) * f

    def noop_reason(self, max_tokens: int, layer_names: Iterable[str] | None = None) -> str | None:
        """Why this policy quantizes nothing for sequences of up to ``max_tokens`` tokens, or None if it does.

        A reason when every layer that asks for quantization (base and overrides; only the layers'
        resolved policies when ``layer_names`` is given) keeps every token of a ``max_tokens``-token sequence in
        full precision: the sinks and the residual cover it (``sink + residual >= max_tokens``), or fewer
        tokens than one per-channel group can ever leave the residual (``max_tokens - sink - residual <
        group``), so no group is ever flushed. Layers whose formats are all "none" (``Policy.full()``) quantize
        nothing by request, and are not a reason; a policy with no quantized layer at all gives None.
        ``max_tokens``: e.g. the model's ``max_position_embeddings``, or the cache's capacity.
        """
        _check_tokens("Policy.noop_reason(max_tokens)", max_tokens)
        if layer_names is None:
            where = [("the base policy", self.base())] + [
                (f"the override for {_show_selector(sel)}", pol) for sel, pol in self.overrides]
        else:
            names = list(layer_names)
            where = [(f"layer {n}", pol) for n, pol in zip(names, self.resolve(names))]
        asking = [(w, p) for w, p in where if p.key.quantized or p.value.quantized]
        if not asking or any(p.packed_tokens(max_tokens) for _, p in asking):
            return None
        reasons = {}  # one line per distinct policy, naming where it is used
        for w, p in asking:
            reasons.setdefault(p, []).append(w)
        lines = []
        for p, ws in reasons.items():
            S, R, F = p.sink, p.residual, p.flush
            left = max_tokens - S - R
            if left <= 0:
                why = (f"sink={S} + residual={R} >= {max_tokens:,}, so every token stays in full precision "
                       f"(sinks and residual ring)")
            else:
                why = (f"only {left:,} tokens ever leave the residual ({max_tokens:,} - sink {S} - residual {R}), "
                       f"fewer than one per-channel group of {F} tokens, so no group is ever quantized")
            if max_tokens - S - F >= 0:
                fix = f"residual <= {max_tokens - S - F:,} would quantize the older tokens"
            elif F == 1:
                fix = f"even residual=0 leaves no token after the {S} sinks: use sink < {max_tokens:,}"
            else:
                fix = (f"even residual=0 leaves fewer than one group of {F} tokens after the {S} sinks: use fewer "
                       f"sinks or a smaller per-channel group")
            shown = " and ".join(ws) if len(ws) <= 3 else f"{ws[0]}, {ws[1]} and {len(ws) - 2} more"
            lines.append(f"{shown} ({p.key_str()}): {why}; {fix}")
        return (f"this policy quantizes nothing for sequences of up to {max_tokens:,} tokens: "
                + "; ".join(lines) + ".")

    def key_str(self) -> str:
        """A name that spells out this (base) policy, used for op and kernel specialization."""
        return (f"k={self.key.key()};v={self.value.key()};r={self.residual};s={self.sink};"
                f"rot={int(self.rotate)}" + (";pre=1" if self.pre_rope else ""))

    @property
    def exact(self) -> bool:
        """Whether this (base) policy stores keys and values exactly as the model wrote them: no format, no
        rotation, keys not pre-RoPE (``Policy.full()``). Such a layer keeps the model's own attention arithmetic
        over the paged store (docs/design.md, "Policy.full() is the model's arithmetic"), so its results are the
        unmodified model's bit for bit."""
        return not (self.key.quantized or self.value.quantized or self.rotate or self.pre_rope)

    @property
    def rotates_keys(self) -> bool:
        """Whether keys (and queries) are Hadamard-rotated: ``rotate``, unless keys are stored pre-RoPE (the
        rotary embedding is applied to stored keys per position, so they stay in model space)."""
        return self.rotate and not self.pre_rope

    def __str__(self) -> str:
        return self.key_str() + (f" (+{len(self.overrides)} overrides)" if self.overrides else "")

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        """A JSON-ready dict of this policy and its overrides, in the form ``Policy.save`` writes."""
        d = {POLICY_FILE_FIELD: POLICY_FILE_VERSION, **_leaf_to_dict(self)}
        d["overrides"] = [{"layers": _selector_to_json(sel), "policy": _leaf_to_dict(pol)}
                          for sel, pol in self.overrides]
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "policy") -> "Policy":
        """The policy ``to_dict`` wrote; a ``PolicyError`` naming ``where`` and the field for anything else."""
        at = lambda path: f"{where}, at {path}"  # noqa: E731
        if not isinstance(d, dict):
            raise PolicyError(f"{where}: found {_json_kind(d)}, expected a JSON object written by Policy.save "
                              f"(with {POLICY_FILE_FIELD!r}, 'key', 'value', 'residual', 'sink', 'rotate', "
                              f"'overrides')")
        version = d.get(POLICY_FILE_FIELD)
        if version != POLICY_FILE_VERSION:
            found = "no such field" if POLICY_FILE_FIELD not in d else f"{version!r}"
            todo = ("upgrade kvcompile to read it" if _is_int(version) and version > POLICY_FILE_VERSION else
                    "write the file with Policy.save or `kvcompile calibrate`")
            raise PolicyError(f"{where}: {POLICY_FILE_FIELD!r} (the file format version) is {found}, expected "
                              f"{POLICY_FILE_VERSION}; {todo}")
        body = {k: v for k, v in d.items() if k != POLICY_FILE_FIELD}
        overrides = body.pop("overrides", [])
        base = _leaf_from_dict(body, where, "")
        if not isinstance(overrides, list):
            raise PolicyError(f"{at('overrides')}: found {_json_kind(overrides)}, expected a list of "
                              f'{{"layers": selector, "policy": {{...}}}} objects')
        items = []
        for i, o in enumerate(overrides):
            here = f"overrides[{i}]"
            if not isinstance(o, dict) or set(o) != {"layers", "policy"}:
                raise PolicyError(f"{at(here)}: found {_json_kind(o)}, expected an object with exactly the fields "
                                  f'"layers" (a selector) and "policy"')
            if isinstance(o["policy"], dict) and "overrides" in o["policy"]:
                raise PolicyError(f"{at(here + '.policy')}: an override's policy has no overrides of its own; move "
                                  f"them to the top-level 'overrides' list")
            items.append((_selector_from_json(o["layers"], at(here + ".layers")),
                          _leaf_from_dict(o["policy"], where, here + ".policy")))
        return replace(base, overrides=tuple(items))

    def save(self, path) -> "Path":
        """Write this policy (overrides included) as JSON to ``path``; returns the path, for ``Policy.load``."""
        from pathlib import Path
        p = Path(path).expanduser()
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    @classmethod
    def load(cls, path) -> "Policy":
        """The policy in a JSON file written by ``save`` (or ``kvcompile calibrate``)."""
        where = f"policy file {str(path)!r}"
        return cls.from_dict(read_json_file(path, where, "written by Policy.save or `kvcompile calibrate --out`"),
                             where)


def read_json_file(path, where: str, written: str) -> Any:
    """The JSON in the file at ``path``; a ``PolicyError`` that starts with ``where`` and ends with what the
    file should be (``written``: "written by ...") for a missing file, a directory, non-text or invalid JSON."""
    from pathlib import Path
    p = Path(path).expanduser()
    if not p.is_file():
        raise PolicyError(f"{where}: {'a directory' if p.is_dir() else 'no such file'}; expected a JSON file "
                          f"{written}")
    try:
        return json.loads(p.read_text())
    except UnicodeDecodeError:
        raise PolicyError(f"{where}: not text (not UTF-8); expected a JSON file {written}") from None
    except json.JSONDecodeError as e:
        raise PolicyError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); expected a "
                          f"file {written}") from None


def _check_tokens(what: str, n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        _fail(what, n, "expected a positive number of tokens (an int)")


_OVERRIDES_HOWTO = "build per-layer choices with policy.override({layer: Policy or None})"


def _check_overrides(overrides: Any) -> None:
    """``Policy.overrides`` as ``override`` builds it: a tuple of (normalized selector, leaf Policy) pairs."""
    if not isinstance(overrides, tuple):
        _fail("Policy.overrides", overrides, f"expected a tuple of (selector, Policy) pairs; {_OVERRIDES_HOWTO}")
    for entry in overrides:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            _fail("Policy.overrides entry", entry, f"expected a (selector, Policy) pair; {_OVERRIDES_HOWTO}")
        sel, pol = entry
        if not _is_normalized_selector(sel):
            _fail("Policy.overrides selector", sel, "expected a normalized selector such as ('index', 3), "
                                                    f"('range', 0, 4, 1), ('name', 'model.layers.0') or "
                                                    f"('re', 'layers\\.[0-3]\\.'); {_OVERRIDES_HOWTO}")
        if not isinstance(pol, Policy) or pol.overrides:
            _fail(f"Policy.overrides value for {_show_selector(sel)}", pol,
                  f"expected a kvcompile.Policy without overrides of its own; {_OVERRIDES_HOWTO}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_normalized_selector(sel: Any) -> bool:
    if not isinstance(sel, tuple) or not sel:
        return False
    kind, args = sel[0], sel[1:]
    if kind == "index":
        return len(args) == 1 and _is_int(args[0])
    if kind == "range":
        return len(args) == 3 and all(_is_int(a) for a in args) and args[2] != 0
    if kind in ("name", "re"):
        if len(args) != 1 or not isinstance(args[0], str):
            return False
        if kind == "re":
            try:
                re.compile(args[0])
            except re.error:
                return False
        return True
    return False


def _check_leaf(pol: Any, sel: Any) -> Policy:
    if not isinstance(pol, Policy):
        _fail(f"override value for {sel!r}", pol, "expected a kvcompile.Policy or None")
    if pol.overrides:
        _fail(f"override value for {sel!r}", pol, "expected a policy without overrides of its own")
    return pol


def _normalize_selector(sel: Any):
    if isinstance(sel, bool):
        _fail("override key", sel, "expected a layer index, range, module name or 're:<regex>'")
    if isinstance(sel, int):
        return ("index", sel)
    if isinstance(sel, range):
        return ("range", sel.start, sel.stop, sel.step)
    if isinstance(sel, str):
        if sel.startswith("re:"):
            try:
                re.compile(sel[3:])
            except re.error as e:
                _fail("override key", sel, f"not a valid regular expression ({e})")
            return ("re", sel[3:])
        return ("name", sel)
    _fail("override key", sel, "expected a layer index, range, module name or 're:<regex>'")


def _matches(sel, i: int, name: str, n: int) -> bool:
    kind = sel[0]
    if kind == "index":
        return i == (sel[1] + n if sel[1] < 0 else sel[1])
    if kind == "range":
        return i in range(sel[1], sel[2], sel[3])
    if kind == "re":
        return re.search(sel[1], name) is not None
    return name == sel[1] or name.startswith(sel[1] + ".")


def _show_selector(sel) -> str:
    kind = sel[0]
    if kind == "range":
        return f"range({sel[1]}, {sel[2]}, {sel[3]})"
    if kind == "re":
        return repr("re:" + sel[1])
    return repr(sel[1])


# --------------------------------------------------------------------------- policy files
_QUANT_FIELDS = ("format", "axis", "group", "symmetric", "scale_dtype", "fit")
_LEAF_FIELDS = ("key", "value", "residual", "sink", "rotate", "pre_rope")


def _json_kind(x: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return f"{kinds.get(type(x), type(x).__name__)} {json.dumps(x)[:60] if _jsonable(x) else repr(x)[:60]}"


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


def _quant_to_dict(q: Quant) -> dict:
    return {**{f: getattr(q, f) for f in _QUANT_FIELDS if f != "fit"},
            **({"fit": True} if q.fit else {})}  # (absent: False, as files before it was added)


def _leaf_to_dict(pol: "Policy") -> dict:
    return {"key": _quant_to_dict(pol.key), "value": _quant_to_dict(pol.value),
            "residual": pol.residual, "sink": pol.sink, "rotate": pol.rotate,
            **({"pre_rope": True} if pol.pre_rope else {})}  # (absent: False, as files before it was added)


def _check_fields(d: dict, allowed, where: str) -> None:
    extra = [k for k in d if k not in allowed]
    if extra:
        raise PolicyError(f"{where}: unknown field {extra[0]!r}; expected only {', '.join(map(repr, allowed))}")


def _leaf_from_dict(d: Any, where: str, path: str) -> "Policy":
    def at(sub: str) -> str:
        full = f"{path}.{sub}" if path and sub else path or sub
        return f"{where}, at {full}" if full else where
    if not isinstance(d, dict):
        raise PolicyError(f"{at('')}: found {_json_kind(d)}, expected an object with {', '.join(_LEAF_FIELDS)}")
    _check_fields(d, _LEAF_FIELDS, at(""))
    kw = {k: d[k] for k in ("residual", "sink", "rotate", "pre_rope") if k in d}
    for side in ("key", "value"):
        q = d.get(side, {"format": "none"})
        if not isinstance(q, dict):
            raise PolicyError(f"{at(side)}: found {_json_kind(q)}, expected an object with "
                              f"{', '.join(_QUANT_FIELDS)}")
        _check_fields(q, _QUANT_FIELDS, at(side))
        if "format" not in q:
            raise PolicyError(f"{at(side)}: no 'format' field; expected one of {sorted(FORMAT_BITS)}")
        try:
            kw[side] = Quant(**q)
        except PolicyError as e:
            raise PolicyError(f"{at(side)}: {e}") from None
    try:
        return Policy(**kw)
    except PolicyError as e:
        raise PolicyError(f"{at('')}: {e}") from None


def _selector_to_json(sel) -> dict:
    kind = sel[0]
    return {kind: list(sel[1:]) if kind == "range" else sel[1]}


def _selector_from_json(x: Any, where: str):
    """``{"index": 3}``, ``{"range": [0, 4, 1]}``, ``{"name": "model.layers.0"}`` or ``{"re": "..."}`` (what
    ``save`` writes), or the keys ``override`` takes: an int, ``"re:<regex>"`` or a module name."""
    if isinstance(x, dict) and len(x) == 1:
        kind, arg = next(iter(x.items()))
        sel = (kind, *arg) if kind == "range" and isinstance(arg, list) else (kind, arg)
    elif isinstance(x, (int, str)) and not isinstance(x, bool):
        try:
            sel = _normalize_selector(x)
        except PolicyError as e:
            raise PolicyError(f"{where}: {e}") from None
    else:
        sel = None
    if sel is None or not _is_normalized_selector(sel):
        raise PolicyError(f"{where}: found {_json_kind(x)}, expected a layer selector: {{\"index\": 3}}, "
                          f"{{\"range\": [start, stop, step]}} (step not 0), {{\"name\": \"model.layers.0\"}} or "
                          f"{{\"re\": \"<regex>\"}}")
    return sel
