"""What a user calls: ``kvcompile.apply(model, policy)``, the ``"kvcompile"`` torch.compile backend, ``explain``.

    model = kvcompile.apply(model, Policy.kivi(4))                   # HF model, gpt-fast-style module, ...
    compiled = torch.compile(model, backend="kvcompile", options={"policy": Policy.kivi(4)})
    print(kvcompile.explain(model))

How the pieces fit:

- ``apply`` swaps each cache tensor for a stand-in (a few KB, unit strides) (``kvcompile.standin``) and allocates the
  layer's packed ``KVState`` beside it, so no full-precision cache of full capacity exists. For Hugging Face
  models the caches are ``KVCompileCache`` objects (``kvcompile.hf``) that ``apply`` creates for ``forward``
  and ``generate`` whenever the caller passes none.
- The backend runs the FX pass (``kvcompile.passes``) on the Dynamo graph: each cache write becomes
  ``kvcompile.store`` and each SDPA read ``kvcompile.attention``, over new graph inputs that carry the
  packed state. At every call a thin wrapper maps the stand-ins Dynamo passes in (by identity) to their
  states, so a fresh cache of the same shapes reuses the compiled code and never reads a stale store.
- The rewritten graph goes to Inductor (``compiler="inductor"``) or runs as is (``compiler="eager"``: no code
  generation, seconds to compile). ``apply``'s default, ``"auto"``, is Inductor for a model on a GPU and eager
  on the CPU: there kvcompile's own kernels already do the cache work, and Inductor's code generation for a
  whole decoder takes minutes on a small CPU for little gain. The backend's default is Inductor.
- A cache the user allocated in full precision (an HF ``StaticCache`` under
  ``torch.compile(..., backend="kvcompile")``) gets a packed store keyed by that tensor: the results are the
  quantized ones, but the full tensor's memory is still held by its owner; ``explain`` says so.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from . import ops, standin
from .passes import KVCompileError, analyze, rewrite
from .passes.kv_cache import ALLOCATED_IN_GRAPH, Site, Skipped, _example
from .policy import Policy, PolicyError
from .store import DTYPE_NAMES, LayerSpec

COMPILERS = ("inductor", "eager")


# --------------------------------------------------------------------------- reports (explain)
@dataclass
class SiteReport:
    layer: str
    write: str
    read: str
    policy: str
    bytes_per_token: float       # this layer's store, everything included, spread over its capacity
    fp_bytes_per_token: int      # the same layer's full-precision cache
    gqa: int
    memory_saved: bool


@dataclass
class Explanation:
    sites: list[SiteReport] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"kvcompile: {len(self.sites)} cache site(s) rewritten, {len(self.skipped)} not rewritten"]
        if self.sites:
            lines.append(f"  {'layer':<28} {'write':<22} {'read':<18} {'B/token':>9} {'fp B/token':>10}  policy")
            for s in self.sites:
                lines.append(f"  {s.layer:<28} {s.write:<22} {s.read:<18} {s.bytes_per_token:>9.1f} "
                             f"{s.fp_bytes_per_token:>10d}  {s.policy}" + ("" if s.memory_saved else "  [!]"))
        for k in self.skipped:
            lines.append(f"  not rewritten: {k.layer} ({k.node}): {k.reason}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _report(sites: list[Site], specs: list[LayerSpec], owned: list[bool], skipped) -> Explanation:
    ex = Explanation(skipped=list(skipped))
    for s, spec, own in zip(sites, specs, owned):
        el = torch.empty((), dtype=spec.torch_dtype).element_size()
        write = f"{s.k_write.node.name} ({s.k_write.idiom})"
        ex.sites.append(SiteReport(s.layer, write, f"{s.read.name} (sdpa)", spec.policy.key_str(),
                                   spec.nbytes() / (spec.batch * spec.capacity), 2 * spec.heads * spec.head_dim * el,
                                   s.gqa, own))
    if not all(owned):
        ex.notes.append("[!] these caches were allocated in full precision by their owner (e.g. a transformers "
                        "StaticCache): kvcompile stores and reads them packed, but their full-precision memory is "
                        "still allocated. Use kvcompile.apply (or a KVCompileCache) to save it.")
    return ex


# --------------------------------------------------------------------------- the backend
@dataclass(frozen=True)
class Options:
    policy: Policy | None = None
    compiler: str = "inductor"

    @staticmethod
    def parse(options) -> "Options":
        options = dict(options or {})
        unknown = set(options) - {"policy", "compiler"}
        if unknown:
            raise KVCompileError(f"unknown kvcompile backend option(s) {sorted(unknown)}: expected 'policy' "
                                 f"(a kvcompile.Policy) and 'compiler' (one of {COMPILERS})")
        pol = options.get("policy")
        if pol is not None and not isinstance(pol, Policy):
            raise PolicyError(f"options['policy']={pol!r} is not valid: expected a kvcompile.Policy")
        comp = options.get("compiler", "inductor")
        if comp not in COMPILERS:
            raise KVCompileError(f"options['compiler']={comp!r} is not valid: expected one of {COMPILERS}")
        return Options(pol, comp)


class _Analyzed(Exception):
    """Raised by the analysis-only backend (explain) once it has its report: nothing is compiled or run."""

    def __init__(self, report):
        super().__init__("analysis done")
        self.report = report


def check_kernel_support(spec: LayerSpec, device: torch.device) -> None:
    """Fail at compile time, naming the layer's policy, if the kernels that will run cannot do this layout.

    The Triton launcher (``kvcompile.templates.launch``) defines ``check_supported(spec)``, which raises for
    layouts it does not implement; the pure-torch reference supports every layout.
    """
    if ops.kernels(device) != "triton":
        return
    try:
        launch = ops._triton()
    except ImportError as e:
        raise KVCompileError(f"kvcompile is set to run its Triton kernels, but they cannot be imported ({e}); "
                             f"use kvcompile.ops.set_kernels('reference')") from e
    check = getattr(launch, "check_supported", None)
    if check is not None:
        try:
            check(spec)
        except (NotImplementedError, ValueError, TypeError) as e:
            raise KVCompileError(f"the Triton kernels do not support the layout {spec.name}: {e}. Choose another "
                                 f"format for this layer (Policy.override) or run the reference "
                                 f"(kvcompile.ops.set_kernels('reference')).") from e


def _bind(gm, sites: list[Site], analysis, opts: Options, allocate: bool):
    """For each site: the LayerSpec and store behind its cache tensors (allocated for unregistered ones)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    policies = None
    specs, owned, k_index, v_index = [], [], [], []
    for s in sites:
        kt, vt = _example(s.k_cache), _example(s.v_cache)
        slot = standin.lookup(kt)
        if slot is None:
            if standin.is_standin(kt):
                raise KVCompileError(f"layer {s.layer}: the cache {s.k_cache.name} is a kvcompile stand-in whose "
                                     f"store is gone (was its cache deleted?)")
            if opts.policy is None:
                raise PolicyError(
                    f"torch.compile(..., backend='kvcompile') found the KV cache of {s.layer} but no policy: pass "
                    f"options={{'policy': kvcompile.Policy.kivi(4)}} (or any kvcompile.Policy)")
            if policies is None:
                opts.policy.check(s.shape[3])
                # resolved over every attention layer the graph reads, rewritten or not, so that an override by
                # index means the model's layer (sliding-window rings left to transformers are not sites)
                layers = analysis.layers
                if not set(layers) >= {x.layer for x in sites}:
                    layers = [x.layer for x in sites]
                policies = dict(zip(layers, opts.policy.resolve(layers)))
            B, H, C, D = s.shape
            spec = LayerSpec(policies[s.layer], B, H, C, D, _dtype_name(s.dtype, s.layer))
            if allocate:
                standin.register(kt, vt, spec, s.layer, owned=False)
            specs.append(spec)
            owned.append(False)
        else:
            vslot = standin.lookup(vt)
            if vslot is None or vslot.state is not slot.state or (slot.role, vslot.role) != ("k", "v"):
                raise KVCompileError(f"layer {s.layer}: SDPA reads keys and values from caches of different "
                                     f"kvcompile stores; the pass cannot pair this write with this read")
            specs.append(slot.spec)
            owned.append(slot.owned)
            s.layer = slot.layer or s.layer  # the name its policy was resolved by
        s.spec_name = specs[-1].register()
        check_kernel_support(specs[-1], kt.device)
        k_index.append(index[s.k_cache])
        v_index.append(index[s.v_cache])
    return specs, owned, k_index, v_index


def _dtype_name(dt: torch.dtype, layer: str) -> str:
    if dt not in DTYPE_NAMES:
        raise KVCompileError(f"layer {layer}: the cache dtype {dt} has no kvcompile kernel format; supported model "
                             f"dtypes are {sorted(DTYPE_NAMES.values())}")
    return DTYPE_NAMES[dt]


def _check_analysis(gm, analysis, example_inputs) -> None:
    """Turn what the pass could not do into errors when leaving it would be wrong or silently useless."""
    lazy = [k for k in analysis.skipped if k.reason.startswith(ALLOCATED_IN_GRAPH)]
    if lazy:
        raise KVCompileError(f"layer {lazy[0].layer}: {lazy[0].reason}")
    registered = [(i, n) for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                  if standin.lookup(_example(n)) is not None]
    covered = {c for s in analysis.sites for c in (s.k_cache, s.v_cache)}
    for _, n in registered:
        if n not in covered and n.users:
            why = [k.reason for k in analysis.skipped + analysis.unpaired_writes
                   if n.name in k.reason or _src_name(n) in k.reason]
            if analysis.reads_found == 0:
                raise KVCompileError(_no_read_message(gm, n))
            hint = (" This looks like a transformers sliding-window ring (it rolls its window) allocated before "
                    "kvcompile was imported, so kvcompile took it for a plain cache: import kvcompile before "
                    "creating the cache." if why and "(roll)" in why[0] else "")
            raise KVCompileError(f"the kvcompile cache {_src_name(n)} is used in the graph, but the pass cannot pair "
                                 f"its write with an attention read: {why[0] if why else 'no matching SDPA read'}.{hint}")
    if not analysis.sites and analysis.unpaired_writes:
        if analysis.reads_found == 0:
            raise KVCompileError(_no_read_message(gm, None, analysis.unpaired_writes))
        raise KVCompileError("a cache write the pass cannot pair with a read: "
                             + "; ".join(f"{k.node}: {k.reason}" for k in analysis.unpaired_writes)
                             + (" | SDPA reads: " + "; ".join(k.reason for k in analysis.skipped)
                                if analysis.skipped else ""))


def _src_name(n) -> str:
    ga = n.meta.get("grapharg")
    return ga.source.name if ga is not None else n.name


def _no_read_message(gm, cache_node, unpaired=()) -> str:
    ops_seen = sorted({str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_method")} & {"matmul", "bmm", "softmax", "baddbmm", "einsum",
                                                                        "__matmul__", "flex_attention"})
    what = _src_name(cache_node) if cache_node is not None else ", ".join(k.node for k in unpaired)
    return (f"no scaled_dot_product_attention read found for the KV cache ({what}); the graph computes attention "
            f"with {', '.join(ops_seen) or 'no attention op kvcompile knows'} instead. kvcompile rewrites caches "
            f"read by torch.nn.functional.scaled_dot_product_attention; for transformers models load them with "
            f"attn_implementation='sdpa'.")


def compile_graph(gm, example_inputs, options=None, *, report=None, analyze_only=False):
    """The backend: rewrite cache sites in the Dynamo graph ``gm``, then compile the rest.

    Returns a callable taking Dynamo's inputs; it appends each site's packed state (looked up from the
    stand-in it receives) as the extra inputs of the rewritten graph.
    """
    opts = options if isinstance(options, Options) else Options.parse(options)
    gm = _own_copy(gm)  # Dynamo still reads its graph (placeholders, graphargs) after the backend returns
    analysis = analyze(gm, left=lambda ph: standin.left(_example(ph)))
    _check_analysis(gm, analysis, example_inputs)
    sites = analysis.sites
    specs, owned, k_index, v_index = _bind(gm, sites, analysis, opts, allocate=not analyze_only)
    ex = _report(sites, specs, owned, analysis.skipped + analysis.unpaired_writes)
    if analyze_only:
        raise _Analyzed(ex)
    if report is not None:
        report(ex)
    if not sites:
        return _finish(gm, list(example_inputs), opts)
    rewrite(gm, sites, fused_cpu=opts.compiler == "inductor")
    bound = [(i, j, spec, s.layer) for i, j, spec, s in zip(k_index, v_index, specs, sites)]
    states = [_state_for(example_inputs[i], example_inputs[j], spec, layer) for i, j, spec, layer in bound]
    inner = _finish(gm, list(example_inputs) + [t for st in states for t in st], opts)

    def run(*args):
        extra = []
        for i, j, spec, layer in bound:
            extra.extend(_state_for(args[i], args[j], spec, layer))
        return inner(*args, *extra)

    run._kvcompile_sites = sites
    return run


def _own_copy(gm):
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return torch.fx.GraphModule(gm, g)


def _state_for(k, v, spec: LayerSpec, layer: str):
    slot = standin.lookup(k)
    if slot is None:
        # A fresh full-precision cache (e.g. a new StaticCache) of the shapes this graph was compiled for.
        return standin.register(k, v, spec, layer, owned=False)
    if slot.spec.name != spec.name:
        raise KVCompileError(
            f"layer {layer}: this graph was compiled for the store layout {spec.name} but the cache passed in "
            f"holds {slot.spec.name}. Use caches of the policy the model was compiled with (or "
            f"torch._dynamo.reset() before compiling for another).")
    return slot.state


def _finish(gm, example_inputs, opts: Options):
    if opts.compiler == "eager":  # the graph runs as Python: call kvcompile's functions, not through the dispatcher
        plain = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops.PLAIN]
        for n in plain:
            n.target = ops.PLAIN[n.target]
        if plain:
            gm.recompile()
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)  # called like Dynamo calls a backend's result: compiled(*args)


@torch._dynamo.register_backend(name="kvcompile")
def kvcompile_backend(gm, example_inputs, options=None, mode=None):
    """``torch.compile(model, backend="kvcompile", options={"policy": p, "compiler": "inductor"|"eager"})``."""
    return compile_graph(gm, example_inputs, options)


# --------------------------------------------------------------------------- apply
@dataclass
class Applied:
    policy: Policy
    compiler: str
    max_cache_len: int | None
    layer_names: list[str]
    reports: list[Explanation] = field(default_factory=list)
    caches: list[tuple[str, str]] = field(default_factory=list)  # generic modules: (module path, buffer pair)


def _is_hf(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _check_applicable(model, policy) -> None:
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or getattr(model, "_compiled_call_impl", None):
        raise KVCompileError(
            "kvcompile.apply got a model that is already compiled (torch.compile / module.compile()); apply "
            "kvcompile to the original module, then compile nothing else: apply compiles it through the kvcompile "
            "backend. Or use torch.compile(model, backend='kvcompile', options={'policy': ...}) directly.")
    if getattr(model, "_kvcompile", None) is not None:
        raise KVCompileError(
            f"kvcompile.apply was already applied to this model (policy {model._kvcompile.policy}); applying twice "
            f"would quantize an already-quantized cache. Apply once, to the original model.")
    if not isinstance(policy, Policy):
        raise PolicyError(f"kvcompile.apply(model, policy): policy={policy!r} is not valid: expected a "
                          f"kvcompile.Policy (e.g. Policy.kivi(4))")


def apply(model: nn.Module, policy: Policy, *, max_cache_len: int | None = None, compiler: str = "auto",
          dynamic: bool | None = None) -> nn.Module:
    """Quantize ``model``'s KV cache per ``policy`` and route its attention through kvcompile's ops.

    Hugging Face transformers models (``PreTrainedModel``): returns the same model; ``forward`` with
    ``use_cache=True`` and ``generate`` create a ``KVCompileCache`` when the caller passes no cache
    (``max_cache_len`` tokens for a forward, default ``config.max_position_embeddings``; prompt + new tokens
    for ``generate``), and ``forward`` runs compiled through the kvcompile backend.

    Other modules (gpt-fast style): each submodule holding a pair of same-shape 4-D cache buffers
    (``k_cache``/``v_cache``, ``cache_k``/``cache_v``, ``key_cache``/``value_cache``) gets stand-ins and packed
    stores now; returns ``torch.compile(model, backend=<kvcompile>, fullgraph=True)``.

    compiler: "inductor" compiles the rest of the graph with Inductor; "eager" runs it as traced; "auto" (the
    default) is "inductor" when the model's parameters are on a GPU, "eager" on the CPU.
    """
    _check_applicable(model, policy)
    if compiler == "auto":
        p = next(iter(model.parameters()), None)
        compiler = "inductor" if p is not None and p.device.type == "cuda" else "eager"
    if compiler not in COMPILERS:
        raise KVCompileError(f"compiler={compiler!r} is not valid: expected 'auto' or one of {COMPILERS}")
    if _is_hf(model):
        return _apply_hf(model, policy, max_cache_len, compiler, dynamic)
    return _apply_module(model, policy, compiler, dynamic)


def _backend_for(applied: Applied):
    opts = Options(applied.policy, applied.compiler)

    def backend(gm, example_inputs):
        return compile_graph(gm, example_inputs, opts, report=applied.reports.append)

    return backend


# ---- generic modules
_CACHE_PAIRS = (("k_cache", "v_cache"), ("cache_k", "cache_v"), ("key_cache", "value_cache"), ("k", "v"),
                ("keys", "values"))


def find_cache_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str, str]]:
    """(module path, module, key buffer name, value buffer name) for each module holding a KV cache pair."""
    found = []
    for path, mod in model.named_modules():
        bufs = dict(mod.named_buffers(recurse=False))
        for kn, vn in _CACHE_PAIRS:
            k, v = bufs.get(kn), bufs.get(vn)
            if k is not None and v is not None and k.dim() == 4 and k.shape == v.shape and k.is_floating_point():
                found.append((path, mod, kn, vn))
                break
    return found


def _apply_module(model, policy, compiler, dynamic):
    _raise_recompile_limit()
    found = find_cache_buffers(model)
    if not found:
        raise KVCompileError(
            "kvcompile.apply found no KV cache in this module: it looks for submodules with two same-shape 4-D "
            f"buffers named {', '.join('/'.join(p) for p in _CACHE_PAIRS)} (allocate the caches first, e.g. "
            "model.setup_caches(...)). Or compile with torch.compile(model, backend='kvcompile', "
            "options={'policy': ...}), which finds caches in the traced graph.")
    names = [p for p, *_ in found]
    head_dim = getattr(found[0][1], found[0][2]).shape[-1]
    policy.check(head_dim)
    policies = policy.resolve(names)
    applied = Applied(policy, compiler, None, names)
    for (path, mod, kn, vn), pol in zip(found, policies):
        k = getattr(mod, kn)
        B, H, C, D = k.shape
        spec = LayerSpec(pol, B, H, C, D, _dtype_name(k.dtype, path))
        check_kernel_support(spec, k.device)
        ks = standin.make_standin(k.shape, k.dtype, k.device)
        vs = standin.make_standin(k.shape, k.dtype, k.device)
        setattr(mod, kn, ks)  # re-registers the buffer: the full tensor is released here
        setattr(mod, vn, vs)
        standin.register(ks, vs, spec, path, owned=True)
        applied.caches.append((path, f"{kn}/{vn}"))
    model._kvcompile = applied
    return torch.compile(model, backend=_backend_for(applied), fullgraph=True, dynamic=dynamic)


def reset(model: nn.Module) -> None:
    """Empty every packed store of an applied generic module (a new sequence starts at position 0 anyway)."""
    for path, mod in model.named_modules():
        for kn, vn in _CACHE_PAIRS:
            slot = standin.lookup(getattr(mod, kn, None)) if isinstance(getattr(mod, kn, None), torch.Tensor) else None
            if slot is not None:
                for t in slot.state:
                    t.zero_()


# ---- Hugging Face
def _hf_layer_names(model) -> list[str]:
    from .hf import model_shape

    n_layers = model_shape(model.config)[0]
    names = [(m.layer_idx, p) for p, m in model.named_modules()
             if isinstance(getattr(m, "layer_idx", None), int) and "attention" in type(m).__name__.lower()]
    names = [p for _, p in sorted(names)]
    return names if len(names) == n_layers else [f"model.layers.{i}.self_attn" for i in range(n_layers)]


def _cache_kwarg(model) -> str:
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CAPACITY_BUCKET = 256  # generate() sizes caches in multiples of this many tokens
# Graphs Dynamo may keep per code object, and in all. Every applied model of one class shares its forward's
# code object, and each (batch size, cache capacity) is a prefill graph and a decode graph of its own: four
# policies over eight shapes in one process (benchmarks/cpu_decode.py) went past 64, and with fullgraph=True
# that is a hard failure. Each graph costs a compile, not memory to speak of.
RECOMPILE_LIMIT = 1024
ACCUMULATED_RECOMPILE_LIMIT = 8192


def _raise_recompile_limit() -> None:
    """Raise Dynamo's recompile limits to kvcompile's (never lower them). Process-wide, once per apply."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)
    if getattr(cfg, "accumulated_recompile_limit", ACCUMULATED_RECOMPILE_LIMIT) < ACCUMULATED_RECOMPILE_LIMIT:
        cfg.accumulated_recompile_limit = ACCUMULATED_RECOMPILE_LIMIT


# what Dynamo raises when fullgraph=True meets the recompile limit (the older name before torch 2.6)
_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None) or getattr(
    torch._dynamo.exc, "FailOnCacheLimitHit", ())


def _call_compiled(compiled, what: str, *args, **kwargs):
    """``compiled(*args, **kwargs)``, with Dynamo's recompile-limit failure turned into an error that says
    what happened and what to do."""
    try:
        return compiled(*args, **kwargs)
    except _LIMIT_HIT as e:
        cfg = torch._dynamo.config
        limit = getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", "?"))
        raise KVCompileError(
            f"{what}: this process has compiled as many graphs of it as Dynamo allows (recompile_limit={limit}; "
            "kvcompile compiles one prefill and one decode graph per batch size and cache capacity, shared by "
            "every model of the class), and fullgraph=True makes one more a hard failure. Use fewer distinct "
            "shapes (pad batches to a few sizes; give generate() or KVCompileCache one max_cache_len), raise "
            "torch._dynamo.config.recompile_limit, or call torch._dynamo.reset() to drop the compiled graphs."
        ) from e


def _apply_hf(model, policy, max_cache_len, compiler, dynamic):
    from .hf import KVCompileCache, _text_config, model_shape

    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None)
    text = _text_config(cfg)
    kinds = sorted(set(getattr(text, "layer_types", None) or []) - {"full_attention", "sliding_attention",
                                                                      "chunked_attention"})
    if getattr(model, "_is_stateful", False) or kinds:
        raise KVCompileError(
            f"unsupported model: {type(model).__name__} is a hybrid: besides attention it has "
            f"{', '.join(repr(k) for k in kinds) or 'recurrent'} layers, which keep a recurrent state (and a cache "
            f"class of their own) instead of keys and values. kvcompile quantizes attention KV caches and does "
            f"not support hybrid models yet.")
    if "reuse" in (getattr(text, "kv_sharing_modes", None) or []) or (getattr(text, "num_kv_shared_layers", 0) or 0):
        raise KVCompileError(
            f"unsupported model: {type(model).__name__} shares KV caches between layers (later layers reuse an "
            f"earlier layer's keys and values), which kvcompile's per-layer stores do not model yet.")
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap is not None or (impl not in (None, "sdpa") and not getattr(model, "_supports_sdpa", True)):
        why = (f"it soft-caps its attention logits (attn_logit_softcapping={cap}), which "
               f"scaled_dot_product_attention cannot express" if cap is not None else
               f"transformers offers no scaled_dot_product_attention path for it (it uses attn_implementation="
               f"{impl!r})")
        raise KVCompileError(
            f"unsupported model: {type(model).__name__}: {why}. kvcompile rewrites SDPA reads, so it cannot "
            f"quantize this model's cache without changing what the model computes.")
    if impl not in (None, "sdpa"):
        raise KVCompileError(
            f"no scaled_dot_product_attention read: this model uses attn_implementation={impl!r}, and kvcompile "
            f"rewrites SDPA reads. Load it with attn_implementation='sdpa' (or set "
            f"model.config._attn_implementation = 'sdpa').")
    n_layers, kv_heads, head_dim = model_shape(cfg)
    names = _hf_layer_names(model)
    policy.check(head_dim)
    policy.resolve(names)  # a policy override that names no layer fails here, before anything is changed
    dtype = next(model.parameters()).dtype
    _dtype_name(dtype, names[0])
    if max_cache_len is None:
        max_cache_len = getattr(_text_config(cfg), "max_position_embeddings", 2048)
    applied = Applied(policy, compiler, max_cache_len, names)
    cache_kw = _cache_kwarg(model)
    _raise_recompile_limit()
    orig_forward = model.forward
    compiled = torch.compile(orig_forward, backend=_backend_for(applied), fullgraph=True, dynamic=dynamic)

    def new_cache(batch, capacity, device):
        return KVCompileCache(cfg, policy, capacity, layer_names=names, batch_size=batch, dtype=dtype,
                              device=device)

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(cfg, "use_cache", True)
        if cache is None and not use_cache:
            return orig_forward(*args, **kwargs)  # no cache to quantize
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        B, n = ids.shape[0], ids.shape[1]
        if cache is None:
            cache = new_cache(B, max_cache_len, ids.device)
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        kwargs[cache_kw] = cache
        if isinstance(cache, KVCompileCache):
            if not cache.is_initialized:
                cache.early_initialization(B, kv_heads, head_dim, dtype, ids.device)
            cache.check_capacity(n)
        elif type(cache).__name__ == "DynamicCache":
            raise KVCompileError(
                "this model was prepared by kvcompile.apply but was given a DynamicCache, which grows by "
                "concatenation and cannot be quantized in place. Pass no cache (one is created), a "
                "kvcompile.hf.KVCompileCache, or a StaticCache.")
        out = _call_compiled(compiled, f"{type(model).__name__}.forward under kvcompile", *args, **kwargs)
        if isinstance(cache, KVCompileCache):
            cache.tokens += n
        return out

    orig_generate = model.generate

    @functools.wraps(orig_generate)
    def generate(*args, **kwargs):
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None and kwargs.get("use_cache", True):
            ids = kwargs.get("input_ids", args[0] if args else None)
            gc = kwargs.get("generation_config") or model.generation_config
            n_new = kwargs.get("max_new_tokens", gc.max_new_tokens)
            total = ids.shape[1] + n_new if n_new is not None else kwargs.get("max_length", gc.max_length)
            mult = max(kwargs.get("num_beams", gc.num_beams) or 1,
                       kwargs.get("num_return_sequences", gc.num_return_sequences) or 1)
            if mult > 1:
                raise KVCompileError("kvcompile caches are allocated per batch: beam search and "
                                     "num_return_sequences > 1 are not supported; repeat the prompts instead.")
            # Capacity rounded up to a whole bucket: prompts of other lengths then share the compiled decode
            # graph (the cache's shape is part of it) instead of recompiling per length.
            kwargs[cache_kw] = new_cache(ids.shape[0], -(-int(total) // CAPACITY_BUCKET) * CAPACITY_BUCKET,
                                         ids.device)
        return orig_generate(*args, **kwargs)

    model.forward = forward
    model.generate = generate
    if hasattr(model.generation_config, "disable_compile"):
        model.generation_config.disable_compile = True  # forward is compiled already (by kvcompile)
    model._kvcompile = applied
    return model


# --------------------------------------------------------------------------- explain
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
        if applied is not None and _is_hf(model):
            from .hf import KVCompileCache, model_shape

            ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
            n_layers, kv, hd = model_shape(model.config)
            cache = KVCompileCache(model.config, applied.policy, applied.max_cache_len, applied.layer_names,
                                   batch_size=1, dtype=next(model.parameters()).dtype, device=ids.device)
            kwargs = {"input_ids": ids, _cache_kwarg(model): cache, "use_cache": True}
            fn = type(model).forward.__get__(model)
            return _trace(fn, (), kwargs, pol)
        raise TypeError("kvcompile.explain(model, *example_inputs): pass example inputs to trace this model")
    fn = model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    if _is_hf(fn) and applied is not None:
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
            if isinstance(cur, _Analyzed):
                return cur.report
            cur = cur.__cause__ or cur.__context__
        raise
    raise KVCompileError("explain: the traced call did not reach the kvcompile backend")


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
