"""The ``kvcompile`` command: ``demo``, ``eval``, ``plan`` and ``calibrate``.

    kvcompile demo                      # SmolLM2, default policy: bytes saved, loss delta, tokens/s, a reply
    kvcompile eval --out results/       # the quality table: loss delta per scheme and width, passkey
    kvcompile plan --preset llama3-8b   # concurrent sequences per GPU, exact bytes per token
    kvcompile calibrate --budget 3 --out policy.json   # per-layer bits in the bytes of a 3-bit cache, as a file
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from .errors import ArgumentError
from .pool import MAX_BATCH_TOKENS

DEMO_PROMPT = "What is the capital of France? Answer in one sentence, then name one famous landmark there."

# A bare `kvcompile eval` (every default scheme x width, then passkey for full, best:4 and best:2 at 1K-8K): the
# sum of the per-entry times measured for docs/eval.json on this project's 2-core CPU (loss rows 22 minutes,
# passkey full 29, kivi+rot+sink:4 31, kivi-k3v2:2 32; one thread per run).
EVAL_BARE_MINUTES = 115


class UsageError(ArgumentError):
    """Something the user asked for cannot be done; ``main`` prints it as one line and exits with status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's errors on one line (no usage block), pointing at --help; exit status 2 as argparse's."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _number(kind, what: str, low=None, low_open=False, high=None):
    """An argparse type: ``kind`` (int or float), finite, within [low, high] (low excluded if ``low_open``)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        if low is not None and (v < low or (low_open and v == low)) or high is not None and v > high:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    parse.__name__ = what
    return parse


MODEL_HELP = "a local Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)"
_POSITIVE_INT = _number(int, "a positive whole number", 1)
_NONNEG_INT = _number(int, "a whole number >= 0", 0)
_POSITIVE_GB = _number(float, "a positive number of gigabytes", 0, low_open=True)
_NONNEG_GB = _number(float, "a number of gigabytes >= 0", 0)
_FRACTION = _number(float, "a fraction in (0, 1]", 0, low_open=True, high=1)


def default_policy():
    """The demo's policy (``kvcompile.presets.default_policy``)."""
    from .presets import default_policy as default
    return default()


def _entry_policy(text: str):
    """``SCHEME:BITS`` -> its policy (``presets.entry_policy``); a ``UsageError`` that lists the choices otherwise."""
    from .presets import entry_policy
    try:
        return entry_policy(text)
    except ValueError as e:
        raise UsageError(f"{e}") from None


def _spelled(text: str) -> str:
    """``presets.spelled``, its errors as a ``UsageError``."""
    from .presets import spelled
    try:
        return spelled(text)
    except ValueError as e:
        raise UsageError(f"{e}") from None


def _policy_arg(text: str):
    """``default``, ``full``, ``SCHEME:BITS`` (or a short form: ``int8``, ``fp8``, ``kivi4``) or a policy file
    (``*.json``, written by ``Policy.save`` or ``calibrate``): ``kvcompile.presets.named``."""
    from .presets import named
    try:
        return named(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(_one_line(e)) from None


def _tokenizer(name, path):
    """The tokenizer saved in ``path`` (``--model name``), or a ``UsageError`` saying it is missing."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {str(name)!r}: no tokenizer could be loaded from {path} ({_one_line(e)}); "
                         f"save the tokenizer next to the model (tokenizer.save_pretrained)") from None


def _load_model(name):
    """``(tokenizer, load_model)`` as ``models.load`` reads them, the user's mistakes (no such model, a folder
    transformers cannot load) as ``UsageError``s; the tokenizer comes first, so the checks that need it run
    before the weights are read."""
    from transformers import AutoModelForCausalLM

    import torch

    from . import models
    path = models.resolve(name, log=lambda m: print(m, file=sys.stderr))  # ModelNotFound: a user error
    tok = _tokenizer(name, path)

    def model():
        try:
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"--model {str(name)!r}: the model in {path} could not be loaded "
                             f"({_one_line(e)}); pass a folder saved with save_pretrained") from None
        m.eval()
        return m
    return tok, model


def _warn(cmd: str, message: str) -> None:
    print(f"kvcompile {cmd}: warning: {_one_line(message)}", file=sys.stderr, flush=True)


def _check_heldout(tok, window: int, option: str) -> None:
    from .evaluate import heldout_text
    n = len(tok(heldout_text(), add_special_tokens=False)["input_ids"])
    if window > n:
        raise UsageError(f"{option} {window} is longer than the held-out text ({n:,} tokens with this "
                         f"tokenizer); use {option} {n} or less")


def _check_writable_file(path: str, option: str) -> None:
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{option} {path!r} is a directory: give a file name, e.g. {p / 'out'}")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path!r}: {str(parent)!r} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path!r}: {str(parent)!r} is not writable")


def _chat_ids(tok, prompt: str):
    if getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tok(prompt, return_tensors="pt").input_ids


def _timed_generate(model, tok, ids, max_new_tokens, **kw):
    import torch
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id,
                             **kw)
    dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    return tok.decode(new, skip_special_tokens=True).strip(), len(new), dt


def _dynamic_cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def cmd_demo(args) -> int:
    import torch
    from transformers import DynamicCache

    import kvcompile
    from .evaluate import cache_kwarg, heldout_loss, heldout_windows
    from .hf import KVCompileCache, model_shape
    from .policy import Policy

    t_start = time.perf_counter()
    torch.manual_seed(0)
    tok, load_model = _load_model(args.model)
    policy = args.policy or default_policy()
    ids = _chat_ids(tok, args.prompt)
    n_new = args.max_new_tokens
    if ids.shape[1] + n_new > args.capacity:
        raise UsageError(f"--capacity {args.capacity} is too small: the prompt is {ids.shape[1]} tokens and "
                         f"--max-new-tokens {n_new} more; use --capacity {ids.shape[1] + n_new} or more")
    _check_heldout(tok, args.loss_window, "--loss-window")
    reason = policy.noop_reason(args.capacity)
    if reason:
        _warn("demo", f"with --capacity {args.capacity}, {reason}")
    model = load_model()
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded)'}\npolicy: {policy}")

    ckw = cache_kwarg(model)

    def step(msg):
        print(f"[{time.perf_counter() - t_start:5.0f} s] {msg}", file=sys.stderr, flush=True)
    step("generating with the full-precision cache")
    # 1. Full precision: the model as it comes, Hugging Face's default DynamicCache.
    fcache = DynamicCache()
    freply, fn, fdt = _timed_generate(model, tok, ids, n_new, **{ckw: fcache})
    fbytes_used = _dynamic_cache_bytes(fcache)
    tokens = ids.shape[1] + fn

    step("held-out loss, full precision and quantized")
    # 2. Quality: held-out loss through the reference cache (eager; the numerics apply() computes).
    W = heldout_windows(tok, args.loss_window, 1)
    base, q = heldout_loss(model, W, Policy.full())[0], heldout_loss(model, W, policy)[0]

    step(f"kvcompile.apply (compiler={args.compiler!r}), then the first token")
    # 3. The same model after kvcompile.apply: compiled, the cache stored per the policy.
    compiler = args.compiler
    kvcompile.apply(model, policy, compiler=compiler)
    cap = args.capacity
    names = model._kvcompile.layer_names
    n_layers, kv_heads, head_dim = model_shape(model.config)
    dtype = next(model.parameters()).dtype

    def new_cache():
        return KVCompileCache(model.config, policy, cap, layer_names=names)
    _, _, first = _timed_generate(model, tok, ids, 1, **{ckw: new_cache()})  # the prefill, and the first token
    step("the decode graph compiles at the second token")
    _, _, warm = _timed_generate(model, tok, ids, 2, **{ckw: new_cache()})
    step("generating with the quantized cache")
    qcache = new_cache()
    qreply, qn, qdt = _timed_generate(model, tok, ids, n_new, **{ckw: qcache})
    # A whole conversation of `cap` tokens, by the stores' exact accounting (tested equal to what a store holds)
    full_cap = kvcompile.cache_bytes(Policy.full(), n_layers, kv_heads, head_dim, cap, dtype=dtype, layer_names=names)
    q_cap = kvcompile.cache_bytes(policy, n_layers, kv_heads, head_dim, cap, dtype=dtype, layer_names=names)

    print(f"\nKV cache of one {cap:,}-token conversation, {n_layers} layers (exact bytes, as the stores hold them):")
    print(f"  full precision  {full_cap:>13,} B")
    print(f"  quantized       {q_cap:>13,} B   {full_cap / q_cap:.2f}x smaller")
    print(f"  (this reply's {tokens} tokens: the quantized cache holds {qcache.nbytes:,} B -- its newest "
          f"{policy.residual} tokens stay in full precision -- and a full-precision DynamicCache held "
          f"{fbytes_used:,} B)")
    print(f"held-out loss, pydoc_data.topics, {args.loss_window}-token window, second half through the cache "
          f"(eager reference path): {base:.4f} -> {q:.4f} nats/token, delta {q - base:+.4f}")
    print(f"first token after kvcompile.apply: {first:.1f} s (the prefill runs without compiling); the second "
          f"call, which compiles the decode graph, took {warm:.0f} s")
    print(f"decode speed, greedy, {n_new} new tokens: full precision (HF DynamicCache, eager) {fn / fdt:.1f} tok/s; "
          f"kvcompile.apply(compiler={compiler!r}) {qn / qdt:.1f} tok/s")
    print(f"\nprompt: {args.prompt}")
    print(f"reply (quantized cache): {qreply}")
    if qreply != freply:
        print(f"reply (full precision):  {freply}")
    print(f"\n({time.perf_counter() - t_start:.0f} s in all)")
    return 0


EVAL_DEFAULTS = dict(model=None, schemes=None, bits=None, entries=None, window=2048, windows=4, chunk=64,
                     passkey=None, passkey_lengths=[1024, 2048, 4096, 8192], passkey_chunk=2048, trials=20, seed=0,
                     own="full")
# passkey entries when --passkey is not given: best:BITS of the widths the run evaluates
EVAL_PASSKEY = ("full", "best:4", "best:2")
_ROW_KEYS = ("scheme", "bits", "bytes_per_token_bf16", "ratio_to_bf16", "loss", "loss_delta")


def _read_eval_json(path: str) -> dict:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"--merge {path!r}: no such file; give the eval.json files of earlier runs")
    try:
        res = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--merge {path!r} is not readable JSON ({_one_line(e)})") from None
    ok = (isinstance(res, dict) and isinstance(res.get("rows"), list) and "window" in res and "windows" in res
          and all(isinstance(r, dict) and all(k in r for k in _ROW_KEYS) for r in res["rows"])
          and isinstance(res.get("passkey", {}), dict))
    if not ok:
        raise UsageError(f"--merge {path!r} is not an eval.json written by kvcompile eval (it needs 'window', "
                         f"'windows' and 'rows' with {', '.join(_ROW_KEYS)})")
    return res


def _eval_pairs(args) -> list[tuple[str, int, object]]:
    """The (scheme, bits, policy) rows a run evaluates, checked before the model is loaded."""
    from .evaluate import DEFAULT_BITS, DEFAULT_SCHEMES, is_policy_file, parse_entry, scheme_policy
    if args.entries is not None:
        if args.schemes is not None or args.bits is not None:
            raise UsageError("--entries replaces --schemes and --bits: pass SCHEME:BITS entries, or --schemes "
                             "and --bits, not both")
        out = []
        for e in args.entries:
            if e != "none":
                pol = _policy_arg_usage(e, "--entries")
                out.append((e, 0, pol) if is_policy_file(e) else (*parse_entry(e), pol))
        return out
    schemes = args.schemes or list(DEFAULT_SCHEMES)
    bits = args.bits or list(DEFAULT_BITS)
    out = [(n, b, scheme_policy(n, b)) for b in bits for n in schemes]
    out = [t for t in out if t[2] is not None]
    if not out:
        raise UsageError(f"--schemes {' '.join(schemes)} at --bits {' '.join(map(str, bits))} gives no policy to "
                         f"evaluate (fp8, fp8-r0, int8, int8+rot and fp8+rot+sink are 8-bit only, kivi-k3v2 "
                         f"2-bit only); add a width they have, or use --entries")
    return out


def _policy_arg_usage(text: str, option: str):
    """``_policy_arg`` for options read after parsing: a ``UsageError`` naming ``option``."""
    try:
        return _policy_arg(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"{option} {text}: {e}") from None


def _check_passkey(entries, pairs) -> None:
    from .evaluate import is_policy_file
    for e in entries:
        if e == "full":
            continue
        if is_policy_file(e):
            _policy_arg_usage(e, "--passkey")
            continue
        name, sep, bits = e.rpartition(":")
        if name == "best" and bits.isdigit():
            if not any(b == int(bits) for _, b, _ in pairs):
                evaluated = sorted({b for _, b, _ in pairs})
                raise UsageError(f"--passkey {e}: best:BITS picks the lowest loss delta among the evaluated "
                                 f"{bits}-bit schemes, and none is evaluated (widths evaluated: "
                                 f"{', '.join(map(str, evaluated)) or 'none'}); add one, or name SCHEME:BITS")
            continue
        try:
            _entry_policy(e)
        except UsageError as err:
            raise UsageError(f"--passkey {e}: {err} (or 'full', or best:BITS)") from None


def cmd_eval(args) -> int:
    from .evaluate import DEFAULT_BITS, DEFAULT_SCHEMES, PasskeyTrial, format_table, merge, passkey_layout, run, write

    given = [k for k, v in EVAL_DEFAULTS.items() if getattr(args, k) != v]
    if args.merge:
        if given:
            raise UsageError(f"--merge re-renders earlier runs and runs no model: "
                             f"{', '.join('--' + k.replace('_', '-') for k in given)} would have no effect; "
                             f"drop {'it' if len(given) == 1 else 'them'}, or run without --merge")
        results = [_read_eval_json(p) for p in args.merge]
        _check_out(args.out)
        try:
            res = merge(results)
        except ArgumentError as e:
            raise UsageError(f"--merge: {e}") from None
    else:
        pairs = _eval_pairs(args)
        if args.own != "full":
            from .evaluate import stores_pre_rope
            for name, b, pol in pairs:
                if pol is not None and stores_pre_rope(pol):
                    label = name if name.endswith(".json") else f"{name}:{b}"
                    raise UsageError(f"--own {args.own}: {label} stores keys before the rotary embedding "
                                     f"(pre_rope), which only the compiled model measures, and --own {args.own} "
                                     f"is measured through the eager cache (an engine that reads every position "
                                     f"from its pages refuses pre_rope policies too); drop {label} or --own")
        if args.passkey is None:  # not given: full, and best:BITS of the widths the run evaluates
            widths = {b for _, b, _ in pairs}
            args.passkey = [e for e in EVAL_PASSKEY if not e.startswith("best:") or int(e[5:]) in widths]
        if not pairs and not args.passkey:
            raise UsageError("--entries none with no --passkey entries evaluates nothing: add SCHEME:BITS entries "
                             "or passkey entries (e.g. --passkey full kivi:4)")
        if args.passkey:
            _check_passkey(args.passkey, pairs)
        _check_out(args.out)
        tok, load_model = _load_model(args.model)
        if pairs:
            _check_heldout(tok, args.window, "--window")
        for L in args.passkey_lengths if args.passkey else ():
            try:
                passkey_layout(tok, PasskeyTrial(L, 0.5, 10000))
            except ValueError:
                raise UsageError(f"--passkey-lengths {L} is too short for the passkey prompt (intro, needle, "
                                 f"question and one filler sentence); use 256 or more") from None
        for name, b, pol in pairs:
            reason = pol.noop_reason(args.window)
            if reason:
                label = name if name.endswith(".json") else f"{name}:{b}"  # a policy file, or SCHEME:BITS
                _warn("eval", f"{label} in a {args.window}-token --window: {reason}")
        model = load_model()
        entries = None if args.entries is None else [e for e in args.entries if e != "none"]
        res = run(model, tok, args.schemes or list(DEFAULT_SCHEMES), args.bits or list(DEFAULT_BITS), args.window,
                  args.windows, args.chunk, args.passkey, args.passkey_lengths, args.trials, args.seed,
                  progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr, flush=True),
                  out_dir=args.out, entries=entries, passkey_chunk=args.passkey_chunk, own=args.own)
        res["command"] = "kvcompile " + " ".join(args.argv)
    print(format_table(res))
    try:
        js, png = write(res, args.out)
    except OSError as e:
        raise UsageError(f"--out {args.out!r}: could not write the results ({_one_line(e)})") from None
    print(f"wrote {js} and {png}")
    return 0


def _check_out(out: str) -> None:
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"--out {out!r} is a file: give a directory for eval.json and eval.png")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out!r}: the directory could not be created ({_one_line(e)})") from None
    if not os.access(p, os.W_OK):
        raise UsageError(f"--out {out!r} is not writable")


PLAN_GPU_GB, PLAN_UTILIZATION, PLAN_PRESET = 80.0, 0.9, "llama3-8b"
# plan --serving: the model and budget kvcompile serve uses by default (its --budget-mib)
PLAN_SERVING_PRESET, PLAN_SERVING_BUDGET_MIB = "smollm2-135m", 256
PLAN_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # the model's dtype: bytes of a full-precision element


def cmd_plan(args) -> int:
    from . import plan as P

    if not args.serving:
        given = [o for o, v in (("--budget-mib", args.budget_mib), ("--max-requests", args.max_requests),
                                ("--dtype", args.dtype), ("--page-size", args.page_size),
                                ("--shared-tokens", args.shared_tokens),
                                ("--max-batch-tokens", args.max_batch_tokens)) if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} {'sizes' if len(given) == 1 else 'size'} the serving pool "
                             f"(kvcompile serve): add --serving")
    elif args.budget_mib is not None and args.available_gb is not None:
        raise UsageError("--budget-mib and --available-gb both give the serving pool's bytes: pass one of them")
    if args.config and args.preset:
        raise UsageError("--config and --preset both name the model: pass one of them")
    if args.available_gb is not None:
        extra = [o for o, v in (("--gpu-gb", args.gpu_gb), ("--utilization", args.utilization),
                                ("--weights-gb", args.weights_gb)) if v is not None]
        if extra:
            raise UsageError(f"--available-gb is the memory left for the cache, so {' and '.join(extra)} would "
                             f"have no effect; pass --available-gb alone, or --gpu-gb/--utilization/--weights-gb")
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            _check_writable_file(path, opt)
    if args.plot and Path(args.plot).suffix:
        from matplotlib.backend_bases import FigureCanvasBase
        kinds = FigureCanvasBase.get_supported_filetypes()
        if Path(args.plot).suffix[1:].lower() not in kinds:
            raise UsageError(f"--plot {args.plot!r}: matplotlib cannot write {Path(args.plot).suffix!r} files; "
                             f"use .png (or {', '.join('.' + k for k in sorted(kinds) if k != 'png')})")
    weights = None if args.weights_gb is None else args.weights_gb * P.GB
    try:
        if args.config:
            try:
                shape = P.shape_from_config(args.config, weights)
            except P.WeightsUnknown:
                serving_budget_given = args.serving and (args.budget_mib is not None or (
                    args.gpu_gb is None and args.utilization is None))
                if args.available_gb is None and not serving_budget_given:
                    raise UsageError(f"--config {args.config!r}: no *.safetensors or *.bin files next to the config, "
                                     f"so the weights' size is unknown; pass --weights-gb, or --available-gb "
                                     f"(the memory left for the cache)") from None
                shape = P.shape_from_config(args.config, 0.0)  # the weights play no part with a given budget
        else:
            shape = P.PRESETS[args.preset or (PLAN_SERVING_PRESET if args.serving else PLAN_PRESET)]
            if weights is not None:
                shape = replace(shape, weight_bytes=weights)
    except P.PlanError as e:
        raise UsageError(f"--config {args.config!r}: {e}" if args.config else str(e)) from None
    if args.tp != 1:  # one GPU's share of the KV heads and of the weights
        try:
            shape = P.shard(shape, args.tp)
        except P.PlanError as e:
            raise UsageError(f"--tp {args.tp}: {e}") from None
    if args.serving:
        return _plan_serving(args, shape)
    unit = P.GiB if args.gib else P.GB
    if args.available_gb is not None:
        avail = args.available_gb * unit
    else:
        gpu = (args.gpu_gb if args.gpu_gb is not None else PLAN_GPU_GB) * unit
        if not math.isfinite(gpu):
            raise UsageError(f"--gpu-gb {args.gpu_gb} is too large to be a GPU's memory")
        util = args.utilization if args.utilization is not None else PLAN_UTILIZATION
        try:
            avail = P.available_bytes(gpu, util, shape.weight_bytes)
        except P.PlanError as e:
            raise UsageError(f"{e} (see --gpu-gb, --utilization, --weights-gb, or give --available-gb)") from None
    if not math.isfinite(avail):
        raise UsageError(f"--available-gb {args.available_gb} is too large to be a GPU's memory")
    policies = {**P.default_policies(), **{text: pol for text, pol in args.policy or ()}}
    rows = P.plan(shape, args.context, available=avail, policies=policies)
    print(P.format_table(rows, shape, args.context, avail))
    try:
        if args.json:
            Path(args.json).expanduser().parent.mkdir(parents=True, exist_ok=True)  # as --plot does
            with open(Path(args.json).expanduser(), "w") as f:
                f.write(P.to_json(rows, shape, args.context, avail))
        if args.plot:
            print(f"wrote {P.plot(shape, avail, Path(args.plot).expanduser(), policies)}")
    except OSError as e:
        raise UsageError(f"could not write {e.filename or 'the output'}: {e.strerror or _one_line(e)}") from None
    return 0


def _plan_serving(args, shape) -> int:
    """``kvcompile plan --serving``: the pool ``kvcompile serve`` allocates for one budget, under each policy,
    against transformers' own paged cache."""
    from . import plan as P

    if args.dtype is not None:
        shape = replace(shape, dtype_bytes=PLAN_DTYPES[args.dtype])
    if args.budget_mib is not None:
        budget = args.budget_mib * 2**20
    elif args.available_gb is not None or args.gpu_gb is not None or args.utilization is not None:
        unit = P.GiB if args.gib else P.GB
        if args.available_gb is not None:
            avail = args.available_gb * unit
        else:
            gpu = (args.gpu_gb if args.gpu_gb is not None else PLAN_GPU_GB) * unit
            util = args.utilization if args.utilization is not None else PLAN_UTILIZATION
            try:
                avail = P.available_bytes(gpu, util, shape.weight_bytes)
            except P.PlanError as e:
                raise UsageError(f"{e} (see --gpu-gb, --utilization, --weights-gb, or give --budget-mib)") from None
        if not (math.isfinite(avail) and avail < 2**62):
            raise UsageError(f"{avail:g} bytes is too large to be a GPU's memory")
        budget = int(avail)
    else:
        budget = PLAN_SERVING_BUDGET_MIB * 2**20
    page = args.page_size if args.page_size is not None else P.PAGE_SIZE
    policies = {**P.default_serving_policies(), **{text: pol for text, pol in args.policy or ()}}
    try:
        theirs, rows, left_out = P.plan_serving(shape, budget, args.context, policies, args.max_requests, page,
                                                args.shared_tokens or 0, args.max_batch_tokens or MAX_BATCH_TOKENS)
    except P.PlanError as e:
        raise UsageError(f"{e} (--budget-mib {budget / 2**20:g}, --request-tokens {args.context}"
                         + (f", --max-requests {args.max_requests}" if args.max_requests else "")
                         + (f", --shared-tokens {args.shared_tokens})" if args.shared_tokens else ")")) from None
    print(P.format_serving_table(theirs, rows, shape, budget, args.context, args.max_requests, left_out))
    if args.json:
        try:
            Path(args.json).expanduser().parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).expanduser().write_text(
                P.serving_to_json(theirs, rows, shape, budget, args.context, args.max_requests, left_out))
        except OSError as e:
            raise UsageError(f"could not write {e.filename or args.json}: {e.strerror or _one_line(e)}") from None
    if args.plot:
        try:
            png = P.plot_serving(shape, budget, Path(args.plot).expanduser(), policies, page_size=page,
                                 max_requests=args.max_requests, shared_tokens=args.shared_tokens or 0,
                                 max_batch_tokens=args.max_batch_tokens or MAX_BATCH_TOKENS)
        except OSError as e:
            raise UsageError(f"could not write {e.filename or args.plot}: {e.strerror or _one_line(e)}") from None
        print(f"wrote {png}")
    return 0


def _labelled_policy(text: str):
    return text, _policy_arg(text)


def _budget_of(text: str):
    from .evaluate import is_policy_file
    if text == "default" or is_policy_file(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected SCHEME:BITS, a uniform policy, e.g. kivi+rot+sink:3")
    return text, _policy_arg(text)


def cmd_calibrate(args) -> int:
    # kvcompile.calibrate is also the function's name (kvcompile/__init__), so the module is imported by its path
    import kvcompile.calibrate  # noqa: F401
    C = sys.modules["kvcompile.calibrate"]
    from fractions import Fraction

    from .accounting import cache_bytes
    from .hf import model_shape

    _check_writable_file(args.out, "--out")
    given = [o for o, v in (("--budget", args.budget), ("--bits-per-element", args.bits_per_element),
                            ("--bytes-per-token", args.bytes_per_token), ("--bytes-of", args.bytes_of))
             if v is not None]
    if len(given) != 1:
        raise UsageError(f"{' and '.join(given) or 'no budget'} given: pass exactly one of --budget BITS (the bytes "
                         f"of a uniform cache of that many bits), --bits-per-element BITS (average bits per cached "
                         f"element, scales and residual counted), --bytes-per-token N, or --bytes-of SCHEME:BITS")
    if args.save_sensitivity is not None:
        _check_writable_file(args.save_sensitivity, "--save-sensitivity")
    saved = None
    if args.sensitivity is not None:  # a measurement from an earlier run: no model pass at all
        clash = [o for o, v in (("--candidates", args.candidates), ("--tokens", args.tokens),
                                ("--window", args.window), ("--save-sensitivity", args.save_sensitivity))
                 if v is not None]
        if clash:
            raise UsageError(f"--sensitivity with {' and '.join(clash)}: the file holds the measurement (its "
                             f"candidates, on its calibration tokens); drop {' and '.join(clash)}, or measure again "
                             f"without --sensitivity")
        saved = C.Sensitivity.load(args.sensitivity)  # a PolicyError (one line) for a bad file
    tok, load_model = _load_model(args.model)
    model = load_model()
    shape = model_shape(model.config)
    if saved is not None and len(saved.raw_keys) != shape[0]:
        raise UsageError(f"--sensitivity {args.sensitivity}: measured on a model of {len(saved.raw_keys)} layers, "
                         f"but --model has {shape[0]}; measure this model (drop --sensitivity)")
    cands = (saved.candidates if saved is not None else
             tuple(p for _, p in args.candidates) if args.candidates else C.default_candidates(shape[2]))
    bpt = args.bytes_per_token
    if args.bytes_of is not None:  # exact: a float quotient could fall a hair below the policy's own bytes
        bpt = Fraction(cache_bytes(args.bytes_of[1], *shape, args.context), args.context)
    cap = C.check_budget(shape, cands, args.budget, bpt, args.context,
                         bits_per_element=args.bits_per_element)  # before the measurement
    t0 = time.perf_counter()
    if saved is None:
        try:
            windows = C.calibration_windows(tok, args.tokens or C.TOKENS, args.window or C.WINDOW)
        except ValueError as e:
            raise UsageError(f"--tokens/--window: {e}") from None
        sens = C.measure(model, windows, cands, progress=not args.no_progress)
        if args.save_sensitivity is not None:
            sens.save(args.save_sensitivity)
    else:
        sens = saved
    alloc = C.allocate(sens, shape, bytes_per_token=cap, context=args.context)
    alloc.policy.save(args.out)
    print(C.format_allocation(alloc, sens, shape))
    if saved is None:
        print(f"\nmeasured on {sens.tokens:,} scored tokens of {windows.shape[0]} x {windows.shape[1]}-token windows "
              f"of standard-library docstrings in {time.perf_counter() - t0:.0f} s")
        if args.save_sensitivity is not None:
            print(f"wrote {args.save_sensitivity}: allocate at other budgets without measuring again, with "
                  f"kvcompile calibrate --sensitivity {args.save_sensitivity}")
    else:
        print(f"\nsensitivities from {args.sensitivity} ({sens.tokens:,} scored tokens), not measured again")
    print(f"wrote {args.out}: use it with kvcompile eval --entries {args.out}, kvcompile plan --policy {args.out}, "
          f"or kvcompile.Policy.load")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .evaluate import DEFAULT_BITS, DEFAULT_SCHEMES, SCHEMES
    from .plan import PRESETS
    from .serve import SHUTDOWN_GRACE_S

    D = EVAL_DEFAULTS
    from . import __version__
    CAL = importlib.import_module("kvcompile.calibrate")  # the module (kvcompile.calibrate is also a function)

    p = _Parser(prog="kvcompile", description="Quantized KV caches: demo, quality, capacity.")
    p.add_argument("--version", action="version", version=f"kvcompile {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,eval,plan,calibrate,serve}")

    d = sub.add_parser("demo", help="generate with a quantized cache; print bytes, loss delta, tokens/s",
                       description="Generate a reply with the full-precision cache and with a quantized one; print "
                                   "the cache's bytes, the held-out loss delta and the decode speed.")
    d.add_argument("--model", default=None, help=MODEL_HELP)
    d.add_argument("--policy", type=_policy_arg, default=None,
                   help="SCHEME:BITS, e.g. kivi:4; schemes: " + ", ".join(SCHEMES) + " (default: kivi+rot+sink:4, "
                        "4-bit KIVI with 4 sink tokens and a Hadamard rotation)")
    d.add_argument("--prompt", default=DEMO_PROMPT, help="the user message (default: %(default)r)")
    d.add_argument("--max-new-tokens", type=_POSITIVE_INT, default=40,
                   help="tokens generated per reply (default: %(default)s)")
    d.add_argument("--capacity", type=_POSITIVE_INT, default=4096,
                   help="tokens the cache is allocated for; at least the prompt plus --max-new-tokens "
                        "(default: %(default)s)")
    d.add_argument("--loss-window", type=_number(int, "a whole number of tokens >= 2", 2), default=1024,
                   help="held-out window for the loss delta, in tokens (default: %(default)s)")
    # eager by default: Inductor's compile of SmolLM2 through the CPU attention template took over 3 minutes on
    # this (shared) 2-core machine, beyond the demo's budget; the FX pass and kvcompile's ops run either way.
    d.add_argument("--compiler", default="eager", choices=["inductor", "eager"],
                   help="what kvcompile.apply compiles the rest of the graph with (default: %(default)s)")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser(
        "eval", help="loss delta and passkey retrieval per scheme and bit width",
        description=f"Held-out loss delta of each scheme and width over full precision, and passkey retrieval. A bare "
                    f"`kvcompile eval` (every default scheme x width, then passkey for full, best:4 and best:2 at "
                    f"1K-8K, 20 trials each) takes about {EVAL_BARE_MINUTES} minutes on a 2-core CPU (the times "
                    f"measured for docs/eval.json); --entries, --passkey and --passkey-lengths choose less.")
    e.add_argument("--model", default=D["model"], help=MODEL_HELP)
    e.add_argument("--schemes", nargs="+", default=D["schemes"], choices=sorted(SCHEMES), metavar="SCHEME",
                   help=f"schemes to evaluate at each of --bits; one of {', '.join(sorted(SCHEMES))} "
                        f"(default: {' '.join(DEFAULT_SCHEMES)})")
    e.add_argument("--bits", nargs="+", type=int, default=D["bits"], choices=[2, 3, 4, 8], metavar="BITS",
                   help=f"widths to evaluate: 2, 3, 4 or 8 (default: {' '.join(map(str, DEFAULT_BITS))})")
    e.add_argument("--entries", nargs="+", default=D["entries"], metavar="SCHEME:BITS",
                   help="SCHEME:BITS pairs to evaluate instead of --schemes x --bits ('none': passkey only) "
                        "(default: none given, --schemes x --bits)")
    e.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="merge the eval.json files of earlier runs (no model is run) and write table + plot "
                        "(default: off, run the model)")
    e.add_argument("--window", type=_number(int, "a whole number of tokens >= 2", 2), default=D["window"],
                   help="tokens per held-out window; the second half is scored (default: %(default)s)")
    e.add_argument("--windows", type=_POSITIVE_INT, default=D["windows"],
                   help="held-out windows, evenly spaced over the text (default: %(default)s)")
    e.add_argument("--chunk", type=_POSITIVE_INT, default=D["chunk"],
                   help="tokens fed through the cache per call in the scored half (default: %(default)s)")
    e.add_argument("--own", choices=("full", "stored"), default=D["own"],
                   help="how each call of the held-out loss reads its own tokens' keys and values: full (in full "
                        "precision, as kvcompile's generate and serving do) or stored (as stored, like every "
                        "earlier position: what kvcompile inside vLLM computes, sliding-window layers stored too; "
                        "a policy with a window or KIVI's key groups is then fed one token a call, about 20x slower) "
                        "(default: %(default)s)")
    e.add_argument("--passkey", nargs="*", default=D["passkey"], metavar="ENTRY",
                   help='passkey entries: "full", SCHEME:BITS, a policy file, or best:BITS (the SCHEME:BITS of that '
                        'width with the lowest loss delta); none after --passkey: no passkey (default: full, and '
                        'best:4 and best:2 where the run evaluates that width)')
    e.add_argument("--passkey-lengths", nargs="+", type=_POSITIVE_INT, default=D["passkey_lengths"], metavar="N",
                   help="passkey context lengths in tokens (default: 1024 2048 4096 8192)")
    e.add_argument("--passkey-chunk", type=_POSITIVE_INT, default=D["passkey_chunk"],
                   help="passkey prompts are prefilled through the cache in aligned chunks of this many tokens "
                        "(one call up to 2K, like generate); the answer is then decoded token by token "
                        "(default: %(default)s)")
    e.add_argument("--trials", type=_POSITIVE_INT, default=D["trials"],
                   help="random passkeys and depths per length (default: %(default)s)")
    e.add_argument("--seed", type=_NONNEG_INT, default=D["seed"], help="passkey trials' seed (default: %(default)s)")
    e.add_argument("--out", default="results", help="directory for eval.json and eval.png (default: %(default)s)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars (default: shown)")
    e.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plan", help="concurrent sequences per GPU, or the serving pool, for each policy",
                        description="Concurrent sequences per GPU for each policy, from the exact cache layout; with "
                                    "--serving, the pool kvcompile serve allocates for one byte budget against "
                                    "transformers' own paged cache.")
    pl.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help=f"the model: {', '.join(sorted(PRESETS))} (default: {PLAN_PRESET}; with --serving, "
                         f"{PLAN_SERVING_PRESET})")
    pl.add_argument("--config", default=None,
                    help="a local Hugging Face config.json or model folder instead of --preset; nothing is "
                         "downloaded (default: none, use --preset)")
    pl.add_argument("--weights-gb", type=_NONNEG_GB, default=None,
                    help="the weights' size in GB (default: the preset's, or the size of the --config folder's "
                         "*.safetensors / *.bin files)")
    pl.add_argument("--gpu-gb", type=_POSITIVE_GB, default=None,
                    help=f"the GPU's memory in GB (default: {PLAN_GPU_GB:g})")
    pl.add_argument("--utilization", type=_FRACTION, default=None,
                    help=f"the fraction of the GPU's memory used (default: {PLAN_UTILIZATION})")
    pl.add_argument("--available-gb", type=_POSITIVE_GB, default=None,
                    help="memory for the cache in GB, instead of --gpu-gb x --utilization - weights "
                         "(default: none, computed)")
    pl.add_argument("--gib", action="store_true",
                    help="read --gpu-gb/--available-gb as GiB (2**30) (default: GB, 10**9)")
    pl.add_argument("--tp", type=_POSITIVE_INT, default=1,
                    help="GPUs the model is sharded over by tensor parallelism (torchrun, tp_plan='auto'): plan "
                         "one GPU, with its share of the KV heads and of the weights; --gpu-gb and --available-gb "
                         "(with --serving, --budget-mib) are per GPU (default: %(default)s)")
    pl.add_argument("--context", "--request-tokens", dest="context", type=_POSITIVE_INT, default=8192,
                    help="tokens per sequence (with --serving: per request) (default: %(default)s)")
    pl.add_argument("--serving", action="store_true",
                    help="plan the continuous-batching cache kvcompile serve allocates for one byte budget "
                         "(--budget-mib): its pool blocks, tokens, request slots and concurrent requests of "
                         "--request-tokens tokens under each policy, against transformers' own paged cache for the "
                         f"same budget; the model defaults to --preset {PLAN_SERVING_PRESET} (default: off, plan "
                         f"sequences per GPU)")
    pl.add_argument("--budget-mib", type=_POSITIVE_INT, default=None,
                    help="with --serving: bytes of the whole serving cache in MiB, as kvcompile serve --budget-mib "
                         f"(default: {PLAN_SERVING_BUDGET_MIB}, or --available-gb / --gpu-gb x --utilization - "
                         f"weights where given)")
    pl.add_argument("--max-requests", type=_POSITIVE_INT, default=None,
                    help="with --serving: request slots, as kvcompile serve --max-requests (default: the most "
                         "requests of --request-tokens tokens the budget holds)")
    pl.add_argument("--dtype", default=None, choices=sorted(PLAN_DTYPES),
                    help="with --serving: the model's dtype, which full-precision pages, rings and sinks are "
                         "stored in (default: bfloat16; kvcompile serve on the CPU loads float32)")
    pl.add_argument("--page-size", type=_POSITIVE_INT, default=None,
                    help="with --serving: tokens per page of transformers' own paged cache (kvcompile's pages are "
                         "its blocks) (default: 256, transformers' default)")
    pl.add_argument("--shared-tokens", type=_POSITIVE_INT, default=None,
                    help="with --serving: every request begins with the same prompt of this many tokens (a system "
                         "prompt), whose whole pages are held once where pages are shared (default: none)")
    pl.add_argument("--max-batch-tokens", type=_POSITIVE_INT, default=None,
                    help="with --serving: tokens a forward takes, as kvcompile serve --max-batch-tokens: under a "
                         "quantized policy a shared prompt is read from shared pages in whole pieces of this many "
                         f"tokens (default: {MAX_BATCH_TOKENS})")
    pl.add_argument("--plot", default=None,
                    help="write a PNG of sequences vs context here (with --serving: requests held vs tokens per "
                         "request, and over transformers' own) (default: none)")
    pl.add_argument("--json", default=None, help="write the table as JSON here (default: none)")
    pl.add_argument("--policy", nargs="+", type=_labelled_policy, default=None, metavar="POLICY",
                    help="more rows: SCHEME:BITS (e.g. kivi+rot+sink:3) or a policy file (*.json, from kvcompile "
                         "calibrate or Policy.save) (default: none, the standard rows only)")
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser(
        "calibrate", help="per-layer bits for a byte budget, saved as a policy file",
        description="Measure each layer's sensitivity (keys and values apart) to each candidate format on "
                    "calibration text, then choose per layer the formats that lose the least within a byte budget "
                    "(a knapsack over exact bytes). SmolLM2 with the default candidates at --tokens 2048: 421 "
                    "passes over the calibration windows, about 70 minutes on one thread of this project's shared "
                    "2-core CPU (59 minutes measured for 361 passes, before int2 in groups of 64 was added).")
    c.add_argument("--budget", type=_number(float, "a positive number of bits", 0, low_open=True), default=None,
                   help="bits of a uniform cache: the bytes a uniform cache of that many bits in the candidates' "
                        "layout holds at --context tokens (3: the bytes of kivi+rot+sink:3 with the default "
                        "candidates; 2.5: halfway between the 2- and 3-bit caches') (default: none; give one budget)")
    c.add_argument("--bits-per-element", type=_number(float, "a positive number of bits", 0, low_open=True),
                   default=None, help="the budget in average bits per cached element, everything the store holds "
                                      "counted (codes, scales, zero points, residual and sinks) at --context tokens "
                                      "(default: none)")
    c.add_argument("--bytes-per-token", type=_number(float, "a positive number of bytes", 0, low_open=True),
                   default=None, help="the budget in exact bytes per cached token at --context (default: none)")
    c.add_argument("--bytes-of", type=_budget_of, default=None, metavar="SCHEME:BITS",
                   help="the budget: the exact bytes per token of this uniform policy, e.g. kivi+rot+sink:3 "
                        "(default: none)")
    c.add_argument("--model", default=None, help=MODEL_HELP)
    c.add_argument("--tokens", type=_number(int, "a whole number of tokens >= 2", 2), default=None,
                   help="calibration tokens (standard-library docstrings, not the eval's held-out text), in "
                        f"windows of --window; the second half of each is scored (default: {CAL.TOKENS})")
    c.add_argument("--window", type=_number(int, "a whole number of tokens >= 2", 2), default=None,
                   help=f"tokens per calibration window (default: {CAL.WINDOW})")
    c.add_argument("--context", type=_POSITIVE_INT, default=2048,
                   help="tokens per sequence at which the budget's bytes are counted (the residual and sinks are "
                        "spread over them) (default: %(default)s, the eval's window)")
    c.add_argument("--candidates", nargs="+", type=_labelled_policy, default=None, metavar="POLICY",
                   help="per-layer candidates from the least to the most accurate, sharing residual, sinks and "
                        "rotation: SCHEME:BITS or policy files (*.json) (default: KIVI + rotation + 4 sinks: "
                        "int2, int3 and int4 in groups of 64, then 32; int8)")
    c.add_argument("--save-sensitivity", default=None, metavar="FILE",
                   help="also write the measured sensitivities (JSON), so that other budgets need no new "
                        "measurement (default: not written)")
    c.add_argument("--sensitivity", default=None, metavar="FILE",
                   help="allocate from sensitivities written by an earlier --save-sensitivity (same model) "
                        "instead of measuring: seconds instead of an hour (default: measure)")
    c.add_argument("--out", required=True, help="the policy file to write (JSON, read by Policy.load)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    c.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("serve", help="OpenAI-compatible server: continuous batching over the quantized cache",
                       description="transformers' OpenAI-compatible server (chat completions, completions and "
                                   "responses, streaming and not) with its continuous batching over kvcompile's "
                                   "cache. Under torchrun with N processes the model is sharded over them "
                                   "(tp_plan='auto'; rank 0 serves HTTP, --budget-mib is per rank).")
    s.add_argument("--model", default=None, help=MODEL_HELP)
    s.add_argument("--policy", type=_policy_arg, default=None,
                   help="SCHEME:BITS, e.g. kivi:4 (or kivi4; int8, fp8 and full as they are), or a policy "
                        "file. For the most requests per byte: "
                        "tok+rot:4 (no full-precision window per request: 1.5x kivi+rot+sink:4's requests at "
                        "eleven times its loss delta, +0.012 nats/token on SmolLM2) or tok+rot+sym:8 "
                        "(kvcompile plan --serving compares them) (default: kivi+rot+sink:4, the best 4-bit "
                        "quality)")
    s.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                   help="names clients may give as the request's model, the first listed by /v1/models (default: "
                        "the model's directory; its last part, e.g. SmolLM2-135M-Instruct, is taken too)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=_number(int, "a port number from 1 to 65535", 1, high=65535), default=8000,
                   help="port (default: %(default)s)")
    s.add_argument("--budget-mib", type=_POSITIVE_INT, default=256,
                   help="bytes of the whole KV cache, in MiB: pool, rings, tables (default: %(default)s)")
    sizing = s.add_mutually_exclusive_group()
    sizing.add_argument("--max-requests", type=_POSITIVE_INT, default=None,
                        help="requests holding cache at once (default: 32, fewer where their full-precision "
                             "windows would take over a quarter of the budget; see --request-tokens)")
    sizing.add_argument("--request-tokens", type=_POSITIVE_INT, default=None,
                        help="size the request slots for requests of this many tokens (prompt and reply): as many "
                             "as the budget holds at once, as kvcompile plan --serving --request-tokens counts them "
                             "(default: off, see --max-requests)")
    s.add_argument("--max-batch-tokens", type=_POSITIVE_INT, default=MAX_BATCH_TOKENS,
                   help="tokens one forward of the engine takes: decoding requests' next tokens and pieces of "
                        "prompts being prefilled; under a quantized policy prompts are cut into pieces of this "
                        "many tokens, and share pages in whole pieces (default: %(default)s; larger on a GPU)")
    s.add_argument("--cpu-offload-mib", type=_NONNEG_INT, default=0,
                   help="host memory, in MiB, for the caches of requests evicted when the pages run out: kept "
                        "packed as they were and copied back when the request is scheduled again; per rank under "
                        "torchrun (default: %(default)s: an evicted request is prefilled again)")
    s.add_argument("--shutdown-grace", type=_number(float, "a number of seconds >= 0", 0), default=SHUTDOWN_GRACE_S,
                   metavar="SECONDS",
                   help="on SIGTERM or SIGINT the server stops accepting connections and gives the requests in flight "
                        "this long to finish, then ends those still running (a stream with an error event, a reply "
                        "with a 503) and exits 0; a second signal ends them at once (default: %(default)g)")
    s.add_argument("--no-prefix-sharing", action="store_true",
                   help="give every request its own pages even where prompts begin alike (default: shared, for "
                        "policies whose pages hold all their tokens: no full-precision window, no sinks)")
    s.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    from .models import resolve
    from .openai_server import run  # run checks the transformers release before loading the model or listening

    policy = args.policy or default_policy()
    path = resolve(args.model)
    _tokenizer(args.model, path)  # the server's requests need one: a folder without it is said now
    run(str(path), policy, host=args.host, port=args.port, budget=args.budget_mib * 2**20,
        max_requests=args.max_requests, request_tokens=args.request_tokens,
        max_batch_tokens=args.max_batch_tokens, prefix_sharing=not args.no_prefix_sharing,
        served_names=args.served_model_name, offload=args.cpu_offload_mib * 2**20, grace_s=args.shutdown_grace)
    return 0


def main(argv=None) -> int:
    """Run a subcommand. A user's mistake is one line on stderr and exit status 2; a bug keeps its traceback."""
    from .models import ModelNotFound
    from .errors import KVCompileError
    from .plan import PlanError
    from .policy import PolicyError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    # what the user gave cannot be done: a missing model, a policy or plan that does not fit, a model the pass
    # cannot rewrite (each message says what was found and what to do)
    except (UsageError, ModelNotFound, PlanError, PolicyError, KVCompileError) as e:
        print(f"kvcompile {args.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
