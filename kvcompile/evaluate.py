"""What a policy costs in quality: held-out loss and long-context passkey retrieval, on a real model.

Held-out loss: windows of ``N`` tokens from ``pydoc_data.topics`` (ships with Python, so nothing is
downloaded). The first half of each window is prefilled through the cache, the second half is fed through
it in chunks of 64 tokens, and the loss is the mean cross-entropy over the second half. Every token the
model attends to has gone through the policy's store, so the number includes what a real decode sees.
Each call reads its own tokens' keys and values in full precision, as kvcompile's engines do (``own="full"``),
or as stored like every earlier position (``own="stored"``: what an engine that reads every position from its
pages computes, kvcompile inside vLLM; the split into calls then changes nothing but the order of sums -- a
policy with a window or per-channel groups is fed one token a call, ``one_at_a_time``, so that each token reads
the store as it stood when it was the newest, as the vLLM plugin's window cache gives; and a sliding-window layer
the plugin packs is a store too, ``_EvalCache``).

Passkey retrieval: a random 5-digit key hidden at a random depth in filler; the model must continue "The
pass key is" with it. The prompt is ``L - PASSKEY_NEW_TOKENS`` tokens, so prompt and answer fit in ``L``
positions (at ``L`` = 8,192, SmolLM2's trained context, an answer past it would test position extrapolation,
not the cache). A trial counts as retrieved when the key's digits appear in the text of up to
``PASSKEY_NEW_TOKENS`` greedily generated tokens (a model may answer " the 48213" or "48213.").

Numerics come from ``KVCompileCache`` in eager mode (the reference store). Its ``update`` dequantizes the
whole cache at every call; here ``_EvalCache`` keeps that view and refreshes only the positions an append
changed (sinks written, tokens flushed to packed storage, the residual ring). Packed tokens never change
once written, so the view is identical to ``dequantize_reference`` -- tests assert it bit for bit --
at a fraction of the cost per 64-token chunk (the full dequantize re-unpacks all ``max_cache_len``
codes of every layer every chunk: 60 % of a 2K window's time). Attention reads only the positions held
rather than the whole capacity, which changes nothing but the order of floating-point sums.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .accounting import bytes_per_token, full_precision_bytes_per_token
from . import ops
from .hf import KVCompileCache, KVCompileLayer, model_shape
from .api import apply
from .hf_model import cache_kwarg
from .pages import needs_window, packs_sliding_window
from .policy import Policy, PolicyError
from .presets import SCHEMES, is_policy_file, naive, parse_entry, scheme_policy  # noqa: F401  (this module's names too)
from .store import dequantize_reference
from .errors import ArgumentError

# --------------------------------------------------------------------------- the policies compared
# The schemes (and their spellings) are kvcompile.presets'; the evaluation's defaults are these.
DEFAULT_SCHEMES = ("naive", "kivi", "kivi+rot", "kivi+sink", "kivi-g16", "kivi+rot+sink", "kivi+sink+l0", "kivi-k3v2",
                   "fp8", "fp8-r0", "int8")
DEFAULT_BITS = (2, 3, 4, 8)


# --------------------------------------------------------------------------- an incrementally updated view
class _EvalLayer(KVCompileLayer):
    """A ``KVCompileLayer`` whose dequantized view is kept and refreshed where an append changed it. ``own``: how
    a chunk reads its own keys and values (``OWN``)."""

    own = "full"

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            B, H, D, C = self.store.batch, self.spec.heads, self.spec.head_dim, self.limit
            self._k = torch.zeros(B, H, C, D, dtype=key_states.dtype, device=self.device)
            self._v = torch.zeros_like(self._k)
            self._chunk = 0
        L = self.store.lengths[0]
        n = key_states.shape[-2]
        pos = torch.arange(n) + L
        self.cumulative_length.add_(n)
        ops._store(self.keys, self.values, key_states, value_states, pos, self.spec_name)
        # tokens in [boundary(L), L) may have moved ring -> packed; [_chunk, L) holds the last chunk's own
        # full-precision values, written below (so the new chunk's positions need no dequantizing now)
        a = min(L, self.spec.boundary(L), self._chunk)
        unquantized = self.own == "full"
        end = L if unquantized else L + n  # "stored": the chunk's own positions are read as stored, like the others
        if a < end:
            k, v = dequantize_reference(self.store.state, self.spec, key_states.dtype, start=a, end=end)
            self._k[:, :, a:end] = k
            self._v[:, :, a:end] = v
        if unquantized:  # the chunk attends to itself in full precision (as KVCompileLayer.update, the compiled path)
            self._k[:, :, L:L + n] = key_states
            self._v[:, :, L:L + n] = value_states
        self._chunk = L if unquantized else L + n
        # Only the positions held: attention over the whole capacity would spend most of its FLOPs on
        # masked slots (at 8K capacity, chunked prefill cost 4x the attention it needs).
        return self._k[:, :, :L + n], self._v[:, :, :L + n]

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        held = self.store.lengths[0] if self.is_initialized else 0
        return held + query_length, 0  # the mask matches the views returned above

    def reset(self) -> None:
        super().reset()
        if self.is_initialized:
            self._k.zero_()
            self._v.zero_()
            self._chunk = 0


class _EvalCache(KVCompileCache):
    """The evaluation's cache. Under ``own="stored"`` (what kvcompile inside vLLM computes) a sliding-window layer
    that vLLM's plugin packs (``pages.packs_sliding_window``) is a store too, where kvcompile's own engines keep
    transformers' full-precision ring: it keeps every position, and transformers' sliding-window mask (over the
    positions the store returns, from 0) hides those before each query's window, as vLLM's pages are read."""

    def __init__(self, config, policy: Policy, max_cache_len: int, own: str = "full"):
        super().__init__(config, policy, max_cache_len)
        rings = self.rings if own == "stored" else {}
        self.layers = [_EvalLayer(p, layer.name, max_cache_len) if isinstance(layer, KVCompileLayer) else
                       _EvalLayer(p, name, max_cache_len) if i in rings and packs_sliding_window(p, rings[i]) else
                       layer for i, (p, name, layer) in enumerate(zip(self.policies, self.layer_names, self.layers))]
        for layer in self.layers:
            if isinstance(layer, _EvalLayer):
                layer.own = own


# How a chunk fed through the cache reads its own keys and values:
OWN = {
    "full": "in full precision, as the model computed them (kvcompile's own engines: generate, its serving)",
    "stored": "as stored, like every earlier position (an engine that reads every position from its pages: "
              "kvcompile inside vLLM)",
}


def one_at_a_time(policy: Policy) -> bool:
    """Whether some layer of ``policy`` keeps tokens in full precision beside its packed ones (a window, per-channel
    groups waiting to fill, sinks): then which positions a token reads in full precision depends on how the tokens
    were split into calls, unless each call holds one token, which ``own="stored"`` does (an engine that reads
    every position as stored computes this split-free attention: kvcompile inside vLLM)."""
    return any(needs_window(p) or p.sink for p in policy.choices())


def check_own(own, policy: Policy | None = None, fast: bool = True) -> None:
    """``own`` is one of ``OWN``, and ``policy`` (when given) can be measured so through the cache ``fast``
    picks: "stored" only through the fast eager cache, which cannot store pre-RoPE keys."""
    if own not in OWN:
        raise ArgumentError(f"own={own!r}: expected one of {', '.join(map(repr, OWN))} (how a chunk reads its own "
                            f"keys and values: " + "; ".join(f"{k}: {v}" for k, v in OWN.items()) + ")")
    if own == "full" or policy is None:
        return
    if stores_pre_rope(policy):
        raise ArgumentError(
            f"own={own!r} is measured through the evaluation's fast eager cache only, which cannot store keys "
            f"before the rotary embedding (pre_rope=True in {policy}); an engine that reads every position from "
            f"its pages receives keys after the rotary embedding, and refuses pre_rope policies too")
    if not fast:
        raise ArgumentError(f"own={own!r} is measured through the evaluation's fast eager cache only: pass fast=True")


def make_cache(model, policy: Policy, max_cache_len: int, fast: bool = True, own: str = "full") -> KVCompileCache:
    """The cache the evaluation feeds: ``_EvalCache`` (same numerics, faster) or the plain reference one.
    A pre_rope policy only goes through the plain one, inside the applied model (``compiled_copy``): the fast
    cache's eager updates receive rotated keys, so it refuses rather than store them post-RoPE. ``own``: how a
    chunk reads its own keys and values (``OWN``); "stored" is the fast cache's only."""
    check_own(own, policy, fast)
    if fast and stores_pre_rope(policy):
        raise PolicyError(
            f"the evaluation's fast eager cache cannot store keys before the rotary embedding (pre_rope=True in "
            f"{policy}): only the compiled model can. Measure it through evaluate.compiled_copy(model, policy) "
            f"with fast=False, as `kvcompile eval` does.")
    if fast:
        return _EvalCache(model.config, policy, max_cache_len, own)
    return KVCompileCache(model.config, policy, max_cache_len)


def stores_pre_rope(policy: Policy) -> bool:
    """Whether ``policy`` (or one of its per-layer overrides) stores keys before the rotary embedding."""
    return policy.pre_rope or any(p.pre_rope for _, p in policy.overrides)


def compiled_copy(model, policy: Policy):
    """A copy of ``model`` under ``kvcompile.apply(policy, compiler="eager")``: the FX pass and kvcompile's
    kernels. Pre-RoPE keys exist only there (the pass finds the rotary embedding on the key write; the eager
    cache receives rotated keys and refuses a pre_rope policy), so the held-out loss of such a policy is
    measured through it, with a plain ``KVCompileCache`` per window batch (the same protocol, chunks and
    windows). On SmolLM2 this path gives kivi+rot+sink:2 2.43819 against the eager path's 2.4383."""
    import copy

    return apply(copy.deepcopy(model), policy, compiler="eager")


def _forward(model, ids, cache, keep: int = 0):
    """Logits of ``ids`` fed through ``cache``; ``keep > 0``: only the last ``keep`` positions' (the vocabulary
    projection is a fifth of SmolLM2's FLOPs, so a prefill that needs one position skips it)."""
    return model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{cache_kwarg(model): cache}).logits


# --------------------------------------------------------------------------- held-out loss
def heldout_text() -> str:
    import pydoc_data.topics as topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def heldout_windows(tok, n: int = 2048, count: int = 4) -> torch.Tensor:
    """``count`` windows of ``n`` tokens, evenly spaced over the held-out text: int64 ``[count, n]``."""
    return text_windows(tok, heldout_text(), n, count, "the held-out text")


def text_windows(tok, text: str, n: int, count: int, what: str = "the text") -> torch.Tensor:
    """``count`` windows of ``n`` tokens, evenly spaced over ``text``: int64 ``[count, n]``."""
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if len(ids) < n:
        raise ArgumentError(f"{what} has {len(ids)} tokens, fewer than one window of {n}")
    last = len(ids) - n
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)] if count > 1 else [0]
    return torch.stack([ids[s:s + n] for s in starts])


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, policy: Policy, chunk: int = 64, batch: int = 4,
                 fast: bool = True, progress: bool = False, own: str = "full") -> list[float]:
    """Mean loss (nats/token) on the second half of each window, fed through a cache with ``policy``.

    windows: int64 ``[W, N]``. The first ``N/2`` tokens are prefilled in one call; the rest go through
    the cache ``chunk`` tokens at a time. ``own``: how each call reads its own tokens' keys and values
    (``OWN``: "full", kvcompile's engines; "stored", an engine reading every position from its pages).
    Returns one number per window.
    """
    check_own(own, policy, fast)
    W, N = windows.shape
    nll = torch.zeros(W, dtype=torch.float64)
    bar = tqdm(total=W * (1 + math.ceil((N - N // 2) / chunk)), disable=not progress, leave=False,
               desc=f"loss {policy}"[:60])
    for rows, s, pred in scored_logits(model, windows, policy, chunk, batch, fast, on_call=bar.update, own=own):
        nll[rows] += F.cross_entropy(pred.reshape(-1, pred.shape[-1]), windows[rows, s:s + pred.shape[1]].reshape(-1),
                                     reduction="none").view(len(pred), -1).double().sum(1)
    bar.close()
    return (nll / (N - N // 2)).tolist()


def scored_logits(model, windows: torch.Tensor, policy: Policy, chunk: int = 64, batch: int = 4, fast: bool = True,
                  on_call=None, own: str = "full"):
    """The held-out protocol's predictions: yields ``(rows, s, pred)`` where ``pred``, float32 ``[b, c, V]``,
    predicts tokens ``windows[rows, s:s + c]`` of the second half, fed through a cache with ``policy``.

    The first ``N/2`` tokens of each window are prefilled in one call, the rest go through the cache ``chunk``
    tokens at a time; ``on_call(rows)`` after each model call (progress); ``own``: see ``heldout_loss``. Under
    ``own="stored"`` a policy that keeps tokens in full precision beside its packed ones (``one_at_a_time``) is
    fed one token a call, the prefill too: every token then reads the store as it stood when it was the newest."""
    W, N = windows.shape
    half = N // 2
    single = own == "stored" and one_at_a_time(policy)
    for w0 in range(0, W, batch):
        rows = slice(w0, min(w0 + batch, W))
        ids = windows[rows]
        cache = make_cache(model, policy, N, fast, own)
        # Position p's logits predict token p + 1: the prefill's last one predicts the first target.
        if single:
            for p in range(half):
                prev = _forward(model, ids[:, p:p + 1], cache, keep=1)
        else:
            prev = _forward(model, ids[:, :half], cache, keep=1)
        if on_call:
            on_call(len(ids))
        for s in range(half, N, chunk):
            if single:
                lg = torch.cat([_forward(model, ids[:, p:p + 1], cache) for p in range(s, min(s + chunk, N))], 1)
            else:
                lg = _forward(model, ids[:, s:s + chunk], cache)
            pred = torch.cat([prev, lg[:, :-1]], 1).float()  # predicts tokens s .. s + chunk - 1
            prev = lg[:, -1:]
            if on_call:
                on_call(len(ids))
            yield rows, s, pred


# --------------------------------------------------------------------------- passkey retrieval
_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the pass key.\n")
_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyTrial:
    length: int
    depth: float
    key: int


def passkey_trials(lengths: Iterable[int], trials: int = 20, seed: int = 0) -> list[PasskeyTrial]:
    """``trials`` random (key, depth) pairs per length; depths are stratified over [0, 1] so every
    region of the context is probed, keys are uniform 5-digit numbers."""
    rng = random.Random(seed)
    out = []
    for L in lengths:
        for i in range(trials):
            depth = (i + rng.random()) / trials
            out.append(PasskeyTrial(L, depth, rng.randrange(10000, 100000)))
    return out


PASSKEY_NEW_TOKENS = 10  # greedy tokens generated for the answer; the prompt leaves room for them


def passkey_layout(tok, trial: PasskeyTrial) -> tuple[list[int], list[int], int, int]:
    """``(prompt_ids, answer_ids, start, end)``: the prompt (exactly ``trial.length - PASSKEY_NEW_TOKENS``
    tokens, filler cut to fit), the expected answer's tokens, and the needle's token span ``[start, end)``."""
    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    intro, question = bos + enc(_INTRO), enc(_QUESTION)
    needle = enc(_NEEDLE.format(key=trial.key))
    unit = enc(_FILLER)
    room = trial.length - PASSKEY_NEW_TOKENS - len(intro) - len(needle) - len(question)
    if room < len(unit):
        raise ArgumentError(f"passkey length {trial.length} leaves no room for filler")
    filler = (unit * (room // len(unit) + 1))[:room]
    # The needle goes at a sentence boundary of the filler, at the trial's depth.
    at = round(trial.depth * (room // len(unit))) * len(unit)
    at = min(at, room - room % len(unit))
    prompt = intro + filler[:at] + needle + filler[at:] + question
    start = len(intro) + at
    return prompt, enc(f" {trial.key}"), start, start + len(needle)


def passkey_prompt(tok, trial: PasskeyTrial) -> tuple[list[int], list[int]]:
    """``(prompt_ids, answer_ids)``: ``trial.length - PASSKEY_NEW_TOKENS`` prompt tokens (filler cut to fit)."""
    return passkey_layout(tok, trial)[:2]


def needle_region(cache: KVCompileCache, start: int, end: int, length: int) -> str:
    """Where tokens ``[start, end)`` are stored once the cache holds ``length`` tokens: ``"packed"`` (in the
    quantized codes of every quantized layer), ``"residual"`` or ``"sink"`` (partly in full precision in some
    quantized layer), or ``"full"`` (no layer quantizes anything)."""
    regions = set()
    for pol in cache.policies:
        if not (pol.key.quantized or pol.value.quantized):
            continue
        regions.add("sink" if start < pol.sink else "residual" if end > pol.boundary(length) else "packed")
    if not regions:
        return "full"
    return "sink" if "sink" in regions else "residual" if "residual" in regions else "packed"


@torch.no_grad()
def _answer(model, tok, ids, cache, key: int, chunk: int, start: int = 0):
    """Feed the prompt ``ids[:, start:]`` (one row) in chunks aligned to multiples of ``chunk`` (position 0
    based), then decode greedily, one token at a time, until the key's digits appear in the generated text or
    ``PASSKEY_NEW_TOKENS`` tokens were generated. Returns ``(hit, text, logprob)``: whether the key was
    generated, the generated text, and the generated tokens' total log-probability."""
    n = ids.shape[1]
    last, s = None, start
    while s < n:
        e = min((s // chunk + 1) * chunk, n)
        last = _forward(model, ids[:, s:e], cache, keep=1)
        s = e
    out, lp = [], 0.0
    for j in range(PASSKEY_NEW_TOKENS):
        logits = last[0, -1].float()
        nxt = int(logits.argmax())
        lp += float(torch.log_softmax(logits, -1)[nxt])
        out.append(nxt)
        text = tok.decode(out)
        if str(key) in text or j + 1 == PASSKEY_NEW_TOKENS:
            return str(key) in text, text, lp
        last = _forward(model, torch.tensor([[nxt]]), cache, keep=1)


@torch.no_grad()
def passkey_retrieved(model, tok, trials: list[PasskeyTrial], policy: Policy, chunk: int = 2048,
                      fast: bool = True) -> list[bool]:
    """Whether greedy decoding returns each trial's key (see ``_answer``), each trial from an empty cache.

    The protocol: the prompt is prefilled through the cache in chunks aligned to multiples of ``chunk`` (one
    call when the prompt is at most ``chunk`` tokens, as ``generate`` does), then decoded greedily."""
    hits = []
    for t in trials:
        prompt, _ = passkey_prompt(tok, t)
        cache = make_cache(model, policy, t.length, fast)
        hits.append(_answer(model, tok, torch.tensor([prompt]), cache, t.key, chunk)[0])
    return hits


def _fork(cache: "_EvalCache", model, policy: Policy) -> "_EvalCache":
    """A copy of ``cache`` that can go on independently (copied stores, views and counters)."""
    new = make_cache(model, policy, cache.max_cache_len)
    for a, b in zip(cache.layers, new.layers):
        if not isinstance(a, _EvalLayer):
            b.__dict__.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.__dict__.items()})
            continue
        b.initialize(a.store.batch, a.spec.heads, a.spec.head_dim, a._k.dtype, a.device)
        b.store.__dict__.update(a.store.copy().__dict__)
        b._k, b._v, b._chunk = a._k.clone(), a._v.clone(), a._chunk
        b.cumulative_length.copy_(a.cumulative_length)
    return new


@torch.no_grad()
def passkey_retrieved_shared(model, tok, trials: list[PasskeyTrial], policy: Policy,
                             chunk: int = 2048, on_trial=None, details: dict | None = None) -> list[bool]:
    """``passkey_retrieved`` for trials of one length, sharing the filler before each needle.

    The prompt chunks wholly before the needle are the same tokens in every trial, so one "trunk" cache
    consumes them once, in depth order; each trial forks the trunk at the start of the chunk that holds its
    needle and feeds the rest exactly as ``passkey_retrieved`` does (same chunk boundaries, so the same
    numbers). ``details``: filled with one dict per trial index (depth, key, needle span, where the needle
    is stored, hit, the generated answer and its log-probability).
    """
    order = sorted(range(len(trials)), key=lambda i: trials[i].depth)
    layouts = {i: passkey_layout(tok, trials[i]) for i in order}
    if len({trials[i].length for i in order}) > 1:
        raise ArgumentError("passkey_retrieved_shared needs trials of one length")
    out = [False] * len(trials)
    trunk, fed = None, 0
    for i in order:
        prompt, _, n0, n1 = layouts[i]
        ids = torch.tensor([prompt])
        capacity = trials[i].length
        if trunk is None:
            trunk = make_cache(model, policy, capacity)
        start = min(n0 // chunk * chunk, len(prompt))  # the needle's chunk and everything after: per trial
        if start < fed:
            raise AssertionError("trials must be fed in depth order")
        while fed < start:  # advance the trunk to that chunk, in whole aligned chunks of pure filler
            _forward(model, ids[:, fed:fed + chunk], trunk, keep=1)
            fed += chunk
        branch = _fork(trunk, model, policy) if trunk.layers[0].is_initialized else make_cache(
            model, policy, capacity)
        hit, text, lp = _answer(model, tok, ids, branch, trials[i].key, chunk, start)
        out[i] = hit
        if details is not None:
            details[i] = {"depth": trials[i].depth, "key": trials[i].key, "needle": [n0, n1],
                          "region": needle_region(branch, n0, n1, len(prompt)), "hit": hit,
                          "answer": text, "logprob": lp}
        del branch
        if on_trial:
            on_trial()
    return out


def passkey_accuracy(model, tok, policy: Policy, lengths=(1024, 2048, 4096, 8192), trials: int = 20,
                     seed: int = 0, progress: bool = False, on_length=None, chunk: int = 2048,
                     details: dict | None = None) -> dict[int, float]:
    """Accuracy (0..1) per context length over ``trials`` random keys and depths each.

    ``on_length(acc)`` is called after each length with the accuracies so far (long runs save as they go).
    ``details``: filled with ``{length: [per-trial dict, ...]}`` (see ``passkey_retrieved_shared``).
    """
    acc = {}
    bar = tqdm(total=len(lengths) * trials, disable=not progress, leave=False, desc=f"passkey {policy}"[:60])
    for L in lengths:
        ts = passkey_trials([L], trials, seed + L)
        per: dict = {}
        hits = passkey_retrieved_shared(model, tok, ts, policy, chunk=chunk, on_trial=lambda: bar.update(1),
                                        details=per)
        acc[L] = sum(hits) / len(hits)
        if details is not None:
            details[L] = [per[i] for i in range(len(ts))]
        if on_length:
            on_length(dict(acc))
    bar.close()
    return acc


def packed_accuracy(details: list[dict]) -> tuple[float | None, int]:
    """Accuracy over the trials whose needle is entirely in packed (quantized) storage, and their count."""
    packed = [d["hit"] for d in details if d["region"] == "packed"]
    return (sum(packed) / len(packed) if packed else None), len(packed)


# --------------------------------------------------------------------------- the whole evaluation
def entry_policy(entry: str, config) -> tuple[str, float, Policy | None]:
    """``(scheme, bits, policy)`` of an entry: ``"kivi:4"`` -> ``("kivi", 4, its policy or None)``; a policy file
    -> ``(its file name, the mean stored bits per element over the model's layers, the policy)``."""
    if not is_policy_file(entry):
        name, b = parse_entry(entry)
        return name, b, scheme_policy(name, b)
    pol = Policy.load(entry)
    return Path(entry).name, code_bits(pol, config), pol


def code_bits(policy: Policy, config) -> float:
    """Mean bits of a stored code over every layer's keys and values (full precision counted as 16), rounded
    to 0.01: the x-axis of the eval's plot for a per-layer policy (scales and residual not counted)."""
    per = [q.bits or 16 for p in KVCompileCache(config, policy, 1).policies for q in (p.key, p.value)]
    return round(sum(per) / len(per), 2)


_PASSKEY_PRE_ROPE = ("passkey {entry}: a pre_rope policy is measured through the compiled model, and the passkey "
                     "harness forks eager caches (not done for it yet); evaluate its held-out loss, or name a "
                     "policy without pre_rope for passkey")


def run(model, tok, schemes: Iterable[str] = DEFAULT_SCHEMES, bits: Iterable[int] = DEFAULT_BITS,
        window: int = 2048, windows: int = 4, chunk: int = 64, passkey: Iterable[str] = (),
        passkey_lengths=(1024, 2048, 4096, 8192), passkey_trials_n: int = 20, seed: int = 0,
        progress: bool = True, log=print, fast: bool = True, out_dir=None,
        entries: Iterable[str] | None = None, passkey_chunk: int = 2048, own: str = "full") -> dict:
    """Loss delta of every ``scheme x bits`` over full precision, and passkey accuracy of the ``passkey``
    entries: ``"full"``, ``"scheme:bits"`` or ``"best:bits"`` (the lowest loss delta of that width).
    ``entries``: ``"scheme:bits"`` strings or policy files (``*.json``, ``Policy.save``) to evaluate instead of
    ``schemes x bits`` (``[]``: passkey only); ``passkey`` entries may be policy files too.
    ``out_dir``: write ``eval.partial.json`` there after every row. ``passkey_chunk``: the prompt is prefilled
    through the cache in aligned chunks of this many tokens (see ``passkey_retrieved``). ``own``: how the
    held-out loss's calls read their own keys and values (``OWN``; passkey prompts always as ``"full"``).
    Returns a JSON-ready dict (see ``write``)."""
    check_own(own)
    layers, kv_heads, head_dim = model_shape(model.config)
    for entry in passkey:  # refused before the loss rows run, not after
        if entry != "full" and not entry.startswith("best:") and stores_pre_rope(entry_policy(entry, model.config)[2]
                                                                                 or Policy.full()):
            raise ArgumentError(_PASSKEY_PRE_ROPE.format(entry=entry))
    W = heldout_windows(tok, window, windows)
    if entries is not None:  # explicit "scheme:bits" list (or policy files) instead of the product
        pairs = [entry_policy(e, model.config) for e in entries]
    else:
        pairs = [(name, b, scheme_policy(name, b)) for b in bits for name in schemes]
    todo = [("full", 16, Policy.full())] if pairs else []
    todo += [t for t in pairs if t[2] is not None]
    for _, _, pol in todo:  # refused before any row runs, not at the row
        check_own(own, pol)
    fp_bpt = full_precision_bytes_per_token(layers, kv_heads, head_dim)
    res = {"model": getattr(model.config, "_name_or_path", "") or "model",
           "window": window, "windows": windows, "chunk": chunk, "seed": seed, "own": own,
           "full_precision_bytes_per_token_bf16": fp_bpt, "rows": [], "passkey": {},
           "cache_path": "reference store (KVCompileCache numerics, incremental view)" if fast
           else "reference store (KVCompileCache)"}
    base = None
    for name, b, pol in tqdm(todo, desc="loss", disable=not progress):
        t0 = time.perf_counter()
        pre = stores_pre_rope(pol)
        if pre:  # only the compiled model stores pre-RoPE keys (compiled_copy)
            losses = heldout_loss(compiled_copy(model, pol), W, pol, chunk, fast=False, progress=progress)
            torch._dynamo.reset()  # the copy's graphs go with it
        else:
            losses = heldout_loss(model, W, pol, chunk, fast=fast, progress=progress, own=own)
        if base is None:
            base = losses
        deltas = [x - y for x, y in zip(losses, base)]
        row = {"scheme": name, "bits": b, "policy": str(pol), "loss": sum(losses) / len(losses),
               "loss_delta": sum(deltas) / len(deltas), "loss_delta_per_window": deltas,
               "bytes_per_token_bf16": bytes_per_token(pol, layers, kv_heads, head_dim, window),
               "seconds": time.perf_counter() - t0}
        row["ratio_to_bf16"] = row["bytes_per_token_bf16"] / fp_bpt
        if pre:
            row["cache_path"] = "compiled model (kvcompile.apply, compiler='eager'; KVCompileCache)"
        res["rows"].append(row)
        log(f"{name:>10} {b:>2} bits  loss {row['loss']:.4f}  delta {row['loss_delta']:+.5f}  "
            f"{row['bytes_per_token_bf16']:,.0f} B/token  ({row['seconds']:.0f} s)")
        if out_dir is not None:
            _write_json(res, Path(out_dir) / "eval.partial.json")
    for entry in passkey:
        if entry == "full":
            name, b, pol = "full", 16, Policy.full()
        elif is_policy_file(entry):
            name, b, pol = entry_policy(entry, model.config)
        else:
            name, b = parse_entry(entry)
            if name == "best":  # the measured best scheme of that width, by loss delta
                cands = [r for r in res["rows"] if r["bits"] == b and r["scheme"] in SCHEMES]  # not policy files
                if not cands:
                    raise ArgumentError(f"{entry!r}: no {b}-bit scheme was evaluated")
                name = min(cands, key=lambda r: r["loss_delta"])["scheme"]
            pol = scheme_policy(name, b)
            if pol is None:
                raise ArgumentError(f"{entry!r}: scheme {name!r} has no {b}-bit policy")
        if stores_pre_rope(pol):
            raise ArgumentError(_PASSKEY_PRE_ROPE.format(entry=f"{entry} ({name}:{b})"))
        t0 = time.perf_counter()
        details: dict = {}

        key = f"{name}:{b}" + ("" if passkey_chunk == 2048 else f"@chunk{passkey_chunk}")

        def save(acc, key=key, pol=pol, t0=t0, details=details):
            entry = {"policy": str(pol), "accuracy": {str(k): v for k, v in acc.items()},
                     "trials": passkey_trials_n, "prefill_chunk": passkey_chunk,
                     "bytes_per_token_bf16": {str(k): bytes_per_token(pol, layers, kv_heads, head_dim, k)
                                              for k in acc},
                     "seconds": time.perf_counter() - t0}
            if any(d["region"] != "full" for ds in details.values() for d in ds):
                entry["accuracy_needle_packed"] = {str(k): packed_accuracy(ds)[0] for k, ds in details.items()}
                entry["needle_packed_trials"] = {str(k): packed_accuracy(ds)[1] for k, ds in details.items()}
            entry["trials_detail"] = {str(k): ds for k, ds in details.items()}
            res["passkey"][key] = entry
            log(f"passkey {key} so far: " + "  ".join(f"{k}: {v:.0%}" for k, v in acc.items()))
            if out_dir is not None:
                _write_json(res, Path(out_dir) / "eval.partial.json")
        acc = passkey_accuracy(model, tok, pol, passkey_lengths, passkey_trials_n, seed, progress=progress,
                               on_length=save, chunk=passkey_chunk, details=details)
        save(acc)
        log(f"passkey {key}  " + "  ".join(f"{k}: {v:.0%}" for k, v in acc.items()))
    return res


def merge(results: list[dict]) -> dict:
    """One result from several runs (rows and passkey entries; later runs win on duplicates). Runs whose loss
    rows read a chunk's own keys and values differently (``own``) are not one table: refused."""
    owns = {r.get("own", "full") for r in results if r["rows"]}
    if len(owns) > 1:
        raise ArgumentError(f"these runs measured the held-out loss under different protocols (own: "
                            f"{', '.join(sorted(owns))}): their rows are not comparable; merge runs of one protocol")
    out = dict(results[0])
    if owns:
        out["own"] = owns.pop()
    rows, pk = {}, {}
    per_length = ("accuracy", "accuracy_needle_packed", "needle_packed_trials", "bytes_per_token_bf16",
                  "trials_detail")
    for r in results:
        for row in r["rows"]:
            rows[(row["scheme"], row["bits"])] = row
        for key, v in r.get("passkey", {}).items():
            old = pk.get(key)
            if old is None or old.get("prefill_chunk") != v.get("prefill_chunk") or old.get("trials") != v.get(
                    "trials"):
                pk[key] = v  # another protocol (or the first run): the later run wins
                continue
            # the same entry and protocol measured at other lengths in another run: one entry, lengths sorted
            new = dict(v)
            for f in per_length:
                both = {**old.get(f, {}), **v.get(f, {})}
                if both:
                    new[f] = {k: both[k] for k in sorted(both, key=int)}
            if not set(old.get("accuracy", {})) & set(v.get("accuracy", {})):  # a re-merged run is not counted twice
                new["seconds"] = old.get("seconds", 0) + v.get("seconds", 0)
            pk[key] = new
    # full precision first, then by width (widest first) and by loss delta within a width
    out["rows"] = sorted(rows.values(), key=lambda r: (r["scheme"] != "full", -r["bits"], r["loss_delta"]))
    out["passkey"] = pk
    out["merged_from"] = [r.get("command") for r in results]
    return out


def _write_json(res, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))


def format_table(res: dict) -> str:
    pk = res.get("passkey", {})
    lines = [f"{'scheme':<14}{'bits':>5}{'bytes/token':>13}{'x bf16':>8}{'loss':>9}{'delta':>11}  passkey",
             "-" * 74]
    for r in res["rows"]:
        acc = pk.get(f"{r['scheme']}:{r['bits']}")
        ps = " ".join(f"{int(round(v * 100))}" for v in acc["accuracy"].values()) if acc else ""
        lines.append(f"{r['scheme']:<14}{r['bits']:>5}{r['bytes_per_token_bf16']:>13,.0f}{r['ratio_to_bf16']:>8.3f}"
                     f"{r['loss']:>9.4f}{r['loss_delta']:>+11.5f}  {ps}")
    if res["rows"] and res.get("own", "full") != "full":
        lines.append(f"loss: each call read its own tokens' keys and values {OWN[res['own']]}")
    if pk:
        lines += ["", "passkey retrieval (% of trials; 'packed': only trials whose needle is in quantized storage)",
                  f"{'entry':<28}{'chunk':>6}{'trials':>7}  {'length':>6}{'retrieved':>10}{'packed':>12}"
                  f"{'bytes/token':>13}", "-" * 82]
        for key, v in pk.items():
            packed = v.get("accuracy_needle_packed", {})
            n_packed = v.get("needle_packed_trials", {})
            bpt = v.get("bytes_per_token_bf16", {})
            for L, a in v["accuracy"].items():
                pa = packed.get(L)
                pcol = f"{pa * 100:.0f} ({n_packed.get(L)})" if pa is not None else "-"
                b = f"{bpt[L]:,.0f}" if L in bpt else "-"
                lines.append(f"{key:<28}{str(v.get('prefill_chunk', 'split')):>6}{v.get('trials', '?'):>7}  {L:>6}"
                             f"{a * 100:>9.0f}%{pcol:>12}{b:>13}")
        if any("prefill_chunk" not in v for v in pk.values()):
            lines.append("chunk 'split': an earlier harness, which split the prefill at the needle (2,048-token "
                         "chunks before it and from it)")
    return "\n".join(lines)


def write(res: dict, out_dir) -> tuple[Path, Path]:
    """``eval.json`` and ``eval.png`` (loss delta vs bits per scheme; passkey accuracy vs context)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "eval.json"
    js.write_text(json.dumps(res, indent=2))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    by: dict[str, list] = {}
    for r in res["rows"]:
        if r["scheme"] != "full":
            by.setdefault(r["scheme"], []).append((r["bits"], max(r["loss_delta"], 1e-5)))
    colors, markers = plt.get_cmap("tab20").colors, "osD^vPX*<>ph"
    for i, (name, pts) in enumerate(by.items()):  # a colour and a marker each: 13+ schemes stay apart
        pts.sort()
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], label=name,
               color=colors[(2 * i) % 20 + (2 * i // 20) % 2], ls="-" if i < 10 else "--")
    a.set_yscale("log")
    a.set_xticks([2, 3, 4, 8])
    a.set_xlabel("bits per stored element (codes)")
    a.set_ylabel("loss increase over full precision (nats/token)\n(deltas <= 1e-5, incl. negative, at 1e-5)",
                 fontsize=8)
    a.set_title(f"held-out loss, {res['windows']} x {res['window']} tokens")
    a.grid(alpha=0.3, which="both")
    if by:
        a.legend(fontsize=7)
    for i, (name, v) in enumerate(res.get("passkey", {}).items()):
        xs = [int(k) for k in v["accuracy"]]
        b.plot(xs, [100 * x for x in v["accuracy"].values()], marker=markers[i % len(markers)], label=name,
               alpha=0.8, ms=9 - 1.5 * (i % 4))  # shrinking markers: curves that coincide stay visible
    b.set_xscale("log", base=2)
    b.set_ylim(-5, 105)
    b.set_xlabel("context length (tokens)")
    b.set_ylabel("passkey retrieved (%)")
    b.set_title("passkey retrieval")
    b.grid(alpha=0.3)
    if res.get("passkey"):
        b.legend(fontsize=7)
    fig.suptitle(res.get("model", ""), fontsize=9)
    fig.tight_layout()
    png = out / "eval.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return js, png
