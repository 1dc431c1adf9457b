"""The ``"kvcompile"`` torch.compile backend: rewrite a Dynamo graph's cache sites, then compile the rest.

    torch.compile(model, backend="kvcompile", options={"policy": Policy.kivi(4), "compiler": "inductor"})

The pass (``kvcompile.passes``) finds each layer's cache write and SDPA read and replaces them with
``kvcompile.store`` / ``kvcompile.attention``, which take the graph's own cache tensors and find the layer's
packed store from them at every call (``kvcompile.ops``): the store is not part of the graph, so it can grow
and be cropped or reordered between calls without a recompile.

A cache the model allocates in full precision (a transformers ``StaticCache``) gets a packed store that
shadows it: results are the quantized ones, but the full tensor's memory is still held by its owner, and
``explain`` says so. A StaticCache that initializes lazily inside the compiled region has its allocation
rewritten into a stand-in (no full-precision memory), and a cache whose first tokens were written eagerly
(generate's prefill, before its compiled decode) is taken over at the first compiled write.

The rewritten graph goes to Inductor (``compiler="inductor"``, the backend's default) or runs as is
(``compiler="eager"``: no code generation, seconds to compile; the graph then calls kvcompile's functions
directly rather than through the operator dispatcher).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops, standin
from .errors import UnsupportedError
from .passes import analyze, rewrite
from .passes.paged import rewrite_paged
from .passes.kv_cache import Site, _example
from .policy import Policy, PolicyError
from .store import DTYPE_NAMES, LayerSpec

COMPILERS = ("inductor", "eager")


@dataclass(frozen=True)
class Options:
    """The backend's options: ``policy`` (a ``kvcompile.Policy``, needed for caches kvcompile did not
    allocate) and ``compiler`` ("inductor" or "eager"). Validated at construction."""

    policy: Policy | None = None
    compiler: str = "inductor"

    def __post_init__(self):
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise PolicyError(f"options['policy']={self.policy!r} is not valid: expected a kvcompile.Policy "
                              f"(e.g. kvcompile.Policy.kivi(4))")
        if self.compiler not in COMPILERS:
            raise UnsupportedError(f"options['compiler']={self.compiler!r} is not valid: expected one of {COMPILERS}")

    @staticmethod
    def parse(options) -> "Options":
        if isinstance(options, Options):
            return options
        options = dict(options or {})
        unknown = set(options) - {"policy", "compiler"}
        if unknown:
            raise UnsupportedError(f"unknown kvcompile backend option(s) {sorted(unknown)}: expected 'policy' "
                                 f"(a kvcompile.Policy) and 'compiler' (one of {COMPILERS})")
        return Options(options.get("policy"), options.get("compiler", "inductor"))


class Analyzed(Exception):
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
        ops._triton().check_supported(spec)
    except (NotImplementedError, ValueError, TypeError) as e:
        raise UnsupportedError(f"the Triton kernels do not support the layout {spec.name}: {e}. Choose another "
                             f"format for this layer (Policy.override) or run the reference "
                             f"(kvcompile.ops.set_kernels('reference')).") from e


def dtype_name(dt: torch.dtype, layer: str) -> str:
    if dt not in DTYPE_NAMES:
        raise UnsupportedError(f"layer {layer}: the cache dtype {dt} has no kvcompile kernel format; supported model "
                             f"dtypes are {sorted(DTYPE_NAMES.values())}")
    return DTYPE_NAMES[dt]


def bind(sites: list[Site], analysis, opts: Options):
    """For each site: its ``LayerSpec`` (from the store already registered behind its cache, or from the
    policy) and whether kvcompile owns its memory. Sets ``site.spec_name``."""
    policies = None
    specs, owned = [], []
    for s in sites:
        kt, vt = _example(s.k_cache), _example(s.v_cache)
        slot = standin.lookup(kt)
        if slot is None:
            if standin.is_standin(kt):
                raise UnsupportedError(f"layer {s.layer}: the cache {s.k_cache.name} is a kvcompile stand-in whose "
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
            spec = LayerSpec(policies[s.layer], s.shape[1], s.shape[3], dtype_name(s.dtype, s.layer))
            specs.append(spec)
            owned.append(s.k_cache.op != "placeholder")  # allocated by the graph: becomes a stand-in
        else:
            vslot = standin.lookup(vt)
            if vslot is None or vslot.store is not slot.store or (slot.role, vslot.role) != ("k", "v"):
                raise UnsupportedError(f"layer {s.layer}: SDPA reads keys and values from caches of different "
                                     f"kvcompile stores; the pass cannot pair this write with this read")
            specs.append(slot.spec)
            owned.append(slot.owned)
            s.layer = slot.layer or s.layer  # the name its policy was resolved by
        s.spec_name = specs[-1].register()
        check_kernel_support(specs[-1], kt.device)
    return specs, owned


def check_analysis(gm, analysis) -> None:
    """Turn what the pass could not do into errors when leaving it would be wrong or silently useless."""
    registered = [n for n in gm.graph.nodes if n.op == "placeholder" and standin.lookup(_example(n)) is not None]
    covered = {c for s in analysis.sites for c in (s.k_cache, s.v_cache)}
    for n in registered:
        if n not in covered and n.users:
            why = [k for k in analysis.skipped + analysis.unpaired_writes
                   if n.name in k.reason or src_name(n) in k.reason]
            if analysis.reads_found == 0:
                raise UnsupportedError(no_read_message(gm, n))
            hint = (" This looks like a transformers sliding-window ring (it rolls its window) allocated before "
                    "kvcompile was imported, so kvcompile took it for a plain cache: import kvcompile before "
                    "creating the cache." if why and "roll" in why[0].uses else "")
            raise UnsupportedError(f"the kvcompile cache {src_name(n)} is used in the graph, but the pass cannot pair "
                                 f"its write with an attention read: "
                                 f"{why[0].reason if why else 'no matching SDPA read'}.{hint}")
    if not analysis.sites and analysis.unpaired_writes:
        if analysis.reads_found == 0:
            raise UnsupportedError(no_read_message(gm, None, analysis.unpaired_writes))
        raise UnsupportedError("a cache write the pass cannot pair with a read: "
                             + "; ".join(f"{k.node}: {k.reason}" for k in analysis.unpaired_writes)
                             + (" | SDPA reads: " + "; ".join(k.reason for k in analysis.skipped)
                                if analysis.skipped else ""))


def src_name(n) -> str:
    ga = n.meta.get("grapharg")
    return ga.source.name if ga is not None else n.name


def no_read_message(gm, cache_node, unpaired=()) -> str:
    ops_seen = sorted({str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_method")} & {"matmul", "bmm", "softmax", "baddbmm", "einsum",
                                                                        "__matmul__", "flex_attention"})
    what = src_name(cache_node) if cache_node is not None else ", ".join(k.node for k in unpaired)
    return (f"no scaled_dot_product_attention read found for the KV cache ({what}); the graph computes attention "
            f"with {', '.join(ops_seen) or 'no attention op kvcompile knows'} instead. kvcompile rewrites caches "
            f"read by torch.nn.functional.scaled_dot_product_attention; for transformers models load them with "
            f"attn_implementation='sdpa'.")


def compile_graph(gm, example_inputs, options=None, *, report=None, analyze_only=False):
    """The backend: rewrite cache sites in the Dynamo graph ``gm``, then compile the rest (``_finish``)."""
    from .explain import site_reports

    opts = Options.parse(options)
    gm = _own_copy(gm)  # Dynamo still reads its graph (placeholders, graphargs) after the backend returns
    rewrite_paged(gm)  # a compiled continuous-batching forward over kvcompile's paged cache (passes/paged.py)
    analysis = analyze(gm, left=lambda ph: standin.left(_example(ph)))
    check_analysis(gm, analysis)
    sites = analysis.sites
    specs, owned = bind(sites, analysis, opts)
    ex = site_reports(sites, specs, owned, analysis.skipped + analysis.unpaired_writes)
    if analyze_only:
        raise Analyzed(ex)
    if report is not None:
        report(ex)
    if sites:
        rewrite(gm, sites)
    return _finish(gm, list(example_inputs), opts)


def _own_copy(gm):
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return torch.fx.GraphModule(gm, g)


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
    """``torch.compile(model, backend="kvcompile", options={"policy": p, "compiler": "inductor"|"eager"})``.

    ``mode`` is accepted (transformers' ``CompileConfig`` passes one) and has no effect."""
    return compile_graph(gm, example_inputs, options)
