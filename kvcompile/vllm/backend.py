"""kvcompile's attention backend for vLLM: a policy's packed pages inside vLLM's own block tensors.

vLLM allocates each layer's cache as pages of ``block_size`` tokens and hands out, shares (prefix caching), frees
and evicts (preemption) them itself. This backend changes two things, through vLLM's backend interface:

- **the page**: ``customize_spec`` declares each page to hold ``kvcompile.pages.PageLayout.page_bytes`` bytes
  (``state_content_bytes`` per kv head and token, as uint8), so vLLM's capacity accounting, its block manager and
  its reported concurrency follow the packed size; under a per-layer policy each layer declares its own page
  (``layer_spec``, through vLLM's ``Attention.get_kv_cache_spec``: ``customize_spec`` sees no layer), in vLLM's
  block-outermost layout (``supported_kv_cache_layouts``), where cache groups of pages of different sizes -- window
  caches, sliding-window layers -- share each block side by side;
- **the write and the read**: ``do_kv_cache_update`` quantizes the step's keys and values into their pages
  (``kvcompile.pages.store_ragged``: sequence ``i``'s tokens at positions ``seq_lens[i] - n_i ..``, page
  ``block_table[i][p // block_size]``, row ``p % block_size`` -- the slots vLLM assigned), and ``forward`` attends
  over them (``kvcompile.pages.attention_ragged``: the decode kernel reads packed pages in place). The kernels are
  those ``kvcompile.ops.backend`` picks: generated C on the CPU, Triton on CUDA.

Every position is read from the pages, the queries' own as well (kvcompile's own engine reads a chunk's own keys
and values in full precision, KIVI's convention). Through vLLM that convention would make a token's attention
depend on how the scheduler cut the work: a prompt whose first page came from the prefix cache, a prefill split
into chunks, or a preempted request recomputed in one piece would each read some positions in full precision that
another run read packed, and greedy tokens drift apart (seen on the test model: prefix caching changed a request
from its sixth token on). Read from the pages, a token sees exactly the packed keys and values of the positions
before it and its own, whatever the split, so vLLM's scheduling changes no output.

A policy with a recent window or KIVI's per-channel key groups keeps its full-precision positions in a window
cache beside the pages, which vLLM manages as a sliding-window layer (``window.py``); the write and the read then
take both (``pages.store_windowed``, ``pages.attention_windowed``: each token reads the store as it stood when it
was the newest, which again no split of the work changes).

A sliding-window layer (Gemma 3's local layers) keeps its window in packed pages too, of vLLM's sliding-window
kind, which vLLM frees behind the window; each query reads its window alone (``pages.attention_ragged``'s and
``attention_windowed``'s ``window``), never a freed page. Under a policy whose window cache is as long as the
sliding window it keeps vLLM's own cache, in pages padded to the packed ones (``_sliding_pages``).

Everything else is vLLM's: the scheduler, the metadata builder (query start offsets, sequence lengths, block
tables), sampling. Under ``Policy.full()``, or when no policy is named, every method is vLLM's own backend's --
the same pages, kernels and arithmetic -- so tokens and log probabilities are vLLM's exactly.

A vLLM backend is made kvcompile's by mixing ``KVCompileBackend`` into it, ``KVCompileImpl`` into its
implementation and ``KVCompileBuilder`` into its metadata builder (no CUDA graphs over the attention);
``cpu.py`` (vLLM's ``CPU_ATTN``) and ``cuda.py`` (``FLASH_ATTN``, ``TRITON_ATTN``) hold the ones
``kvcompile.vllm.register`` puts in vLLM's registry.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from kvcompile import pages
from kvcompile.policy import Policy

from .config import check_cuda_graphs, layout_for, policy_of, refuse, sliding_unpacked
from ..errors import Unimplemented

# a child of vLLM's own logger: said where vLLM says what it does, in its format (vLLM's "vllm" logger has the
# handler and does not propagate)
log = logging.getLogger("vllm.kvcompile")


class _Active:
    """The policy of the engine whose model this process built last, for ``customize_spec`` (a class method vLLM
    calls with a layer's spec and nothing else, after building the model; each layer's implementation keeps its
    own layout). Engines built one after another in one process each see their own."""

    policy: Policy | None = None
    # a per-layer policy: its cache groups may have pages of different sizes (packed pages, window caches,
    # sliding-window layers), which vLLM packs side by side in each block
    # (``KVCompileBackend.supported_kv_cache_layouts``)
    mixed: bool = False


_ACTIVE = _Active()
NULL_BLOCK = 0  # vLLM's null block (``BlockPool.null_block``, the first of the pool): a table entry with no page


_LAST: list = []  # [(metadata, its Ragged)]: the step's flat batches, made once for every layer


def ragged(meta) -> pages.Ragged:
    """The step's flat batch (``kvcompile.pages.Ragged``) from vLLM's attention metadata, made once per step: the
    layers of a cache group share one metadata object (two groups under a windowed policy: its packed pages and
    its window caches)."""
    for m, batch in _LAST:
        if m is meta:
            return batch
    batch = pages.Ragged.of(meta.query_start_loc, meta.seq_lens, meta.block_table)
    _LAST[:] = [(meta, batch)] + _LAST[:1]
    return batch


def _metadata(layer):
    """This step's attention metadata for ``layer`` (vLLM's forward context), or None (warm-up, profiling)."""
    from vllm.forward_context import get_forward_context
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # speculative decoding: [0] is the base model's
        meta = meta[0]
    if isinstance(meta, dict):
        meta = meta.get(layer.layer_name)
    return meta


class KVCompileImpl:
    """What kvcompile adds to a vLLM attention implementation (mixed in before it): the layout, chosen when the
    layer is built; the write; the read. With no layout every call is the vLLM implementation's own.

    vLLM's attention layer builds every backend's implementation with the same positional arguments
    (``Attention.__init__``), so one constructor serves them all."""

    layout: pages.PageLayout | None = None
    per_layer: Policy | None = None  # a policy with overrides: the layout is chosen by ``bind``
    window = None  # a windowed layout's window cache (window.py), attached when the layer is built
    windowed = False  # the layout keeps a window, or one a per-layer policy may give the layer does (window.attach)
    slide: int | None = None  # a sliding-window layer's window: in packed pages, or vLLM's own (``_sliding_pages``)
    said = False  # the engine's sliding-window layers said in the log (on the first of them)
    _recent = None  # (metadata, pages.Recent): the step's full-precision positions, from its store to its attention
    _bound = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None, **extra):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **extra)
        from vllm.config import get_current_vllm_config
        from vllm.v1.attention.backend import AttentionType
        cfg = get_current_vllm_config()
        policy = policy_of(cfg.additional_config)
        _ACTIVE.policy = policy
        _ACTIVE.mixed = policy is not None and bool(policy.overrides)
        if attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
            return  # no KV cache: vLLM's own
        if policy is not None and attn_type != AttentionType.DECODER and policy != Policy.full():
            refuse(f"an {attn_type} attention layer (cross-attention)", "use no kvcompile policy for this model")
        self._device = torch.device(cfg.device_config.device_type)
        # this layer's layout for a (resolved) policy
        self._layout_of = functools.partial(
            layout_for, heads=num_kv_heads, head_dim=head_size, dtype=cfg.model_config.dtype,
            block=cfg.cache_config.block_size, kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window,
            alibi=alibi_slopes is not None, softcap=logits_soft_cap or 0.0, sinks=extra.get("sinks") is not None,
            kv_sharing=kv_sharing_target_layer_name is not None)
        self.slide = None if sliding_window in (None, -1) else sliding_window
        if policy is not None and policy.overrides:
            # A policy per layer: which layer this is, vLLM says only when it asks the layer for its page
            # (``layer_spec``). Every policy the layers may get is checked now, so a refusal comes at start-up.
            lays = [self._layout_of(p) for p in policy.choices()]
            self.windowed = any(lay is not None and lay.window for lay in lays)
            quantizes = [lay is not None for lay in lays]
            self.per_layer = policy
        else:
            self.layout = self._layout_of(policy)
            self.windowed = self.layout is not None and bool(self.layout.window)
            quantizes = [self.layout is not None]
        if not any(quantizes):
            return
        if self._device.type == "cuda":
            check_cuda_graphs(cfg.compilation_config)
        if self.layout is not None:
            pages.prepare(self.layout, self._device)

    def bind(self, name: str, names: list[str]) -> None:
        """Choose this layer's layout from the per-layer policy: the layer ``name`` among the model's cached
        attention layers ``names`` (in order; what ``Policy.resolve`` takes). Once; later calls keep it."""
        if self.per_layer is None or self._bound:
            return
        policies = self.per_layer.resolve(names)
        self.layout = self._layout_of(policies[names.index(name)])
        self._bound = True
        if self.layout is not None:
            pages.prepare(self.layout, self._device)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.layout is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        meta = _metadata(layer)
        if meta is None:
            return
        T = meta.num_actual_tokens
        if self.layout.window:
            wmeta, wcache = self._window()
            recent = pages.store_windowed(self.layout, kv_cache, wcache, self.window.slots, key[:T], value[:T],
                                          ragged(meta), ragged(wmeta), ring=self.window.ring, null_page=NULL_BLOCK)
            self._recent = (meta, recent)  # what this step's attention reads in full precision
            return
        pages.store_ragged(self.layout, kv_cache, key[:T], value[:T], ragged(meta))

    def _window(self):
        """This step's metadata for the window cache's group, and its pages."""
        wmeta = _metadata(self.window)
        if wmeta is None:
            raise Unimplemented(f"kvcompile: no attention metadata for {self.window.layer_name} this step")
        return wmeta, self.window.kv_cache

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.layout is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise Unimplemented("kvcompile's vLLM backend does not quantize its output")
        if attn_metadata is None:  # warm-up
            return output
        T = attn_metadata.num_actual_tokens
        # every position is read from the pages, the queries' own too (stored by do_kv_cache_update): what a token
        # attends to is then the same however vLLM splits the work (a cached prefix, chunked prefill, a preempted
        # request recomputed), so those never change a request's output
        if self.layout.window:
            # each query reads the store as it stood when it was the newest token: the same whatever the split
            meta, recent = self._recent or (None, None)
            if meta is not attn_metadata:
                raise Unimplemented(f"kvcompile: {layer.layer_name} attends before storing this step's tokens")
            pages.attention_windowed(self.layout, kv_cache, query[:T], ragged(attn_metadata), recent, self.scale,
                                     out=output[:T], window=self.slide)
            self._recent = None
            return output
        pages.attention_ragged(self.layout, kv_cache, query[:T], None, None, ragged(attn_metadata), self.scale,
                               out=output[:T], window=self.slide)
        return output


class KVCompileBuilder:
    """What kvcompile adds to a vLLM attention metadata builder (mixed in before it): no CUDA graph support.
    kvcompile's cache write and attention read each step's batch on the host, so no graph may capture them;
    declared NEVER, vLLM's own resolution turns its default (full graphs for decode steps, piecewise ones for the
    rest) into piecewise graphs split at the write and the attention, which run eagerly between them
    (``config.check_cuda_graphs`` refuses the modes it cannot). Each backend names its builder
    (``KVCompileBackend.builder``); vLLM uses it only under a quantizing policy."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        from vllm.v1.attention.backend import AttentionCGSupport
        return AttentionCGSupport.NEVER


def cached_layers(vllm_config) -> list[str]:
    """The names of the model's attention layers kvcompile's implementations serve, in the model's order (vLLM
    registers each layer as it is built): the whole model's, under pipeline parallelism too, where this process
    built only its stage's layers -- so a per-layer policy's selectors name the same layers on every stage."""
    names = [name for name, impl in _impls(vllm_config).items() if impl.per_layer is not None]
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    if parallel.pipeline_parallel_size == 1:
        return names
    one_each = not (model.is_hybrid or model.has_noops or model.is_attention_free)
    return whole_model(names, *model.get_layers_start_end_indices(parallel), model.get_total_num_hidden_layers(),
                       one_each)


def whole_model(names: list[str], start: int, end: int, total: int, one_each: bool = True) -> list[str]:
    """The attention layer names of a model of ``total`` decoder layers, from ``names``, those of a pipeline stage
    holding its layers ``start .. end - 1``, each named by its layer's index (``model.layers.17.self_attn.attn``):
    every layer's name, its index in place of the stage's. Refused (``Refused``) where the model is not one
    attention layer per decoder layer (``one_each``, vLLM's word for it) or the names do not say their layer."""
    def index(name):
        ints = [i for i, part in enumerate(name.split(".")) if part.isdigit()]
        return ints[0] if len(ints) == 1 else None

    at = [index(n) for n in names]
    whole = []
    if one_each and names and None not in at:
        parts = names[0].split(".")
        whole = [".".join(parts[:at[0]] + [str(i)] + parts[at[0] + 1:]) for i in range(total)]
    if whole[start:end] != names:
        refuse(f"a per-layer policy under pipeline parallelism, where this stage holds decoder layers {start} .. "
               f"{end - 1} of {total} and its attention layers are {names[:3]}{' ...' if len(names) > 3 else ''}: "
               "kvcompile names the model's attention layers from one per decoder layer, each by its index",
               "use one policy for every layer, or pipeline_parallel_size=1 (tensor parallelism keeps every layer)")
    return whole


def layer_spec(layer, spec, vllm_config):
    """The spec of one attention layer (vLLM's ``Attention.get_kv_cache_spec``, which ``kvcompile.vllm.register``
    wraps), with its own page under a per-layer policy: the layer's layout is chosen here, where vLLM first names
    the layer, and its page declared as ``customized`` declares a uniform policy's. vLLM keeps layers of one kind
    with pages of different sizes in one group, each layer's tensor of its own page size."""
    impl = getattr(layer, "impl", None)
    if spec is None or not isinstance(impl, KVCompileImpl):
        return spec
    if impl.per_layer is not None:  # every layer's layout chosen at once: a layer's page may depend on the others'
        names = cached_layers(vllm_config)
        for name, other in _impls(vllm_config).items():
            other.bind(name, names)
    if impl.slide is not None and impl.layout is None:
        return _sliding_pages(layer, spec, vllm_config)
    if impl.slide is not None:  # its window in packed pages, which vLLM frees behind it
        impls = _impls(vllm_config)
        sliding = [n for n, i in impls.items() if i.slide is not None and i.layout is not None]
        if layer.layer_name == sliding[0] and not impl.said:  # once an engine
            impl.said = True
            log.info("kvcompile: %d of %d attention layers have a sliding window (%d tokens); they keep it in packed "
                     "pages of %s too, which vLLM frees behind the window", len(sliding), len(impls), impl.slide,
                     impl.layout.policy if impl.per_layer is None else "each one's policy")
        return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=impl.layout.token_head_bytes)
    if impl.per_layer is None:
        return spec
    if impl.layout is None:  # this layer in full precision: vLLM's own page
        return spec
    return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=impl.layout.token_head_bytes)


def _impls(vllm_config) -> dict:
    """The model's attention layers kvcompile's implementations serve, by name, in the model's order."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {n: m.impl for n, m in ctx.items() if isinstance(getattr(m, "impl", None), KVCompileImpl)}


def block_for(layout: pages.PageLayout, nbytes: int) -> int:
    """The smallest power-of-two block size (tokens a page) whose packed pages of ``layout``'s layer hold ``nbytes``:
    what a refusal names when full-precision tokens beside the packed pages outgrow one (``_sliding_pages``,
    ``window.window_block``)."""
    need = -(-nbytes // (layout.heads * layout.token_head_bytes))
    return 1 << (need - 1).bit_length()


def _sliding_pages(layer, spec, vllm_config):
    """A sliding-window layer's spec under a policy whose window cache cannot serve it (``config.sliding_unpacked``:
    one as long as the sliding window), or a per-layer policy that keeps it in full precision: vLLM's own cache
    (only its window), beside the other layers' packed pages. vLLM keeps one page size per pool, so its pages hold
    the most tokens (a power of two its kernels take) whose page fits the packed page, padded to it -- under a
    per-layer policy (block-outermost: ``_Active.mixed``) unpadded, fitting a block of the full-attention layers'
    pages (``block_bytes``) in the groups vLLM cuts such layers into, of the size whose groups take the fewest
    blocks for a request's window; where none fits, refused naming the block size that would. Said once in the
    log; refused when no layer holds packed pages (the policy would apply to none)."""
    policy = _ACTIVE.policy
    if policy is None or policy == Policy.full():
        return spec
    from vllm.v1.attention.backend import MultipleOf
    impls = _impls(vllm_config)
    own = [n for n, i in impls.items() if i.slide is not None and i.layout is None]
    packed = [i.layout for i in impls.values() if i.layout is not None]
    fix = ("a per-token policy (int8, fp8-tensor+rot, tok+rot:4, ...) or a window shorter than the sliding window "
           "(e.g. kivi-r0+rot+fp8s:4), which keep sliding windows in packed pages")
    if not packed:
        refuse(f"every attention layer of this model has a sliding window, which {policy} leaves in vLLM's own "
               f"cache (its window cache is as long as the sliding window), so it would apply to no layer",
               f"use {fix}, start vLLM with disable_sliding_window=True (--disable-sliding-window: full attention "
               f"over max_model_len, no longer than the window), or use no kvcompile policy")
    if layer.layer_name == own[0] and not layer.impl.said:  # once an engine
        layer.impl.said = True
        if _ACTIVE.mixed:
            log.info("kvcompile: %d of %d attention layers have a sliding window and keep vLLM's own cache (only their "
                     "window): %s gives them full precision, or a window cache as long as the sliding window",
                     len(own), len(impls), policy)
        else:
            log.info("kvcompile: %d of %d attention layers have a sliding window and keep vLLM's own cache (only "
                     "their window), in pages sized to the packed pages of the other layers, which hold %s: it has "
                     "%s. For them use %s", len(own), len(impls), policy, sliding_unpacked(packed[0], layer.impl.slide),
                     fix)
    lay, block = packed[0], packed[0].block  # one policy: every packed page is alike
    # under a per-layer policy vLLM packs each block with one page of every layer, each of its own size (BLHNC):
    # these layers' pages fit a block beside the others; else each page is padded to the packed page
    room, repeats = lay.page_bytes, None
    if _ACTIVE.mixed:
        # vLLM cuts these layers into cache groups that fit a block (one page of each a block), or, where the
        # full-attention layers' pages repeat a pattern of sizes, into groups of as many layers as it repeats
        repeats = pattern(vllm_config)
        room = block_bytes(vllm_config) // min(len(own), repeats or 1)
    kernel = layer.get_attn_backend().get_supported_kernel_block_sizes(spec)
    takes = lambda t: any(t % k.base == 0 if isinstance(k, MultipleOf) else t == k for k in kernel)  # noqa: E731
    sizes = [1 << i for i in range(block.bit_length()) if takes(1 << i)]
    page = lambda t: dataclasses.replace(spec, block_size=t).page_size_bytes  # noqa: E731
    fit = [t for t in sizes if page(t) <= room]
    if _ACTIVE.mixed and repeats is None and fit:
        # the fewest blocks a request's window takes over all the groups: pages of t tokens, room // page(t) layers
        # a group (ties: the larger pages)
        cost = lambda t: (-(-len(own) // (room // page(t))) * (-(-(layer.impl.slide - 1) // t) + 1), -t)  # noqa: E731
        fit = [min(fit, key=cost)]
    if not fit:
        least = min(sizes or [spec.block_size])
        need = block_for(lay, page(least)) if not _ACTIVE.mixed else block << (-(-page(least) // room) - 1).bit_length()
        where = (f"in pages the size of {policy}'s packed pages, and a packed page of {lay.block} tokens "
                 f"({lay.page_bytes} bytes)" if not _ACTIVE.mixed else
                 f"beside the other layers' pages in each of vLLM's blocks, and a block of {block} tokens has "
                 f"{room} bytes for each, which")
        refuse(f"the model's sliding-window layers keep vLLM's own cache {where} holds fewer than {least} of "
               f"their tokens", f"start vLLM with block_size={need} (--block-size {need}) or larger")
    return dataclasses.replace(spec, block_size=max(fit), page_size_padded=None if _ACTIVE.mixed else lay.page_bytes)


def pattern(vllm_config) -> int | None:
    """How many times the full-attention layers' pages repeat a pattern of sizes (as many layers of each of two or
    more sizes), where they do: vLLM then cuts every other kind of cache into groups of as many layers
    (``kv_cache_utils._get_packed_kv_cache_groups``); else None."""
    from collections import Counter
    sizes = Counter(page_of(i, vllm_config) for i in _impls(vllm_config).values() if i.slide is None)
    return next(iter(sizes.values())) if len(sizes) > 1 and len(set(sizes.values())) == 1 else None


def block_bytes(vllm_config) -> int:
    """Bytes of one of vLLM's blocks under a per-layer policy (``_Active.mixed``: vLLM's block-outermost layout):
    the full-attention layers' pages side by side, one group; vLLM cuts every other kind of cache (sliding-window
    layers, window caches) into groups that fit such a block (``kv_cache_utils._get_packed_kv_cache_groups``), or
    where no layer has full attention, the largest page."""
    impls = _impls(vllm_config).values()
    return sum(page_of(i, vllm_config) for i in impls if i.slide is None) or \
        max(page_of(i, vllm_config) for i in impls)


def page_of(impl, vllm_config) -> int:
    """Bytes of one page of ``impl``'s layer at the engine's block size: its packed page, or vLLM's own (keys and
    values in the model's dtype) for a layer kept in full precision."""
    if impl.layout is not None:
        return impl.layout.page_bytes
    block = vllm_config.cache_config.block_size
    return 2 * impl.num_kv_heads * impl.head_size * vllm_config.model_config.dtype.itemsize * block


def customized(spec, backend_customize):
    """``spec`` as vLLM's backend would give it, then made kvcompile's page (uint8, ``state_content_bytes`` per
    kv head and token) when this process's engine named a quantizing policy (a per-layer policy's pages are
    declared per layer, by ``layer_spec``)."""
    spec = backend_customize(spec)
    policy = _ACTIVE.policy
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    if policy is None or policy == Policy.full() or policy.overrides or spec.state_content_bytes is not None \
            or not isinstance(spec, FullAttentionSpec):  # a window cache (window.py), a sliding window: vLLM's own
        return spec
    dtype = spec.dtype
    lay = pages.PageLayout(policy, spec.num_kv_heads, spec.head_size, dtype, spec.block_size,
                           window=pages.needs_window(policy))
    return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=lay.token_head_bytes)


class KVCompileBackend:
    """What kvcompile adds to a vLLM attention backend (mixed in before it): its spec is kvcompile's page when a
    quantizing policy is named (``customized``). Each backend's class also names its implementation
    (``get_impl_cls``: vLLM's with ``KVCompileImpl`` mixed in) and its metadata builder (``builder``: vLLM's with
    ``KVCompileBuilder``); its name (``get_name``) stays vLLM's backend's, which vLLM looks backends up by."""

    @classmethod
    def customize_spec(cls, spec):
        return customized(spec, super().customize_spec)

    builder: type | None = None  # vLLM's backend's metadata builder with ``KVCompileBuilder`` mixed in

    @classmethod
    def get_builder_cls(cls):
        """vLLM's backend's metadata builder, or under a quantizing policy ``builder``, the same declaring no CUDA
        graph support (``KVCompileBuilder``). vLLM asks once the model is built (``_Active``)."""
        if _ACTIVE.policy is None or _ACTIVE.policy == Policy.full():
            return super().get_builder_cls()
        return cls.builder

    @classmethod
    def supported_kv_cache_layouts(cls):
        """vLLM's backend's, except under a per-layer policy, whose cache groups may have pages of different sizes
        (``_Active``): then vLLM's block-outermost layout, in which each block holds one page of every layer side
        by side, each of its own size (a layer's pages are then a block apart: ``pages`` reads them at any stride,
        vLLM's CPU kernel too). vLLM asks once the model is built."""
        if not _ACTIVE.mixed:
            return super().supported_kv_cache_layouts()
        from vllm.v1.kv_cache_layout import KVCacheLayout
        return (KVCacheLayout.BLHNC,)

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None):
        """vLLM's backend's, except for a window cache's pages, which only kvcompile's code reads: any multiple of
        ``window.WINDOW_BASE`` tokens."""
        from .window import WINDOW_BASE, WindowSpec
        if isinstance(kv_cache_spec, WindowSpec):
            from vllm.v1.attention.backend import MultipleOf
            return [MultipleOf(WINDOW_BASE)]
        return super().get_supported_kernel_block_sizes(kv_cache_spec)
