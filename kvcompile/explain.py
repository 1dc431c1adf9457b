"""``kvcompile.explain(model)``: every cache site the pass finds, its policy and bytes, and what it left alone.

    print(kvcompile.explain(model))            # an applied model: the graphs compiled so far, or a short trace
    print(kvcompile.explain(model, idx, pos))  # any model: traced with these inputs (nothing runs)
"""
from __future__ import annotations

import torch

from .backend import Analyzed, Options, carried, compile_graph
from .errors import ArgumentTypeError, UnsupportedError
from .hf_model import is_hf, trace_inputs
from .policy import Policy
from .report import Explanation, SiteReport  # noqa: F401  (the report's classes, where users found them)


def explain(model, *args, policy: Policy | None = None, **kwargs) -> Explanation:
    """Every cache site the pass finds in ``model`` -- layer, write node, read node, resolved policy, bytes
    per token -- and what it could not rewrite, with the reason.

    With example inputs (``explain(model, idx, input_pos)``) the model is traced for the purpose (nothing
    runs); without, an applied model reports the graphs compiled so far, and an applied transformers model
    is traced with a two-token prompt.
    """
    applied = getattr(model, "_kvcompile", None)
    pol = policy or (applied.policy if applied is not None else None)
    if not args and not kwargs:
        if applied is not None and applied.reports:
            return _merge(applied.reports)
        if applied is not None and is_hf(model):
            fn, kwargs = trace_inputs(model, applied)
            return _trace(fn, (), kwargs, pol)
        raise ArgumentTypeError("kvcompile.explain(model, *example_inputs): pass example inputs to trace this model")
    fn = model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    if is_hf(fn) and applied is not None:
        fn = type(fn).forward.__get__(fn)
    return _trace(fn, args, kwargs, pol)


def _trace(fn, args, kwargs, policy) -> Explanation:
    opts = Options(policy, "eager")

    def backend(gm, example_inputs):
        return compile_graph(gm, example_inputs, opts, analyze_only=True)

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    try:
        with torch.no_grad():
            compiled(*args, **kwargs)
    except Exception as e:  # Dynamo wraps what the backend raises
        cur = e
        while cur is not None:
            if isinstance(cur, Analyzed):
                return cur.report
            cur = cur.__cause__ or cur.__context__
        inner = carried(e)
        if inner is None:
            raise
        raise inner from e
    raise UnsupportedError("explain: the traced call did not reach the kvcompile backend")


def _merge(reports: list[Explanation]) -> Explanation:
    out = Explanation()
    seen = set()
    for r in reports:
        for s in r.sites:
            if (s.layer, s.read) not in seen:
                seen.add((s.layer, s.read))
                out.sites.append(s)
        out.skipped += [k for k in r.skipped if k not in out.skipped]
        out.notes += [n for n in r.notes if n not in out.notes]
    return out
