"""Per-layer bits for a byte budget: measure each layer's sensitivity, then solve a knapsack.

    policy = kvcompile.calibrate(model, budget=3.0)              # the bytes of a uniform 3-bit cache
    policy = kvcompile.calibrate(model, bits_per_element=3.8)    # or average bits per element, all in
    policy = kvcompile.calibrate(model, bytes_per_token=7144)    # or exact bytes per cached token

1. Sensitivity (``measure``). For every layer ``i``, side (keys or values) and candidate ``c``, the model runs
   the held-out protocol (``evaluate.scored_logits``: half of each window prefilled, the rest through the cache
   in chunks of 64) on calibration windows with only that side of layer ``i`` stored as ``c``; every other
   layer stays in full precision. The sensitivity is the mean KL divergence of the next-token distribution
   from full precision's, in nats per token. Why KL and not the loss delta: one layer's loss delta on a few
   thousand tokens is inside its own noise (SmolLM2, layer 5's keys alone at int2, one 1,024-token window:
   -0.00026 nats/token, an *improvement*), while KL is never negative (up to float32 rounding) and measures the
   change itself.
2. Allocation (``allocate``): each layer takes one (key candidate, value candidate) pair; its cost is the exact
   bytes of that layer's store for one sequence of ``context`` tokens (``LayerSpec.nbytes``: codes, scales,
   zero points, residual ring, sinks, block table), its value the sum of the two sensitivities. A
   multiple-choice knapsack (``solve``, dynamic programming over bytes) minimises the summed sensitivity
   within the budget. Sensitivities are taken as additive over layers, the usual assumption of
   mixed-precision allocation (HAWQ); the eval measures what it buys.

Candidates are ``Policy`` objects listed from the least to the most accurate (default: KIVI with the Hadamard
rotation and 4 sinks at 2, 3, 4 and 8 bits, 2, 3 and 4 bits also in groups of 64: ``default_candidates``); a layer
may take its keys from one candidate and its values from another, so all candidates share residual, sinks and
rotation.
A candidate later in the list is never scored worse than an earlier one of the same side (a running minimum):
at 8 bits the KL is near float32 rounding, and that noise must not make the knapsack leave budget unspent on
fewer bits.
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .accounting import bytes_per_token as _bytes_per_token, cache_bytes as _cache_bytes
from .errors import ArgumentError, BudgetError
from .evaluate import scored_logits, text_windows
from .hf import model_shape
from .policy import Policy, PolicyError, Quant, read_json_file
from .store import DTYPE_NAMES, LayerSpec

_NONE = Quant("none")
SENSITIVITY_FILE_FIELD, SENSITIVITY_FILE_VERSION = "kvcompile_sensitivity", 1
TOKENS, WINDOW = 2048, 1024  # calibration tokens by default, in windows of this many (half of each scored)


def default_candidates(head_dim: int | None = None) -> tuple[Policy, ...]:
    """KIVI + Hadamard rotation + 4 sinks (keys per channel, values per token, a 128-token residual), the best
    scheme at every width on SmolLM2 (docs/results.md), from the least to the most accurate: int2, int3 and
    int4 each in groups of 64, then 32; int8 in groups of 32. The groups of 64 halve the scales' bytes: at the
    bytes of uniform 3-bit they took SmolLM2's loss delta from +0.0036 (groups of 32 only) to +0.0009, and
    int2 in groups of 64 is what leaves a choice at the bytes of uniform 2-bit (+0.058 uniform, +0.010
    calibrated; docs/results.md). ``head_dim``: only the candidates that fit it (a value group of 64 channels
    needs a head of a multiple of 64), the groups of 32 fitted to it (``Quant.fit``: a head of 80 takes values in
    groups of 16, as ``Policy.kivi``'s default does)."""
    def kivi(bits, group=32):
        return Policy.kivi(bits, group=group, sink=4, rotate=True)
    cands = kivi(2, 64), kivi(2), kivi(3, 64), kivi(3), kivi(4, 64), kivi(4), kivi(8)
    if head_dim is None:
        return cands
    fitted = (replace(c, value=replace(c.value, fit=True)).for_head_dim(head_dim) if c.value.group == 32 else c
              for c in cands)
    return tuple(c for c in fitted if _fits(c, head_dim))


def _fits(policy: Policy, head_dim: int) -> bool:
    try:
        policy.check(head_dim)
        return True
    except PolicyError:
        return False


# --------------------------------------------------------------------------- calibration text
# Module and API docstrings of pure-Python standard-library modules: shipped with Python like the held-out
# text (pydoc_data.topics, the language reference and library manual) but other prose (tests check that the
# two share no 12-word run). The text follows the installed Python's version.
CALIBRATION_MODULES = (
    "argparse", "bisect", "calendar", "collections", "configparser", "contextlib", "csv", "dataclasses", "difflib",
    "email.message", "enum", "fractions", "ftplib", "functools", "heapq", "http.client", "imaplib", "inspect",
    "ipaddress", "json", "logging", "mailbox", "pathlib", "pickle", "pprint", "queue", "random", "shlex", "shutil",
    "smtplib", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing",
    "unittest.case", "urllib.parse", "uuid", "zipfile")


def calibration_text() -> str:
    """The default calibration text: docstrings of ``CALIBRATION_MODULES`` and their public classes and
    functions, in a fixed order (226,000 characters, about 60,000 SmolLM2 tokens, on Python 3.11)."""
    parts = []
    with warnings.catch_warnings():  # typing.io / typing.re warn when their docstrings are read (3.11)
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CALIBRATION_MODULES:
            _docstrings(importlib.import_module(name), parts)
    return "\n\n".join(parts)


def _docstrings(mod, parts: list) -> None:
    """Append ``mod``'s docstring and those of the public classes and functions it defines."""
    if inspect.getdoc(mod):
        parts.append(inspect.getdoc(mod))
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and inspect.getdoc(obj):
            parts.append(f"{attr}: {inspect.getdoc(obj)}")


def calibration_windows(tok, tokens: int = TOKENS, window: int = WINDOW, text: str | None = None) -> torch.Tensor:
    """``ceil(tokens / window)`` windows of ``window`` tokens, evenly spaced over ``text`` (default:
    ``calibration_text()``): int64 ``[W, window]``."""
    for what, v in (("tokens", tokens), ("window", window)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise PolicyError(f"calibration {what}={v!r}: expected a whole number of tokens >= 2")
    text = calibration_text() if text is None else text
    return text_windows(tok, text, window, -(-tokens // window), "the calibration text")


# --------------------------------------------------------------------------- 1. sensitivity
@dataclass(frozen=True)
class Sensitivity:
    """Measured sensitivities: ``keys[i][c]`` (``values[i][c]``) is the mean KL divergence (nats per scored
    token) from full precision when only layer ``i``'s keys (values) are stored as ``candidates[c]``'s.
    ``raw_*``: as measured; ``keys``/``values``: made non-increasing along the candidates (module docstring)."""

    candidates: tuple[Policy, ...]
    raw_keys: tuple[tuple[float, ...], ...]
    raw_values: tuple[tuple[float, ...], ...]
    tokens: int  # scored tokens

    @property
    def keys(self):
        return tuple(_running_min(r) for r in self.raw_keys)

    @property
    def values(self):
        return tuple(_running_min(r) for r in self.raw_values)

    # measured once (an hour on SmolLM2), allocated at any budget: the measurement as a file
    def save(self, path) -> Path:
        """Write the candidates and raw sensitivities as JSON (``Sensitivity.load`` reads it back exactly:
        Python's float repr round-trips)."""
        p = Path(path).expanduser()
        p.write_text(json.dumps({SENSITIVITY_FILE_FIELD: SENSITIVITY_FILE_VERSION, "tokens": self.tokens,
                                 "candidates": [c.to_dict() for c in self.candidates],
                                 "raw_keys": self.raw_keys, "raw_values": self.raw_values}, indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path) -> "Sensitivity":
        """The measurement ``save`` wrote; a ``PolicyError`` saying what is wrong with anything else."""
        where = f"sensitivity file {str(path)!r}"
        written = "written by Sensitivity.save or `kvcompile calibrate --save-sensitivity`"
        d = read_json_file(path, where, written)
        if not isinstance(d, dict) or d.get(SENSITIVITY_FILE_FIELD) != SENSITIVITY_FILE_VERSION:
            raise PolicyError(f"{where}: no {SENSITIVITY_FILE_FIELD!r}: {SENSITIVITY_FILE_VERSION} field; expected a "
                              f"file {written} (a policy file goes to --policy or Policy.load instead)")
        cands = d.get("candidates")
        if not isinstance(cands, list) or not cands:
            raise PolicyError(f"{where}: 'candidates' must be a non-empty list of policies")
        cands = check_candidates([Policy.from_dict(c, f"{where}, candidates[{i}]") for i, c in enumerate(cands)])
        rows = {}
        for side in ("raw_keys", "raw_values"):
            r = d.get(side)
            ok = isinstance(r, list) and r and all(
                isinstance(row, list) and len(row) == len(cands) and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in row)
                for row in r)
            if not ok:
                raise PolicyError(f"{where}: {side!r} must be a list (one row per layer) of {len(cands)} finite "
                                  f"numbers a row, one per candidate")
            rows[side] = tuple(tuple(float(x) for x in row) for row in r)
        if len(rows["raw_keys"]) != len(rows["raw_values"]):
            raise PolicyError(f"{where}: {len(rows['raw_keys'])} layers of key sensitivities but "
                              f"{len(rows['raw_values'])} of value sensitivities")
        tokens = d.get("tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise PolicyError(f"{where}: 'tokens' (scored tokens) must be a positive whole number, found {tokens!r}")
        return cls(cands, rows["raw_keys"], rows["raw_values"], tokens)


def _running_min(row):
    out, m = [], math.inf
    for x in row:
        m = min(m, x)
        out.append(m)
    return tuple(out)


def check_candidates(candidates) -> tuple[Policy, ...]:
    """The candidates as a tuple; a ``PolicyError`` for anything ``allocate`` cannot pair."""
    cands = tuple(candidates)
    if not cands or not all(isinstance(c, Policy) for c in cands):
        raise PolicyError(f"candidates={candidates!r}: expected a non-empty list of kvcompile.Policy objects, from "
                          f"the least to the most accurate, e.g. [Policy.kivi(b, sink=4, rotate=True) for b in "
                          f"(2, 3, 4, 8)]")
    for c in cands:
        if c.overrides:
            raise PolicyError(f"candidate {c} has per-layer overrides: a candidate is one layer's policy")
        if c.pre_rope:
            raise PolicyError(f"candidate {c} stores keys pre-RoPE: calibrate measures layers through the eager "
                              f"cache, which receives rotated keys; use candidates without pre_rope")
        shared = [(f, getattr(c, f), getattr(cands[0], f)) for f in ("residual", "sink", "rotate")
                  if getattr(c, f) != getattr(cands[0], f)]
        if shared:
            f, a, b = shared[0]
            raise PolicyError(f"candidates differ in {f} ({b!r} in {cands[0]}, {a!r} in {c}): a layer pairs one "
                              f"candidate's keys with another's values, so all share residual, sink and rotate")
    return cands


def _leaf(cands, k: Quant, v: Quant) -> Policy:
    c = cands[0]
    return Policy(k, v, residual=c.residual, sink=c.sink, rotate=c.rotate)


@torch.no_grad()
def measure(model, windows: torch.Tensor, candidates=None, chunk: int = 64, batch: int = 4,
            progress: bool = True) -> Sensitivity:
    """Every layer's sensitivity to every candidate, keys and values separately (module docstring).

    windows: int64 ``[W, N]`` token ids; the second half of each is scored. Costs ``1 + 2 * layers *
    len(candidates)`` passes of the protocol over the windows.
    """
    layers, _, head_dim = model_shape(model.config)
    cands = check_candidates(default_candidates(head_dim) if candidates is None else candidates)
    for c in cands:
        c.check(head_dim)
    ref = [torch.log_softmax(p, -1) for _, _, p in scored_logits(model, windows, Policy.full(), chunk, batch)]
    scored = sum(r.shape[0] * r.shape[1] for r in ref)
    bar = tqdm(total=2 * layers * len(cands), desc="calibrate: layer sensitivity", disable=not progress)
    out = {"key": [], "value": []}
    for i in range(layers):
        for side in ("key", "value"):
            row = []
            for c in cands:
                leaf = _leaf(cands, c.key, _NONE) if side == "key" else _leaf(cands, _NONE, c.value)
                pol = Policy.full().override({i: leaf})
                kl = 0.0
                for r, (_, _, p) in zip(ref, scored_logits(model, windows, pol, chunk, batch)):
                    # KL(full || quantized) summed over the scored tokens
                    kl += float((r.exp() * (r - torch.log_softmax(p, -1))).sum(dtype=torch.float64))
                row.append(kl / scored)
                bar.update(1)
            out[side].append(tuple(row))
    bar.close()
    return Sensitivity(cands, tuple(out["key"]), tuple(out["value"]), scored)


# --------------------------------------------------------------------------- 2. the knapsack
def solve(costs: Sequence[Sequence[int]], values: Sequence[Sequence[float]], budget: int,
          max_states: int = 1 << 18) -> list[int]:
    """Multiple-choice knapsack: one choice ``j[i]`` per group ``i``, minimising ``sum(values[i][j[i]])`` with
    ``sum(costs[i][j[i]]) <= budget``. Costs are non-negative ints.

    Dynamic programming over the cost above each group's cheapest choice, in units of the costs' greatest
    common divisor: exact when ``budget`` spans at most ``max_states`` units. Otherwise costs are rounded
    *up* to a coarser unit, so the choice still fits the budget, and may miss the optimum by what the
    rounding hides. Among choices of equal value the later one in a group is taken (list each group's choices
    from the cheapest: ties go to the more accurate). Raises ``BudgetError`` if nothing fits.
    """
    if len(costs) != len(values) or any(len(c) != len(v) or not c for c, v in zip(costs, values)):
        raise ArgumentError("solve: costs and values need the same non-empty choices per group")
    low = [min(c) for c in costs]
    room = budget - sum(low)
    if room < 0:
        raise BudgetError(f"the budget {budget} is below the cheapest choice, {sum(low)}", sum(low))
    extra = [[int(c) - m for c in cs] for cs, m in zip(costs, low)]
    unit = math.gcd(*[e for es in extra for e in es]) or 1
    if room // unit > max_states:
        unit = -(-room // max_states)
    cap = room // unit
    weights = [[-(-e // unit) for e in es] for es in extra]
    best = np.zeros(cap + 1)  # best[w]: the least value of the groups so far within w units
    picks = np.zeros((len(costs), cap + 1), dtype=np.int32)
    for i, (ws, vs) in enumerate(zip(weights, values)):
        new = np.full(cap + 1, np.inf)
        for j, (w, v) in enumerate(zip(ws, vs)):
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[:cap + 1 - w] + v
            take = cand <= new
            new[take] = cand[take]
            picks[i, take] = j
        best = new
    choice, w = [], cap
    for i in range(len(costs) - 1, -1, -1):
        j = int(picks[i, w])
        choice.append(j)
        w -= weights[i][j]
    return choice[::-1]


@dataclass(frozen=True)
class Allocation:
    """The chosen per-layer pairs and what they cost: ``choice[i] = (key candidate, value candidate)``."""

    policy: Policy
    choice: tuple[tuple[int, int], ...]
    bytes_per_token: float  # exact, as kvcompile.bytes_per_token counts it at ``context``
    budget_bytes_per_token: float
    context: int
    predicted_kl: float  # summed sensitivity of the choice


# The three ways to give a budget; each is turned into exact bytes per token by ``budget_bytes``.
BUDGETS = {"budget": "bits of a uniform cache", "bits_per_element": "average bits per element, all in",
           "bytes_per_token": "exact bytes per cached token"}


def budget_bytes(shape, candidates, context: int, dtype=torch.bfloat16, budget=None, bits_per_element=None,
                 bytes_per_token=None) -> Fraction:
    """The budget in exact bytes per token, from exactly one of:

    budget: the bytes of a uniform cache of that many bits in the candidates' layout -- what "a 3-bit cache"
        means: 3-bit codes with the scales, zero points, full-precision residual and sinks such a cache holds at
        ``context`` tokens. It is the bytes of the uniform candidate of that width (keys and values of as many
        bits; of several, the last listed: for the defaults, ``budget=3`` is the bytes of ``Policy.kivi(3,
        sink=4, rotate=True)``, groups of 32); between two widths, in proportion (2.5: halfway between the 2- and
        3-bit caches' bytes); beyond the narrowest or the widest, their bytes with the codes' bits less or more.
    bits_per_element: average bits per cached element (keys and values of every layer), everything the store
        holds counted (scales, zero points, residual, sinks): times the elements per token, over 8.
    bytes_per_token: as it is.
    """
    given = {k: v for k, v in (("budget", budget), ("bits_per_element", bits_per_element),
                               ("bytes_per_token", bytes_per_token)) if v is not None}
    if len(given) != 1:
        raise PolicyError(f"give exactly one budget, not {' and '.join(given) or 'none'}: budget= (bits of a uniform "
                          f"cache, e.g. 3 for the bytes of a 3-bit cache), bits_per_element= (average bits per "
                          f"element, scales, residual and sinks counted) or bytes_per_token= (exact bytes per cached "
                          f"token)")
    (name, v), = given.items()
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise PolicyError(f"{name}={v!r} ({BUDGETS[name]}): expected a positive finite number")
    layers, kv_heads, head_dim = shape
    per_bit = Fraction(2 * layers * kv_heads * head_dim, 8)  # bytes per token of one bit per element
    if name == "bytes_per_token":
        return Fraction(v)
    if name == "bits_per_element":
        return Fraction(v) * per_bit
    widths = uniform_bytes(shape, candidates, context, dtype)
    if not widths:
        raise PolicyError(f"budget={v!r} counts bits of a uniform cache, but no candidate stores keys and values in "
                          f"the same number of bits; give bits_per_element= or bytes_per_token= instead")
    b, ws = Fraction(v), sorted(widths)
    lo = max([w for w in ws if w <= b], default=ws[0])
    hi = min([w for w in ws if w >= b], default=ws[-1])
    if lo == hi or not lo <= b <= hi:  # a width itself, or beyond the narrowest or the widest
        return widths[lo] + (b - lo) * per_bit
    return widths[lo] + (b - lo) / (hi - lo) * (widths[hi] - widths[lo])


def uniform_bytes(shape, candidates, context: int, dtype=torch.bfloat16) -> dict[int, Fraction]:
    """Bits -> exact bytes per token of the uniform candidate of that width (keys and values in as many bits; of
    several, the last listed), every layer at it, one sequence of ``context`` tokens."""
    layers, kv_heads, head_dim = shape
    dt = DTYPE_NAMES[dtype] if isinstance(dtype, torch.dtype) else dtype
    cands = check_candidates(default_candidates(head_dim) if candidates is None else candidates)
    return {c.key.bits: Fraction(LayerSpec(c, kv_heads, head_dim, dt).nbytes(1, context) * layers, context)
            for c in cands if c.key.quantized and c.key.bits == c.value.bits}


def _sequence_budget(cap: Fraction, context: int) -> int:
    """Whole bytes one ``context``-token sequence may hold. A budget within 1e-9 of a whole number of bytes is
    that number: a float such as ``kvcompile.bytes_per_token(policy, ...)``, ``cache_bytes / context`` rounded to
    the nearest double, may fall just below the bytes it stands for, and must afford that policy."""
    x = cap * context
    near = round(x)
    return near if abs(x - near) <= 1e-9 * max(1, near) else math.floor(x)


def bits_per_element_of(bpt: float, shape) -> float:
    """Bytes per token as average bits per cached element (keys and values, all layers)."""
    layers, kv_heads, head_dim = shape
    return bpt * 8 / (2 * layers * kv_heads * head_dim)


def _pairs(cands, shape, context: int, dtype):
    """Every (key candidate, value candidate) pair of one layer, cheapest first (ties: the more accurate
    last), with its leaf policy and the exact bytes of that layer's store for one ``context``-token sequence."""
    _, kv_heads, head_dim = shape
    dt = DTYPE_NAMES[dtype] if isinstance(dtype, torch.dtype) else dtype
    n = len(cands)
    pairs = sorted((a, b) for a in range(n) for b in range(n))
    leaves = {ab: _leaf(cands, cands[ab[0]].key, cands[ab[1]].value) for ab in pairs}
    cost = {ab: LayerSpec(leaves[ab], kv_heads, head_dim, dt).nbytes(1, context) for ab in pairs}
    pairs.sort(key=lambda ab: cost[ab])  # stable: (a, b) order among equal costs
    return pairs, leaves, cost


def check_budget(shape, candidates=None, budget=None, bytes_per_token=None, context: int = 2048,
                 dtype=torch.bfloat16, bits_per_element=None) -> Fraction:
    """The budget in bytes per token (``budget_bytes``), or a ``BudgetError`` saying the minimum if no choice of the
    candidates fits it (a check that needs no measurement: run it first)."""
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise PolicyError(f"context={context!r}: expected a positive number of tokens per sequence")
    cap = budget_bytes(shape, candidates, context, dtype, budget, bits_per_element, bytes_per_token)
    cands = check_candidates(default_candidates(shape[2]) if candidates is None else candidates)
    pairs, leaves, cost = _pairs(cands, shape, context, dtype)
    low = Fraction(cost[pairs[0]] * shape[0], context)
    if _sequence_budget(cap, context) < cost[pairs[0]] * shape[0]:
        what = (f"{budget:g} bits (the bytes of a uniform {budget:g}-bit cache of these candidates: "
                f"{float(cap):,.1f} bytes per token)" if budget is not None else
                f"{bits_per_element:g} bits per element ({float(cap):,.1f} bytes per token)"
                if bits_per_element is not None else f"{float(cap):,.1f} bytes per token")
        raise BudgetError(
            f"a budget of {what} at {context:,} tokens is below the cheapest choice of these candidates, every "
            f"layer at {leaves[pairs[0]]}: {float(low):,.1f} bytes per token, "
            f"{bits_per_element_of(float(low), shape):.3f} bits per element (scales, zero points, residual and "
            f"sinks counted); give at least that, cheaper candidates, or a longer context", low)
    return cap


def allocate(sens: Sensitivity, shape, budget=None, bytes_per_token=None, context: int = 2048,
             dtype=torch.bfloat16, bits_per_element=None) -> Allocation:
    """The per-layer policy that minimises the summed sensitivity within the budget (module docstring).

    shape: ``(layers, kv_heads, head_dim)``; the budget: ``budget`` (bits of a uniform cache of the candidates),
    ``bits_per_element`` (all in) or ``bytes_per_token`` (``budget_bytes``), counted exactly at ``context``
    tokens per sequence in ``dtype`` (the full-precision parts' dtype).
    """
    layers, kv_heads, head_dim = shape
    if len(sens.keys) != layers:
        raise PolicyError(f"the sensitivities were measured on {len(sens.keys)} layers, the model has {layers}")
    cap = check_budget(shape, sens.candidates, budget, bytes_per_token, context, dtype, bits_per_element)
    pairs, leaves, cost = _pairs(sens.candidates, shape, context, dtype)
    values = [[sens.keys[i][a] + sens.values[i][b] for a, b in pairs] for i in range(layers)]
    budget_seq = _sequence_budget(cap, context)
    picked = solve([[cost[ab] for ab in pairs]] * layers, values, budget_seq)
    choice = tuple(pairs[j] for j in picked)
    policy = _as_policy([leaves[ab] for ab in choice])
    bpt = _bytes_per_token(policy, layers, kv_heads, head_dim, context, dtype=dtype)
    held = _cache_bytes(policy, layers, kv_heads, head_dim, context, dtype=dtype)
    if held > budget_seq:  # the knapsack's costs and the accounting are one formula (LayerSpec)
        raise AssertionError(f"allocation of {held} bytes per sequence over the budget {budget_seq}")
    kl = sum(values[i][j] for i, j in enumerate(picked))
    return Allocation(policy, choice, bpt, float(cap), context, kl)


def _as_policy(leaves: list[Policy]) -> Policy:
    """The most common layer policy as the base; runs of other layers as ``range`` (or index) overrides."""
    base = Counter(leaves).most_common(1)[0][0]
    over, i = {}, 0
    while i < len(leaves):
        j = i
        while j + 1 < len(leaves) and leaves[j + 1] == leaves[i]:
            j += 1
        if leaves[i] != base:
            over[i if i == j else range(i, j + 1)] = leaves[i]
        i = j + 1
    return base.override(over) if over else base


# --------------------------------------------------------------------------- the user's verb
def calibrate(model, data=None, budget: float | None = None, *, bits_per_element: float | None = None,
              bytes_per_token: float | None = None, candidates=None, context: int = 2048, tokens: int = TOKENS,
              window: int = WINDOW, tokenizer=None, chunk: int = 64, dtype=torch.bfloat16,
              progress: bool = True) -> Policy:
    """A per-layer ``Policy`` that minimises the loss within a byte budget (module docstring).

    budget: bits of a uniform cache: ``budget=3`` gives the policy that loses least in the bytes a uniform 3-bit
        cache of the candidates holds (for the defaults ``Policy.kivi(3, sink=4, rotate=True)``: codes, scales,
        residual and sinks) at ``context`` tokens per sequence (``budget_bytes``). Or ``bits_per_element``
        (average bits per cached element, everything the store holds counted) or ``bytes_per_token``.
    data: the calibration set: token ids (int64, ``[W, N]`` windows or a 1-D run cut into ``window``-token
        windows), a string (tokenized with ``tokenizer``), or None for ``calibration_text()`` (standard
        library docstrings, disjoint from ``kvcompile eval``'s held-out text); ``tokens`` tokens of it are used.
    candidates: per-layer policies from the least to the most accurate (default ``default_candidates()``).
    """
    shape = model_shape(model.config)
    cap = check_budget(shape, candidates, budget, bytes_per_token, context, dtype, bits_per_element)  # before measuring
    windows = _windows(model, data, tokens, window, tokenizer)
    sens = measure(model, windows, candidates, chunk, progress=progress)
    return allocate(sens, shape, bytes_per_token=cap, context=context, dtype=dtype).policy


def _windows(model, data, tokens: int, window: int, tokenizer) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.long or data.dim() not in (1, 2) or data.shape[-1] < 2:
            raise PolicyError(f"data: a tensor of {data.dtype} {list(data.shape)}; expected int64 token ids, "
                              f"[W, N] windows or one [N] run")
        if data.dim() == 2:
            return data
        n = min(window, len(data))
        return data[:len(data) // n * n].view(-1, n)
    if data is not None and not isinstance(data, str):
        raise PolicyError(f"data={type(data).__name__}: expected token ids (a torch.long tensor), a string, or "
                          f"None for the standard-library calibration text")
    if tokenizer is None:
        from transformers import AutoTokenizer
        path = getattr(model.config, "_name_or_path", "")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError):
            raise PolicyError(f"calibrate needs the model's tokenizer for text data, and none loads from "
                              f"{path!r}: pass tokenizer=, or data as token ids") from None
    return calibration_windows(tokenizer, tokens, window, data)


def format_allocation(alloc: Allocation, sens: Sensitivity, shape) -> str:
    """The chosen formats per layer with their sensitivities, then the choice's exact bytes per token beside
    every uniform candidate's, each with its summed sensitivity (the knapsack's objective)."""
    layers, kv_heads, head_dim = shape
    cands = sens.candidates
    lines = [f"{'layer':>5}  {'keys':<18}{'values':<18}{'KL keys':>10}{'KL values':>11}", "-" * 62]
    for i, (a, b) in enumerate(alloc.choice):
        lines.append(f"{i:>5}  {_short(cands[a].key):<18}{_short(cands[b].value):<18}{sens.keys[i][a]:>10.2e}"
                     f"{sens.values[i][b]:>11.2e}")
    rows = [("calibrated (this policy)", alloc.bytes_per_token, alloc.predicted_kl)]
    for c, p in enumerate(cands):
        rows.append((f"uniform: keys {_short(p.key)}, values {_short(p.value)}",
                     _bytes_per_token(p, layers, kv_heads, head_dim, alloc.context),
                     sum(sens.keys[i][c] + sens.values[i][c] for i in range(layers))))
    w = max(len(r[0]) for r in rows) + 2
    c0 = cands[0]
    lines += ["", f"exact bytes per token at {alloc.context:,} tokens (budget {alloc.budget_bytes_per_token:,.1f}; "
                  f"residual {c0.residual} and {c0.sink} sinks in bf16, rotate={c0.rotate}), bits per element all in, "
                  f"and the summed sensitivity (KL, nats/token)",
              f"{'policy':<{w}}{'bytes/token':>13}{'bits/elem':>11}{'sum KL':>11}", "-" * (w + 35)]
    for name, bpt, kl in rows:
        lines.append(f"{name:<{w}}{bpt:>13,.1f}{bits_per_element_of(bpt, shape):>11.3f}{kl:>11.2e}")
    return "\n".join(lines)


def _short(q: Quant) -> str:
    """``int4/channel/32``: the format, its scales' axis and group (the rest is in the policy file)."""
    if q.quantized and q.axis == "tensor":
        return f"{q.format}/tensor"  # one fixed scale, no group
    return f"{q.format}/{q.axis}/{q.group or 'head'}" if q.quantized else "none"
