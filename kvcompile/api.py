"""What a user calls: ``kvcompile.apply(model, policy)`` (and ``kvcompile.nbytes``).

    model = kvcompile.apply(model, Policy.kivi(4))            # a transformers model, or a gpt-fast-style module
    model.generate(input_ids)                                  # every generation mode, a packed cache

How the pieces fit (each has its module):

- ``kvcompile.store``: the paged store of one layer (layout, block manager, reference numerics);
- ``kvcompile.standin``: the few-KB tensors that stand in for cache tensors, and the registry that maps each
  to its store;
- ``kvcompile.passes``: the FX pass that rewrites cache writes and SDPA reads into ``kvcompile.ops``;
- ``kvcompile.backend``: the ``"kvcompile"`` torch.compile backend that runs the pass;
- ``kvcompile.hf`` (the cache) and ``kvcompile.hf_model`` (applying to a model): transformers;
- ``kvcompile.modules``: plain modules with cache buffers (gpt-fast);
- ``kvcompile.explain``: the report of what the pass found.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from . import standin
from .backend import COMPILERS, Options, compile_graph, unwrapped
from .errors import ArgumentError, ArgumentTypeError, UnsupportedError
from .hf import KVCompileCache
from .hf_model import apply_hf, is_hf, layer_names, opaque
from .modules import apply_module, stores
from .policy import Policy, PolicyError
from .tp import agreed

# Graphs Dynamo may keep per code object, and in all. Every applied model of one class shares its forward's
# code object; each batch size and dtype is a prefill graph and a decode graph of its own (new lengths are
# not: they are dynamic), and benchmarks apply several policies in one process. Each graph costs a compile,
# not memory to speak of; with fullgraph=True, hitting the limit is a hard failure.
RECOMPILE_LIMIT = 1024
ACCUMULATED_RECOMPILE_LIMIT = 8192


@dataclass
class Applied:
    """What ``apply`` did to a model (``model._kvcompile``): its policy, compiler, cache limit, the
    attention layers' names, and the pass's report of each graph compiled so far (``kvcompile.explain``)."""

    policy: Policy
    compiler: str
    max_cache_len: int | None
    layer_names: list[str]
    reports: list = field(default_factory=list)
    sharding: object = None  # kvcompile.tp.Sharding of a tensor-parallel model (this rank's group and KV heads)
    settings: dict = field(default_factory=dict)  # apply's keyword arguments as given (pickling applies them again)
    added: frozenset = frozenset()  # the model's attributes apply set, and ...
    replaced: dict = field(default_factory=dict)  # ... what those it replaced were before (``reduce_applied``)
    kv_heads: int | None = None  # the KV heads this rank caches per layer (a transformers model's; set by apply)


def _raise_recompile_limit() -> None:
    """Raise Dynamo's recompile limits to kvcompile's (never lower them). Process-wide, once per apply."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)
    if getattr(cfg, "accumulated_recompile_limit", ACCUMULATED_RECOMPILE_LIMIT) < ACCUMULATED_RECOMPILE_LIMIT:
        cfg.accumulated_recompile_limit = ACCUMULATED_RECOMPILE_LIMIT


def _check_applicable(model, policy, max_cache_len, compiler, prefill="auto") -> None:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"kvcompile.apply(model, policy): model={type(model).__name__} is not a torch.nn.Module")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or getattr(model, "_compiled_call_impl", None):
        raise UnsupportedError(
            "kvcompile.apply got a model that is already compiled (torch.compile / module.compile()); apply "
            "kvcompile to the original module, then compile nothing else: apply compiles it through the kvcompile "
            "backend. Or use torch.compile(model, backend='kvcompile', options={'policy': ...}) directly.")
    if getattr(model, "_kvcompile", None) is not None:
        raise UnsupportedError(
            f"kvcompile.apply was already applied to this model (policy {model._kvcompile.policy}); applying twice "
            f"would quantize an already-quantized cache. Apply once, to the original model.")
    if not isinstance(policy, Policy):
        raise PolicyError(f"kvcompile.apply(model, policy): policy={policy!r} is not valid: expected a "
                          f"kvcompile.Policy (e.g. Policy.kivi(4))")
    if max_cache_len is not None and (not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool)
                                      or max_cache_len < 1):
        raise ArgumentError(f"kvcompile.apply(max_cache_len={max_cache_len!r}): expected a positive number of tokens "
                         f"(the most a sequence may hold), or None (the default) for caches that grow without limit")
    if compiler != "auto" and compiler not in COMPILERS:
        raise UnsupportedError(f"compiler={compiler!r} is not valid: expected 'auto' or one of {COMPILERS}")
    if prefill not in PREFILLS:
        raise UnsupportedError(f"prefill={prefill!r} is not valid: expected one of {PREFILLS}")


PREFILLS = ("auto", "eager", "compiled")


@agreed  # under tensor parallelism, an error on one rank is raised on every rank (kvcompile.tp)
def apply(model: nn.Module, policy: Policy, *, max_cache_len: int | None = None, compiler: str = "auto",
          dynamic: bool | None = None, prefill: str = "auto") -> nn.Module:
    """Quantize ``model``'s KV cache per ``policy`` and route its attention through kvcompile's ops.

    Hugging Face transformers models (``PreTrainedModel``, loaded with ``attn_implementation="sdpa"``): returns
    the same model. ``generate`` (every mode) and ``forward`` with ``use_cache`` create a ``KVCompileCache``
    when the caller passes none; it grows with the conversation (pass it back to continue a chat), and is
    cropped, forked and reordered as generate needs. ``max_cache_len``: the most tokens a sequence may hold
    (``CapacityError`` beyond); None, the default, for no limit but memory.

    Other modules (gpt-fast style): each submodule holding a pair of same-shape 4-D cache buffers gets
    stand-ins and packed stores now (``kvcompile.modules``); returns ``torch.compile(model,
    backend=<kvcompile>, fullgraph=True)``. Either way the applied forward is compiled already: a torch.compile
    around it leaves it as it is (``hf_model.OUTER_COMPILE``).

    compiler: "inductor" compiles the rest of the graph with Inductor; "eager" runs it as traced; "auto" (the
    default) is "inductor" when the model's parameters are on a GPU, "eager" on the CPU, where kvcompile's
    own kernels do the cache work and Inductor's code generation for a whole decoder takes minutes.
    dynamic: passed to ``torch.compile`` (None: kvcompile marks the sequence dimensions dynamic itself).
    prefill (transformers models): how a first prefill into an empty cache runs. It reads only its own tokens,
    in full precision, and stores them, so the cache's eager path computes the same thing: "eager" runs it
    without Dynamo (no trace to wait for before the first token); "compiled" through the compiled graph;
    "auto" (the default) is "eager" with compiler="eager" (whose graphs run as Python anyway) and "compiled"
    with Inductor. Decode steps and later chunks always run compiled: they read what the store holds.
    """
    _check_applicable(model, policy, max_cache_len, compiler, prefill)
    given_compiler = compiler
    if compiler == "auto":
        p = next(iter(model.parameters()), None)
        compiler = "inductor" if p is not None and p.device.type == "cuda" else "eager"
    _raise_recompile_limit()
    if is_hf(model):
        settings = dict(max_cache_len=max_cache_len, compiler=given_compiler, dynamic=dynamic, prefill=prefill)
        applied = Applied(policy, compiler, max_cache_len, layer_names(model), settings=settings)
        before = dict(model.__dict__)
        model._kvcompile = applied
        try:
            apply_hf(model, policy, max_cache_len, compiler, dynamic, applied, _backend_for(applied), prefill)
        except Exception:
            del model._kvcompile
            raise
        applied.added = frozenset(k for k, v in model.__dict__.items() if k not in before or v is not before[k])
        applied.replaced = {k: before[k] for k in applied.added if k in before}
        model.__reduce_ex__ = _reducer(model)
        return model
    if max_cache_len is not None:
        raise ArgumentError("kvcompile.apply(max_cache_len=...) is for transformers models; a module's caches are "
                         "limited by its own cache buffers' length")
    names = apply_module(model, policy)
    applied = Applied(policy, compiler, None, names, settings=dict(compiler=given_compiler, dynamic=dynamic),
                      added=frozenset({"_kvcompile"}))
    model._kvcompile = applied
    compiled = _opaque(torch.compile(model, backend=_backend_for(applied), fullgraph=True, dynamic=dynamic))
    compiled.__reduce_ex__ = _reducer(model)
    return compiled


# --------------------------------------------------------------------------- pickling an applied model
# An applied model's forward (and a transformers model's generation hooks) are closures over compiled code,
# which pickle cannot write. ``pickle``, ``torch.save``, ``copy.deepcopy`` and ``copy.copy`` of what apply
# returned write instead the unmodified model's state and apply's arguments, and loading applies kvcompile
# again: what comes back is an applied model with the same policy and settings (its graphs compile again on
# first use). A transformers model's caches are created per call, so none travels with it; a gpt-fast-style
# module's cache buffers come back empty (zeros, as its setup_caches leaves them): their tokens are not kept.
def _reducer(model):
    """The ``__reduce_ex__`` of what apply returned (an attribute of the instance, which pickle and copy read
    before the class's): rebuild the unmodified ``model`` from its state, then ``apply``. Holds the model weakly
    (no reference cycle through the instance's own attribute)."""
    ref = weakref.ref(model)

    def __reduce_ex__(protocol):
        m = ref()
        applied = m._kvcompile
        state = {k: v for k, v in m.__dict__.items() if k not in applied.added and k != "__reduce_ex__"}
        state.update(applied.replaced)
        return _restore_applied, (type(m), state, applied.policy, applied.settings)
    return __reduce_ex__


def _restore_applied(cls, state: dict, policy: Policy, settings: dict) -> nn.Module:
    """What ``_reducer`` wrote, loaded: the unmodified model (``nn.Module.__setstate__``; a module's cache stand-ins
    become zero buffers of their shape again), applied again."""
    from .hf_model import is_hf

    model = cls.__new__(cls)
    model.__setstate__(state)
    if not is_hf(model):
        for mod in model.modules():
            for name, buf in list(mod.named_buffers(recurse=False)):
                if standin.is_standin(buf):
                    setattr(mod, name, torch.zeros(buf.shape, dtype=buf.dtype, device=buf.device))
    return apply(model, policy, **settings)


def _opaque(compiled: nn.Module) -> nn.Module:
    """``compiled`` (an applied module), made opaque to a ``torch.compile`` around it: Dynamo would otherwise trace
    the module's own forward with the outer compile's backend, without kvcompile's pass, and its cache writes would
    go to the stand-ins. Its forward runs as kvcompile compiled it instead (``hf_model.opaque``)."""
    inner = compiled.forward

    @opaque  # (around a function of its own: disabling ``inner`` itself would unwrap it to the module's forward)
    def run(*args, **kwargs):
        with unwrapped():
            return inner(*args, **kwargs)

    def forward(*args, **kwargs):
        return run(*args, **kwargs)

    compiled.forward = run  # a compiled module calling this one: Dynamo leaves a disabled forward alone
    compiled._torchdynamo_orig_callable = forward  # what torch.compile(compiled) compiles (not the module's own)
    return compiled


def _backend_for(applied: Applied):
    opts = Options(applied.policy, applied.compiler)

    def backend(gm, example_inputs):
        return compile_graph(gm, example_inputs, opts, report=applied.reports.append)

    return backend


def nbytes(obj) -> int:
    """Bytes the kvcompile caches of ``obj`` hold: a ``KVCompileCache`` (what ``generate`` or ``forward``
    returned), or a module ``apply`` prepared (its stores: blocks in use, windows, sinks, tables)."""
    if isinstance(obj, KVCompileCache):
        return obj.nbytes
    if isinstance(obj, torch._dynamo.eval_frame.OptimizedModule):
        obj = obj._orig_mod
    if isinstance(obj, nn.Module):
        found = stores(obj)
        if found:
            return sum(s.nbytes for s in found.values())
        if getattr(obj, "_kvcompile", None) is not None:
            raise ArgumentTypeError("this transformers model's caches are created per call: pass the cache generate or "
                            "forward returned (out.past_key_values / out.cache) to kvcompile.nbytes")
    raise ArgumentTypeError(f"kvcompile.nbytes: {type(obj).__name__} holds no kvcompile cache (pass a KVCompileCache, or a "
                    f"module prepared by kvcompile.apply)")
