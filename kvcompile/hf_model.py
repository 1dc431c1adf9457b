"""``kvcompile.apply`` on a Hugging Face transformers model: its forward compiled through the kvcompile backend,
and every cache ``generate`` or ``forward`` would create a ``KVCompileCache`` instead.

The model object is kept (``apply`` returns it): ``forward`` is wrapped, and ``generate`` is left as it is --
only the two hooks it calls to create its cache and to decide on its own compilation are replaced. So every
generation mode reaches kvcompile's cache the way it reaches transformers' own: greedy and sampling, beam
search (the cache is reordered), ``num_return_sequences``, assisted and prompt-lookup decoding (the cache is
cropped), ``inputs=``/``inputs_embeds=``, streamers, pipelines, a chat continued in the cache a previous call
returned (the cache grows).

Compilation: Dynamo traces the forward once per batch size for a prefill (many tokens) and once for a decode
step (one token). The sequence dimensions of the inputs and the cache's width are marked dynamic, so no new
prompt length and no larger cache compiles again.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

import torch

from . import extension, tp
from .hf import CAPACITY_STEP, KVCompileCache, KVCompileWarning, _text_config, model_shape
from .errors import ArgumentError, UnsupportedError
from .policy import Policy, PolicyError


def is_hf(model) -> bool:
    from transformers import PreTrainedModel
    return isinstance(model, PreTrainedModel)


def cache_kwarg(model) -> str:
    """The name the model's forward takes its cache by: ``cache`` (transformers 5.2x) or ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def layer_names(model) -> list[str]:
    """The attention modules' paths in layer order (``model.layers.<i>.self_attn`` for most families)."""
    n_layers = model_shape(model.config)[0]
    names = [(m.layer_idx, p) for p, m in model.named_modules()
             if isinstance(getattr(m, "layer_idx", None), int) and "attention" in type(m).__name__.lower()]
    names = [p for _, p in sorted(names)]
    return names if len(names) == n_layers else [f"model.layers.{i}.self_attn" for i in range(n_layers)]


def check_supported(model) -> None:
    """Refuse, with the reason, models whose cache kvcompile cannot quantize without changing what they compute."""
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None)
    text = _text_config(cfg)
    kinds = sorted(set(getattr(text, "layer_types", None) or []) - {"full_attention", "sliding_attention",
                                                                      "chunked_attention"})
    if getattr(model, "_is_stateful", False) or kinds:
        raise UnsupportedError(
            f"unsupported model: {type(model).__name__} is a hybrid: besides attention it has "
            f"{', '.join(repr(k) for k in kinds) or 'recurrent'} layers, which keep a recurrent state (and a cache "
            f"class of their own) instead of keys and values. kvcompile quantizes attention KV caches and does "
            f"not support hybrid models yet.")
    if "reuse" in (getattr(text, "kv_sharing_modes", None) or []) or (getattr(text, "num_kv_shared_layers", 0) or 0):
        raise UnsupportedError(
            f"unsupported model: {type(model).__name__} shares KV caches between layers (later layers reuse an "
            f"earlier layer's keys and values), which kvcompile's per-layer stores do not model yet.")
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap is not None or (impl not in (None, "sdpa") and not getattr(model, "_supports_sdpa", True)):
        why = (f"it soft-caps its attention logits (attn_logit_softcapping={cap}), which "
               f"scaled_dot_product_attention cannot express" if cap is not None else
               f"transformers offers no scaled_dot_product_attention path for it (it uses attn_implementation="
               f"{impl!r})")
        raise UnsupportedError(
            f"unsupported model: {type(model).__name__}: {why}. kvcompile rewrites SDPA reads, so it cannot "
            f"quantize this model's cache without changing what the model computes.")
    if impl not in (None, "sdpa"):
        raise UnsupportedError(
            f"no scaled_dot_product_attention read: this model uses attn_implementation={impl!r}, and kvcompile "
            f"rewrites SDPA reads. Load it with attn_implementation='sdpa' (or set "
            f"model.config._attn_implementation = 'sdpa').")
    p = next(iter(model.parameters()), None)
    if p is not None and p.device.type == "meta":
        raise UnsupportedError(
            f"{type(model).__name__}'s weights are on the 'meta' device (not loaded): kvcompile.apply needs the "
            f"model it will run. Load the weights first (e.g. from_pretrained without device_map='meta', or "
            f"model.to_empty(...) and load_state_dict).")


# --------------------------------------------------------------------------- dynamic dimensions
def _mark(t, dim: int) -> None:
    if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] >= 2:
        torch._dynamo.maybe_mark_dynamic(t, dim)


def mark_dynamic(args, kwargs) -> None:
    """The sequence dimensions of a forward's inputs, as Dynamo should see them: dynamic, so that a new prompt
    length or a longer conversation reuses the compiled graph (sizes 0 and 1 stay static: a decode step of
    one token is a graph of its own)."""
    _mark(kwargs.get("input_ids", args[0] if args else None), 1)
    _mark(kwargs.get("inputs_embeds"), 1)
    _mark(kwargs.get("cache_position"), 0)
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        _mark(pos, pos.dim() - 1)
    mask = kwargs.get("attention_mask")
    for m in (mask.values() if isinstance(mask, dict) else [mask]):
        if isinstance(m, torch.Tensor):
            if m.dim() == 2:
                _mark(m, 1)
            elif m.dim() == 4:
                _mark(m, 2)
                _mark(m, 3)


# --------------------------------------------------------------------------- apply
_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None) or getattr(
    torch._dynamo.exc, "FailOnCacheLimitHit", ())


def call_compiled(compiled, what: str, *args, **kwargs):
    """``compiled(*args, **kwargs)``, with Dynamo's recompile-limit failure turned into an error that says
    what happened and what to do, and a kvcompile error Dynamo wrapped raised as itself (``backend.unwrapped``)."""
    from .backend import unwrapped
    try:
        with unwrapped():
            return compiled(*args, **kwargs)
    except _LIMIT_HIT as e:
        cfg = torch._dynamo.config
        limit = getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", "?"))
        raise UnsupportedError(
            f"{what}: this process has compiled as many graphs of it as Dynamo allows (recompile_limit={limit}; "
            "kvcompile compiles one prefill and one decode graph per batch size and dtype, shared by every model "
            "of the class), and fullgraph=True makes one more a hard failure. Use fewer distinct batch sizes, "
            "raise torch._dynamo.config.recompile_limit, or call torch._dynamo.reset() to drop the compiled "
            "graphs.") from e


def _threads(x, graph: dict | None = None):
    """On the CPU, torch's threads at most the cores other processes leave free (``templates.cpu.
    capped_torch_threads``); elsewhere nothing. An eager call follows the load call by call. A compiled call
    (``graph``: the applied model's record) keeps the count its first compiled call took: torch's thread count
    is one of Dynamo's guards (``GLOBAL_STATE``), so a count that followed the load would recompile the model
    whenever the load changed. kvcompile's own kernels still follow the load at every call."""
    if x.device.type != "cpu":
        return contextlib.nullcontext()
    from .templates import cpu
    if graph is None:
        return cpu.capped_torch_threads()
    if "threads" not in graph:
        graph["threads"] = cpu.available_threads()
    return cpu.capped_torch_threads(graph["threads"])


# why a torch.compile around an applied model does not trace into its forward (Dynamo says it where fullgraph=True
# makes that an error): it would trace the model without kvcompile's pass, into the tiny stand-ins
OUTER_COMPILE = ("kvcompile.apply has compiled this model's forward already, through the kvcompile backend; a "
                 "torch.compile around the applied model must leave that forward to it (its cache writes only mean "
                 "something to kvcompile's pass). Call the applied model without torch.compile, or compile it "
                 "without fullgraph=True (the forward then runs as kvcompile compiled it).")


def opaque(fn):
    """``fn``, which a torch.compile around an applied model runs as it is instead of tracing it
    (``OUTER_COMPILE``; with fullgraph=True, Dynamo refuses it giving that reason)."""
    return torch.compiler.disable(fn, reason=OUTER_COMPILE)

# cache_implementation values generate may be given for an applied model: all become its kvcompile cache
_CACHES_REPLACED = {None, "dynamic", "static", "dynamic_full", "hybrid", "sliding_window", "hybrid_chunked"}


def apply_hf(model, policy: Policy, max_cache_len: int | None, compiler: str, dynamic, applied, backend,
             prefill: str = "auto"):
    """See ``kvcompile.apply``. ``applied`` is the model's ``Applied`` record, ``backend`` the Dynamo backend."""
    check_supported(model)
    cfg = model.config
    n_layers, kv_heads, head_dim = model_shape(cfg)
    names = applied.layer_names
    policy.check(head_dim)
    policy.resolve(names)  # a policy override that names no layer fails here, before anything is changed
    horizon = max_cache_len or getattr(_text_config(cfg), "max_position_embeddings", None)
    reason = policy.noop_reason(horizon, names) if horizon else None
    if reason:
        limit = f"max_cache_len={max_cache_len}" if max_cache_len else f"max_position_embeddings={horizon}"
        warnings.warn(f"kvcompile.apply ({limit}): {reason}", KVCompileWarning, stacklevel=3)
    cache_kw = cache_kwarg(model)
    # tensor parallelism (kvcompile.tp): each rank caches the KV heads its attention computes
    modules = dict(model.named_modules())
    shard = applied.sharding = tp.sharding(model, [(n, modules[n]) for n in names if n in modules], kv_heads,
                                           head_dim)
    heads = applied.kv_heads = shard.heads if shard is not None else kv_heads
    resolved = policy.resolve(names)  # each layer's policy: a cache the caller passes must hold the same
    pre_rope = any(p.pre_rope for p in resolved)
    if pre_rope:
        check_pre_rope(model)
    # with compiler="eager" the compiled graph runs as Python anyway: a first prefill gains nothing from tracing.
    # Pre-RoPE keys only exist in the compiled graph (the pass finds the rotary embedding): every call compiles.
    eager_prefill = not pre_rope and (prefill == "eager" or (prefill == "auto" and compiler == "eager"))
    orig_forward = model.forward
    compiled = torch.compile(orig_forward, backend=backend, fullgraph=True, dynamic=dynamic)

    def new_cache(limit: int | None = None):
        """The model's cache; ``limit``: a caller's own cache length (a StaticCache taken over), within apply's."""
        limit = min(x for x in (limit, max_cache_len) if x) if (limit or max_cache_len) else None
        return KVCompileCache(cfg, policy, limit, layer_names=names, kv_heads=heads)

    graph_threads = {}  # torch's thread count for this model's compiled calls (``_threads``)

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        if cache_kw != "past_key_values" and "past_key_values" in kwargs:
            kwargs.setdefault(cache_kw, kwargs.pop("past_key_values"))
        cache = kwargs.get(cache_kw)
        owner = getattr(cache, "kvcompile_forward", None)
        if owner is not None:  # a cache that runs the forward itself (extension.ForwardOwner: kvcompile.serving's)
            # (transformers compiles its own forward around this call, so this part stays traceable)
            if getattr(cache, "exact", False):  # transformers' own arithmetic (threads included), as in ``run``
                return owner(orig_forward, *args, **kwargs)
            with _threads(next(model.parameters()), graph_threads if getattr(cache, "compiled", False) else None):
                return owner(orig_forward, *args, **kwargs)
        return run(*args, **kwargs)

    @opaque
    def run(*args, **kwargs):
        """The forward with a kvcompile cache (created here when the caller passes none). Opaque to a
        torch.compile around the applied model: it runs as it would alone."""
        cache = kwargs.get(cache_kw)
        use_cache = kwargs.get("use_cache")
        if cache is None and (use_cache is False or (use_cache is None and not getattr(cfg, "use_cache", True))):
            return orig_forward(*args, **kwargs)  # no cache to quantize: the unmodified model
        if cache is None and use_cache is None and kwargs.get("labels") is not None:
            # a loss, not a generation: the unmodified model, with no cache to fill (and nothing to compile)
            kwargs["use_cache"] = False
            return orig_forward(*args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise ArgumentError(f"{type(model).__name__}.forward under kvcompile: pass input_ids or inputs_embeds")
        if cache is None:
            cache = new_cache()
        take_over(cache, new_cache)
        kwargs[cache_kw] = cache
        if isinstance(cache, KVCompileCache):
            check_cache_policy(cache, resolved)
            p = next(model.parameters())
            cache.prepare(ids.shape[0], ids.shape[1], p.dtype, p.device, heads)
            if pre_rope:
                cache.set_positions(kwargs.get("position_ids"), ids.shape[1])
            if cache.exact:
                # Every layer exact (Policy.full()): the unmodified model's forward, its attention over the paged
                # store read as the DynamicCache it would have had -- its arithmetic, threads included, so its
                # results bit for bit (a compiled graph's are not: masks, head replication, Inductor's fusions)
                return orig_forward(*args, **kwargs)
            if eager_prefill and ids.shape[1] > 1 and cache.tokens == 0:
                # A first prefill into an empty cache attends only to its own tokens, in full precision, and
                # stores them: the cache's eager path does exactly that (the same kernels store), so it runs
                # without Dynamo tracing the model (tens of seconds on a small CPU). Compiled graphs serve the
                # decode steps and later chunks, which read what the store holds.
                with _threads(ids):
                    return orig_forward(*args, **kwargs)
        elif type(cache).__name__ == "PagedAttentionCache":
            raise UnsupportedError(
                "this model was prepared by kvcompile.apply but was given transformers' own PagedAttentionCache, which "
                "stores keys and values in full precision. Use model.generate_batch / model.init_continuous_batching "
                "on the applied model (they build kvcompile's paged cache).")
        elif type(cache).__name__ in ("DynamicCache", "QuantizedCache", "OffloadedCache"):
            raise UnsupportedError(refused_cache(cache))
        mark_dynamic(args, kwargs)
        with _threads(ids, graph_threads):
            return call_compiled(compiled, f"{type(model).__name__}.forward under kvcompile", *args, **kwargs)

    orig_prepare = model._prepare_cache_for_generation

    @functools.wraps(orig_prepare)
    def prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs):
        """generate's cache, unless the caller passed one: an empty ``KVCompileCache`` (it takes the batch
        generate expands to -- beams, return sequences -- at the first forward, and grows). Either way a
        kvcompile cache is told how far generate goes (``expect``), so it allocates once, not while decoding."""
        # (generation_mode, batch_size, max_cache_length): the tokens a sequence may reach in this call
        horizon = kwargs.get("max_cache_length", args[2] if len(args) > 2 else generation_config.max_length)
        given = model_kwargs.get(cache_kw)
        if given is not None or generation_config.use_cache is False:
            take_over(given, new_cache)
            if isinstance(given, KVCompileCache):
                check_cache_policy(given, resolved)
                if isinstance(horizon, int):
                    given.expect(horizon)
            return orig_prepare(generation_config, model_kwargs, *args, **kwargs)
        impl = generation_config.cache_implementation
        if impl not in _CACHES_REPLACED:
            raise UnsupportedError(
                f"generate(cache_implementation={impl!r}) on a model prepared by kvcompile.apply: kvcompile gives the "
                f"model its own quantized cache, which replaces {impl!r}. Drop cache_implementation (or use the "
                f"unmodified model for {impl!r}).")
        model_kwargs[cache_kw] = new_cache()
        if isinstance(horizon, int):
            model_kwargs[cache_kw].expect(horizon)

    if shard is not None:  # every rank agrees before each run, so an error on one rank stops all (kvcompile.tp)
        guard = tp.Guard(shard, cache_kw, f"{type(model).__name__}.forward under kvcompile")
        orig_forward, compiled, forward = guard.run(orig_forward), guard.run(compiled), guard.call(forward)
    model.forward = forward
    model._prepare_cache_for_generation = prepare_cache_for_generation
    # generate must not compile the forward again (it is compiled already, by kvcompile)
    model._valid_auto_compile_criteria = lambda *a, **k: False
    if hasattr(model.generation_config, "disable_compile"):
        model.generation_config.disable_compile = True
    extension.applied(model, applied)  # integrations attach here (kvcompile.serving: generate_batch, serve)
    return model


def take_over(cache, new_cache) -> None:
    """An empty transformers ``DynamicCache`` or ``StaticCache`` the caller passes (transformers' recipes create one:
    ``DynamicCache(config=model.config)``, ``StaticCache(config=..., max_cache_len=...)``, then fill it with a
    forward or ``generate``) becomes, in place, the applied model's ``KVCompileCache`` (``new_cache``; a
    StaticCache's length its limit): the caller's object is the cache that fills up, as with transformers' own
    cache, and it quantizes as the model was applied, with no full-precision copy. A DynamicCache holding tokens,
    or one that offloads, is refused (``refused_cache``); a StaticCache holding tokens is taken over by the
    compiled graph as the backend takes any (``kvcompile.backend``)."""
    from transformers.cache_utils import DynamicCache, StaticCache

    kind = type(cache)
    if kind not in (DynamicCache, StaticCache) or getattr(cache, "offloading", False) or cache.get_seq_length() != 0:
        return
    limit = max((layer.max_cache_len for layer in cache.layers), default=None) if kind is StaticCache else None
    fresh = new_cache(limit)
    cache.__class__ = KVCompileCache
    cache.__dict__.clear()
    cache.__dict__.update(fresh.__dict__)


def refused_cache(cache) -> str:
    """Why a full-precision transformers cache given to an applied model is refused, and what to do."""
    name = type(cache).__name__
    if getattr(cache, "offloading", False):
        why = "offloads its layers to the CPU, which kvcompile's cache does not do"
    elif name == "DynamicCache":
        why = (f"already holds {cache.get_seq_length()} tokens, kept in full precision by the unmodified model (an "
               f"empty one becomes the model's kvcompile cache)")
    else:
        why = "quantizes with its own scheme, in full precision between steps"
    return (f"this model was prepared by kvcompile.apply but was given a {name} that {why}; kvcompile cannot take "
            f"it over. Pass no cache (a kvcompile cache is created and returned, to pass back on the next call), an "
            f"empty DynamicCache(), or a kvcompile.hf.KVCompileCache.")


def check_cache_policy(cache: KVCompileCache, resolved: list) -> None:
    """A ``KVCompileCache`` the caller passes must store every layer as the model was applied: its compiled
    graphs read each layer's layout from its cache (two policies in one model would be two models)."""
    if cache.policies == resolved:
        return
    diff = next(i for i, (a, b) in enumerate(zip(cache.policies, resolved)) if a != b) \
        if len(cache.policies) == len(resolved) else None
    where = (f"layer {diff}: the cache has {cache.policies[diff]}, the model {resolved[diff]}" if diff is not None
             else f"the cache has {len(cache.policies)} layers, the model {len(resolved)}")
    raise ArgumentError(
        f"this KVCompileCache was created with the policy {cache.policy}, but the model was applied with another "
        f"({where}). A cache stores layers as the model it is given to was applied: pass no cache (the model "
        f"creates one with its policy), or create it with the policy given to kvcompile.apply "
        f"(KVCompileCache(model.config, policy)).")


def check_pre_rope(model) -> None:
    """Refuse pre-RoPE keys where the rotary embedding of a position changes with the sequence's length (the
    cos/sin captured when a key was written would not be those of a later call)."""
    cfg = _text_config(model.config)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kinds = {params.get("rope_type"), params.get("type")} if isinstance(params, dict) else set()
    if isinstance(params, dict) and not kinds - {None}:  # per layer type (Gemma 3): {"full_attention": {...}}
        kinds = {v.get("rope_type") for v in params.values() if isinstance(v, dict)}
    varying = kinds & {"dynamic", "longrope"}
    if varying:
        raise PolicyError(
            f"Policy.pre_rope=True on a model whose rotary embedding changes with the sequence length "
            f"(rope_type {sorted(varying)[0]!r}): the cos/sin of a stored key's position would differ between calls. "
            f"Use a policy without pre_rope for this model.")


def trace_inputs(model, applied):
    """What ``explain`` traces an applied model with: its original forward and a two-token prompt."""
    p = next(model.parameters())
    shard = getattr(applied, "sharding", None)
    cache = KVCompileCache(model.config, applied.policy, applied.max_cache_len, applied.layer_names,
                           batch_size=1, dtype=p.dtype, device=p.device, kv_heads=shard.heads if shard else None,
                           model_arithmetic=False)  # what the pass does with the graph, Policy.full()'s too
    ids = torch.zeros(1, 2, dtype=torch.long, device=p.device)
    return type(model).forward.__get__(model), {"input_ids": ids, cache_kwarg(model): cache, "use_cache": True}


__all__ = ["apply_hf", "cache_kwarg", "layer_names", "is_hf", "CAPACITY_STEP"]
