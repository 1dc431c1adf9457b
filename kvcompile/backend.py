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

Errors: Dynamo wraps whatever a backend raises in its own ``BackendCompilerFailed`` (torch/_dynamo/
output_graph.py, ``call_user_compiler``), so a kvcompile error found while compiling is returned instead, as a
graph that raises it (``_raising``): the call being compiled raises it as itself, with the traceback of where
compiling found it. What fails while Dynamo traces (before the backend) reaches kvcompile's own entry points
wrapped, and they unwrap it (``unwrapped``).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import torch

from . import extension, ops, standin
from .errors import KVCompileError, UnsupportedError
from .passes import analyze, rewrite
from .passes.kv_cache import Site, _arg, _example, _op_name, _walk_to_cache, find_reads, layer_name, sdpa_args
from .policy import Policy, PolicyError
from .report import site_reports
from .store import DTYPE_NAMES, LayerSpec

COMPILERS = ("inductor", "eager")
# torch.compile's modes, as Inductor reads them (torch._inductor.list_mode_options); the backend honours each
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class Options:
    """The backend's options: ``policy`` (a ``kvcompile.Policy``, needed for caches kvcompile did not
    allocate), ``compiler`` ("inductor" or "eager") and ``mode`` (torch.compile's, for Inductor: "reduce-overhead"
    and "max-autotune" run the graph as CUDA graphs between kvcompile's ops, ``cudagraph_patches``; None is
    "default"). ``torch.compile`` takes ``mode=`` or ``options=``, not both: ``options={"policy": p, "mode":
    "reduce-overhead"}`` gives both. Validated at construction."""

    policy: Policy | None = None
    compiler: str = "inductor"
    mode: str | None = None

    def __post_init__(self):
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise PolicyError(f"options['policy']={self.policy!r} is not valid: expected a kvcompile.Policy "
                              f"(e.g. kvcompile.Policy.kivi(4))")
        if self.compiler not in COMPILERS:
            raise UnsupportedError(f"options['compiler']={self.compiler!r} is not valid: expected one of {COMPILERS}")
        if self.mode is not None and self.mode not in MODES:
            raise UnsupportedError(f"mode={self.mode!r} is not valid for the kvcompile backend: expected one of "
                                   f"{MODES} (or None)")
        if self.compiler == "eager" and self.mode not in (None, "default"):
            raise UnsupportedError(f"mode={self.mode!r} asks Inductor for {'CUDA graphs' if self.cudagraphs else 'autotuning'}, "
                                   f"but options['compiler']='eager' runs the graph without Inductor: use "
                                   f"compiler='inductor' (the default) with this mode, or no mode")

    @property
    def cudagraphs(self) -> bool:
        return self.mode is not None and bool(_mode_options(self.mode).get("triton.cudagraphs"))

    @staticmethod
    def parse(options) -> "Options":
        if isinstance(options, Options):
            return options
        options = dict(options or {})
        unknown = set(options) - {"policy", "compiler", "mode"}
        if unknown:
            raise UnsupportedError(f"unknown kvcompile backend option(s) {sorted(unknown)}: expected 'policy' "
                                 f"(a kvcompile.Policy), 'compiler' (one of {COMPILERS}) and 'mode' (one of {MODES})")
        return Options(options.get("policy"), options.get("compiler", "inductor"), options.get("mode"))


def _mode_options(mode: str) -> dict:
    from torch._inductor import list_mode_options
    return list_mode_options(mode)


def cudagraph_patches(mode: str) -> dict:
    """Inductor's config for ``mode``, and, where it records CUDA graphs, a graph partitioned around kvcompile's
    ops (``ops.HOST_OPS``): they do host-side work at every call (the store's block manager: reserving blocks,
    lengths, the layer's store looked up from its cache tensor), which a recorded graph would replay without,
    so they run between the recorded partitions. A torch without graph partitions is refused: a CUDA graph
    over the whole graph would be silently wrong."""
    patches = dict(_mode_options(mode))
    if patches.get("triton.cudagraphs"):
        from torch._inductor import config
        if not hasattr(config, "graph_partition") or not hasattr(config, "custom_should_partition_ops"):
            raise UnsupportedError(
                f"mode={mode!r} records CUDA graphs, and kvcompile's ops must run outside them (they update the "
                f"store's block tables on the host); this torch ({torch.__version__}) has no Inductor graph "
                f"partitions (torch._inductor.config.custom_should_partition_ops) to keep them out. Use torch >= "
                f"2.9, or mode='default' / 'max-autotune-no-cudagraphs'.")
        patches.update(graph_partition=True,
                       custom_should_partition_ops=sorted(set(config.custom_should_partition_ops) | set(ops.HOST_OPS)))
    return patches


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


def concatenated_reads(gm) -> list[str]:
    """The layers whose SDPA reads keys the graph concatenates along the sequence axis (``torch.cat`` at dim 2)
    from tensors it never writes in place: transformers' DynamicCache (the default cache) or a hand-written
    ``cat((past_k, k), -2)``. Such a cache grows by new tensors in full precision, so no store can take it over.
    A sliding-window ring concatenates too once full (its chunk after its window), but into a buffer it then
    writes in place (``copy_``): the model's own ring, which kvcompile leaves alone, is not counted."""
    out = []
    for read in find_reads(gm):
        root, _, _, chain = _walk_to_cache(sdpa_args(read)["key"])
        last = chain[-1] if chain else None
        if root is not None or last is None or _op_name(last) != "cat" or _arg(last, 1, "dim") not in (2, -2):
            continue
        if not any(_buffer(x) for x in _arg(last, 0, "tensors")):
            out.append(layer_name(read))
    return list(dict.fromkeys(out))


_IN_PLACE = ("copy_", "index_copy_", "index_put_", "setitem")


def _buffer(x) -> bool:
    """Whether graph node ``x`` is (a slice of) a tensor the graph writes in place, or a cache tensor kvcompile
    leaves to the model: a static buffer, not a cache that grows by concatenation."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function" and _op_name(x) == "getitem":
        x = x.args[0]
    if not isinstance(x, torch.fx.Node):
        return False
    if x.op == "placeholder" and standin.left(_example(x)) is not None:
        return True
    return any(_op_name(u) in _IN_PLACE and u.args and u.args[0] is x for u in x.users)


CONCATENATED = (
    "torch.compile(..., backend='kvcompile') was given a policy, but {layers} read a KV cache that the graph grows "
    "by concatenation (torch.cat along the sequence: transformers' DynamicCache, the default cache, or a "
    "hand-written cat of past keys), which kvcompile cannot quantize in place: the policy would not apply. For a "
    "transformers model use kvcompile.apply(model, policy) (generate and forward, every mode), or pass a cache "
    "written in place: generate(..., cache_implementation='static') with model.forward compiled by the backend, "
    "or a kvcompile.hf.KVCompileCache.")


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
    """The backend: rewrite cache sites in the Dynamo graph ``gm``, then compile the rest (``_finish``); the
    rewrites integrations registered (``extension.add_graph_rewrite``) run first. A kvcompile error found on the way comes back as a graph that raises it (``_raising``); with
    ``analyze_only`` (``explain``), it and ``Analyzed`` are raised here."""
    try:
        return _compile_graph(gm, example_inputs, options, report, analyze_only)
    except KVCompileError as e:
        if analyze_only:
            raise
        return _raising(e)


def _raising(error: KVCompileError):
    """A compiled graph that raises ``error``, with the traceback compiling gave it, whenever it is called: the
    call Dynamo compiled it for, and every later call its guards send to it (each would compile to the same
    failure)."""
    tb = error.__traceback__

    def failed(*args):
        raise error.with_traceback(tb)

    return failed


def carried(exc: BaseException) -> KVCompileError | None:
    """The kvcompile error an exception from Dynamo carries, or None: Dynamo keeps what a backend raised as
    ``inner_exception`` and what failed while it traced as the ``__cause__`` or ``__context__`` of its own."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KVCompileError):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def unwrapped():
    """Around a call of a compiled function: a kvcompile error that Dynamo wrapped (``carried``) is raised as
    itself, Dynamo's exception kept as its cause."""
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as e:
        inner = carried(e)
        if inner is None:
            raise
        raise inner from e


def _compile_graph(gm, example_inputs, options, report, analyze_only):
    opts = Options.parse(options)
    gm = _own_copy(gm)  # Dynamo still reads its graph (placeholders, graphargs) after the backend returns
    extension.rewrite_graph(gm)  # e.g. a compiled continuous-batching forward's page pools (kvcompile.serving)
    analysis = analyze(gm, left=lambda ph: standin.left(_example(ph)))
    check_analysis(gm, analysis)
    cat = concatenated_reads(gm) if opts.policy is not None else []
    why = CONCATENATED.format(layers=", ".join(cat[:3]) + (f" and {len(cat) - 3} more" if len(cat) > 3 else ""))
    if cat and not analyze_only:
        raise UnsupportedError(why)
    sites = analysis.sites
    specs, owned = bind(sites, analysis, opts)
    ex = site_reports(sites, specs, owned, analysis.skipped + analysis.unpaired_writes)
    if analyze_only:
        ex.notes += [why] if cat else []  # (explain reports it; compiling refuses it)
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

    patches = cudagraph_patches(opts.mode) if opts.mode is not None else None
    # called like Dynamo calls a backend's result: compiled(*args)
    return compile_fx(gm, example_inputs, config_patches=patches)


@torch._dynamo.register_backend(name="kvcompile")
def kvcompile_backend(gm, example_inputs, options=None, mode=None):
    """``torch.compile(model, backend="kvcompile", options={"policy": p, "compiler": "inductor"|"eager"})``, or
    ``torch.compile(model, backend="kvcompile", mode="reduce-overhead")`` (the policy then comes from a kvcompile
    cache the model is given). ``mode`` is torch.compile's (transformers' ``CompileConfig`` passes one too) and is
    honoured (``Options.mode``)."""
    opts = Options.parse(options)
    if mode is not None and mode != opts.mode:
        if opts.mode is not None:
            raise UnsupportedError(f"the kvcompile backend got mode={mode!r} and options['mode']={opts.mode!r}: "
                                   f"give one")
        opts = Options(opts.policy, opts.compiler, mode)
    return compile_graph(gm, example_inputs, opts)


# --------------------------------------------------------------------------- generate on a compiled module
# torch.compile(model) returns a wrapper whose forward is compiled; every other attribute is the original model's.
# So torch.compile(model, backend="kvcompile", options={"policy": ...}).generate(...) runs the original model's
# generate, whose forward calls never reach the wrapper: uncompiled, over transformers' full-precision
# DynamicCache, and the backend never sees a graph it could refuse. The wrapper's attribute lookup is the one
# place such a call passes through, so kvcompile refuses it there, when the call is made.
UNCOMPILED_ENTRIES = ("generate", "generate_batch", "init_continuous_batching")

UNCOMPILED = (
    "torch.compile(model, backend='kvcompile') compiles the model's forward only: {name}(...) on the compiled "
    "module runs the original model's {name}, which calls the original forward, uncompiled, over transformers' "
    "full-precision cache, so the policy would not apply. Use kvcompile.apply(model, policy) instead (generate, "
    "generate_batch and forward then quantize, every mode), or compile the forward generate calls: model.forward "
    "= torch.compile(model.forward, backend='kvcompile', options=...) and generate(..., "
    "cache_implementation='static').")


def compiled_by_kvcompile(module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (``OptimizedModule``) whose backend is kvcompile's. Follows
    Dynamo's chain of wrapped backends (``_torchdynamo_orig_backend``) to the one ``torch.compile`` made."""
    x = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if x is None:
            return False
        if getattr(x, "compiler_fn", None) is kvcompile_backend or x is kvcompile_backend:
            return True
        x = getattr(x, "_torchdynamo_orig_backend", None)
    return False


def _uncompiled(name: str):
    def refuse(*args, **kwargs):
        raise UnsupportedError(UNCOMPILED.format(name=name))
    return refuse


def _install_generate_guard() -> None:
    """``OptimizedModule.__getattr__`` (its lookup of the original model's attributes), wrapped: ``generate`` and
    transformers' continuous batching on a module compiled by the kvcompile backend refuse when called, unless
    the original model was prepared by ``kvcompile.apply`` (its generate is kvcompile's)."""
    from torch._dynamo.eval_frame import OptimizedModule

    lookup = OptimizedModule.__getattr__
    if getattr(lookup, "_kvcompile", False):
        return

    @functools.wraps(lookup)
    def __getattr__(self, name):
        value = lookup(self, name)
        if name in UNCOMPILED_ENTRIES and callable(value) and compiled_by_kvcompile(self):
            orig = self._orig_mod
            if getattr(orig, "_kvcompile", None) is None and "transformers" in sys.modules:
                from transformers import PreTrainedModel
                if isinstance(orig, PreTrainedModel):
                    return _uncompiled(name)
        return value

    __getattr__._kvcompile = True
    OptimizedModule.__getattr__ = __getattr__


_install_generate_guard()
