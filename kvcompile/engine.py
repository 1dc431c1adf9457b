"""transformers' continuous-batching engine over kvcompile's packed store: the classes ``kvcompile.serving`` runs.

- ``PagedKVCompileCache``: transformers' ``PagedAttentionCache`` whose pages are blocks of kvcompile's pools
  (its own tensor lives on the ``meta`` device); each request holds a slot (a row of every layer's store).
- ``paged_attention``: the attention (``kvcompile_paged``, registered with transformers' ``AttentionInterface``)
  of an eager continuous-batching forward: each request's queries over its row of the layer's store. The cache
  that stored a layer's keys hands itself to that layer's attention in the keyword arguments transformers passes
  from ``Cache.update`` to the attention function (``CACHE_KWARG``).
- ``KVCompileBatchingManager``: transformers' ``ContinuousBatchingManager`` that builds that cache and switches
  the model's attention while it runs; ``KVCompileOffloading``: its offloading of evicted requests, packed.
- ``KVCompileMemoryHandler``: transformers' check of what its cache takes against the free memory, counting only
  what transformers still allocates beside kvcompile's pools.

How they fit, and what is refused: ``kvcompile.serving``'s docstring. transformers builds its cache's parts and
its cache by module-level name (``PagedAttentionMemoryHandler``, ``PagedAttentionCache``): the two are swapped in
for the one call that builds ours (``_swapped``), under a lock.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import threading
import warnings
import weakref

import torch
from transformers import AttentionInterface
from transformers.generation.configuration_utils import CompileConfig
from transformers.generation.continuous_batching import cache as tcache
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                         ContinuousBatchProcessor)
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

from . import ops, paged_ops, standin
from .backend import Options, compile_graph, kvcompile_backend
from .errors import UnsupportedError
from .pool import (DEFAULT_BUDGET, ServingOptions, full_precision_bytes_per_token, layer_specs, make_stores,
                   pool_blocks, quantizes, request_limit, request_pages, shareable_tokens, shares_pages, slots_for)
from .sampling import PROMPT_ROWS, Requests
from .scheduler import SCHEDULERS
from .store import LayerSpec, state_nbytes
from .window import WindowRing, WindowSpec, window_attention

ATTN = "kvcompile_paged"  # the attention implementation an eager continuous-batching forward runs
CACHE_KWARG = "kvcompile_cache"  # the keyword by which a layer's attention receives the cache that stored its keys
WARMUP_PREFIX = "__warmup_"  # transformers' warmup request ids (continuous_batching.requests)
# transformers' update is wrapped in torch.compiler.disable; the compiled path traces the function itself
_BASE_UPDATE = inspect.unwrap(tcache.PagedAttentionCache.update)


# --------------------------------------------------------------------------- the batch
class _Plan:
    """One forward's ragged batch: requests in order, in groups (one kernel call per group): the decoding requests
    together, each prefill chunk alone.
    ``entries``: (request_id, slot, past, n, skip); a skipped entry (a warmup request of a compiled forward)
    takes its ``n`` rows of the batch but is neither stored nor attended (its rows stay zeros)."""

    def __init__(self, entries, slots, device):
        self.entries = entries
        self.total = sum(e[3] for e in entries)
        groups, start = {}, 0
        for _, slot, _, n, skip in entries:
            if not skip:
                # decode rows attend together (the C kernel computes each row alone); a prefill chunk attends
                # alone: attention over a group pads its rows to the longest, and a row would get other bits
                # beside others than alone (docs/usage.md, "What a batch changes")
                groups.setdefault((n, None if n == 1 else slot), []).append((slot, start))
            start += n
        self.groups = []
        for (n, _), members in groups.items():
            members.sort()  # by slot: rows that are a range of slots are read and written in place (append_rows)
            rows = [slot for slot, _ in members]
            idx = [t for _, s0 in members for t in range(s0, s0 + n)]
            self.groups.append((n, torch.tensor(rows, dtype=torch.long, device=device),
                                torch.tensor(idx, dtype=torch.long, device=device)))
        self.counts = [0] * slots  # new tokens per slot
        self.past = [0] * slots    # tokens each slot's request had before
        for _, slot, past, n, skip in entries:
            if not skip:
                self.counts[slot], self.past[slot] = n, past
        self.complete = all(not e[4] for e in entries)


def _gather(x: torch.Tensor, idx: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """``x [1, H, T, D]`` -> ``[rows, H, n, D]``: the tokens ``idx`` (rows x n, request by request)."""
    H, D = x.shape[1], x.shape[3]
    return x[0].index_select(1, idx).view(H, rows, n, D).transpose(0, 1).contiguous()


def _prompt_places(paged_cache) -> list[tuple[int, str, int]]:
    """The rows of the forward about to run whose logits give a prompt token's log probability, for requests
    that ask for them (``PagedKVCompileCache.prompt_rows``): ``(row, the request's id, the place in its prompt
    of the token the row predicts)``. Eager forwards only (a compiled one has a static shape)."""
    if paged_cache.compiled or not paged_cache._pending:
        return []
    out, row = [], 0
    for rid, past, n in paged_cache._pending:
        if asked := paged_cache.prompt_rows(rid):
            out += [(row + j, rid, past + j + 1) for j in range(n) if past + j + 1 < asked]
        row += n
    return out


def _paged_layers(config):
    """The model's text config as transformers' page accounting should see it: every layer in pages of the one
    full-attention allocator. kvcompile's pools hold the full-attention layers; a sliding-window layer's tokens
    are in the slots' rings (``kvcompile.window``), so transformers allocates no pages of its own for them."""
    types = getattr(config, "layer_types", None)
    if types is None or set(types) == {"full_attention"}:
        return config
    view = copy.copy(config)
    view.layer_types = ["full_attention"] * len(types)
    return view


class _OneRank:
    """transformers' ``DistributedHelper`` as ``PagedAttentionCache.__init__`` reads it, for one rank."""

    tp_size = 1


# --------------------------------------------------------------------------- the cache
class KVCompileMemoryHandler(tcache.PagedAttentionMemoryHandler):
    """transformers' ``PagedAttentionMemoryHandler``, which checks the cache's footprint against the free memory,
    for a cache whose pages are kvcompile's: the pages' bytes are in kvcompile's budget (transformers' tensor is
    on the ``meta`` device), and the read back of the cache is no full-precision copy (the attention reads the
    packed rows); what transformers still allocates is counted -- the per-batch-token inputs and activations,
    the read indices, and, for a ``compiled`` forward (transformers' SDPA traced), its ragged attention mask
    (``[max_batch_tokens, max_tokens_read + max_batch_tokens]`` in the model dtype, ``max_tokens_read`` the
    pages' tokens and the slots' ``window_tokens``). Eager, the ``kvcompile_paged`` attention takes no mask and
    transformers allocates none."""

    def __init__(self, *args, compiled: bool, window_tokens: int, **kwargs):
        self.compiled, self.window_tokens = compiled, window_tokens  # (before transformers' __init__ sizes anything)
        super().__init__(*args, **kwargs)
        self.trash_bytes = 0  # the trash sectors are on the meta device too

    @property
    def bytes_per_cache_sector(self) -> int:
        return self.tokens_per_sector * self.io_multiplier * self.num_groups * 8  # read_index (int64)

    def attention_mask_bytes(self, max_batch_tokens: int, num_sectors: int) -> int:
        if not self.compiled:
            return 0
        per_token = self.io_multiplier * self.num_attention_masks * self.activation_dtype.itemsize
        return (super().attention_mask_bytes(max_batch_tokens, num_sectors)
                + per_token * max_batch_tokens * self.window_tokens)


SWAP = threading.RLock()  # held while a transformers name is swapped (below), and while transformers' own
                           # cache is built beside (``capacity``), so that it never sees a swapped name


def all_exact(specs) -> bool:
    """Every layer stored exactly (``Policy.full()``) in the pages, so transformers' own SDPA can read them back
    (``PagedKVCompileCache.read_exact``). A sliding-window layer (``WindowSpec``) has no pages and no policy: a
    model with one takes kvcompile's attention, as before that path."""
    return all(isinstance(s, LayerSpec) and s.policy.exact for s in specs)


def _mask_blocks(cbc, dtype: torch.dtype, page_size: int, budget: int) -> int:
    """The pages whose tokens transformers' ragged mask ``[max_batch_tokens, pages x page_size + max_batch_tokens]``
    (one, in ``dtype``) can read with its pages' columns costing at most the cache's ``budget`` (the batch's own
    ``max_batch_tokens`` columns come on top, as in transformers' engine), and the whole mask at most half of the
    memory transformers counts as available for its cache."""
    from transformers.generation.continuous_batching.requests import get_device_and_memory_breakdown

    _, total, reserved, allocated = get_device_and_memory_breakdown()
    available = (total - max(allocated, reserved)) * (cbc.max_memory_percent or 0.9)
    m = cbc.max_batch_tokens or tcache.PagedAttentionMemoryHandler._default_max_batch_tokens
    tokens = min(available / 2 / (m * dtype.itemsize) - m, budget / (m * dtype.itemsize))
    return max(1, int(tokens // page_size))


@contextlib.contextmanager
def _swapped(module, name: str, value):
    """``module.name`` is ``value`` for the block (transformers builds its cache's parts by module-level name)."""
    with SWAP:
        orig = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, orig)


class PagedKVCompileCache(tcache.PagedAttentionCache):
    """transformers' ``PagedAttentionCache`` whose pages are kvcompile blocks: see ``kvcompile.serving``."""

    def __init__(self, config, continuous_batching_config, device, distributed_helper, dtype=torch.float16,
                 model_supports_logits_to_keep=False, *, specs: list[LayerSpec], slots: int, blocks: int,
                 compiled: bool = False, max_tokens: int | None = None, requests: Requests | None = None):
        # transformers' own tensor is only counted, never used: it lives on the meta device
        # transformers builds its page accounting for this rank alone: its heads are counted in kvcompile's
        # specs (the rank's own), and its sizes come from the budget, the same on every rank (checked below;
        # its own check all-reduces a tensor on the cache's device, which is meta here)
        window = slots * max(s.ring + s.sink for s in specs)  # tokens the slots hold outside the pages
        # every layer exact (Policy.full()): transformers' own SDPA reads the pages back through its read
        # indices, as from its own cache (``read_exact``), under its ragged mask -- its arithmetic, bit for bit
        self.exact, self.quantized = all_exact(specs), quantizes(specs)
        sdpa = compiled or self.exact  # transformers' SDPA runs, and so allocates its mask
        try:
            with _swapped(tcache, "PagedAttentionMemoryHandler",
                          functools.partial(KVCompileMemoryHandler, compiled=sdpa, window_tokens=window)):
                super().__init__(_paged_layers(config), continuous_batching_config, "meta", _OneRank(), dtype,
                                 model_supports_logits_to_keep)
        except MemoryError as e:
            cbc = continuous_batching_config
            m = cbc.max_batch_tokens or tcache.PagedAttentionMemoryHandler._default_max_batch_tokens
            mask = m * (blocks * cbc.page_size + window + m)
            raise UnsupportedError(
                f"kvcompile serving: what transformers allocates beside kvcompile's cache does not fit in free "
                f"memory ({e}): "
                + (f"a compiled forward's attention mask takes max_batch_tokens x (pages x page_size + the "
                   f"slots' windows + max_batch_tokens) = {m} x ({blocks} x {cbc.page_size} + {window} + {m}) "
                   f"= {mask:,} elements; lower "
                   f"max_batch_tokens in the ContinuousBatchingConfig, or the cache budget "
                   f"(kvcompile.serving.configure(model, budget=...))" if compiled else
                   f"lower max_batch_tokens in the ContinuousBatchingConfig (now {m})")) from e
        self.device = torch.device(device)
        if distributed_helper.tp_size > 1:
            sizes = torch.tensor([self.max_batch_tokens, self.num_sectors, blocks, slots], device=self.device)
            agreed = sizes.clone()
            distributed_helper.tp_all_reduce_min(agreed)
            if not torch.equal(agreed, sizes):
                raise UnsupportedError(
                    f"kvcompile serving: the tensor-parallel ranks sized their caches differently (this rank: "
                    f"{sizes.tolist()}, the least: {agreed.tolist()} as max_batch_tokens, sectors, blocks, "
                    f"slots); give every rank the same budget and ContinuousBatchingConfig")
        if set(self.cache_allocators) != {tcache.FULL_ATTENTION}:
            raise UnsupportedError(f"kvcompile serving: transformers made the page allocators "
                                   f"{sorted(self.cache_allocators)}, where kvcompile's pages hold full-attention "
                                   f"layers only (_paged_layers)")
        allocator = self.cache_allocators[tcache.FULL_ATTENTION]
        if self.num_blocks != blocks or allocator.num_blocks != blocks:
            raise UnsupportedError(f"kvcompile serving: transformers made {self.num_blocks} pages where the pool "
                                 f"has {blocks} blocks")
        self.max_decode_fast_path_length = 0  # no block tables: attention reads kvcompile's own
        self.specs, self.slots, self.blocks = specs, slots, blocks  # blocks: of each paged layer's pool
        # the options of the requests a server runs (``sampling.Requests``: its manager's): prompt log probabilities
        self.requests = requests if requests is not None else Requests()
        self.stores = make_stores(specs, slots, blocks, self.device, max_tokens)
        # transformers' allocator hands out the pages and shares or frees them; page p is block p - first
        # of every layer's pool (its page ids start after the pool's reserved sectors)
        self._allocator = allocator
        self._first_page = self.pool.num_reserved_sectors * allocator.blocks_per_sector
        # a request holds the pages its store writes (request_pages): transformers' allocator counts them
        # so, and its scheduler's budget of tokens read per forward (the pages' tokens in its own cache)
        # counts the slots' windows and sinks too
        allocator._compute_blocks_needed = lambda allocated, past, query: max(
            0, request_pages(specs, past + query) - allocated)
        self.max_tokens_read = blocks * allocator.tokens_per_page + window
        self.prefix_tokens = 0  # prompt tokens found in shared pages (not computed again)
        for st in self.stores:
            st.engine_owns_blocks()
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(slots - 1, -1, -1))
        self.keep_freed: dict | None = None  # while transformers evicts requests: the rows it frees
        self._pending: list = []
        self._scheduler = None  # transformers' scheduler of this cache (a weak reference): its requests
        self._plan: _Plan | None = None
        self._work: dict = {}
        # compiled: the forward is traced by Dynamo with transformers' own paged update and SDPA, over
        # stand-ins of the page pool's views that kvcompile's pass rewrites (see _compiled_views)
        self.compiled = compiled
        if compiled:
            self._compiled_views()

    def _compiled_views(self) -> None:
        """Replace each layer's page-pool views (``FullAttentionCacheAllocator._kv_token_views``, ``[N, H, D]``
        on ``meta`` here) by stand-ins registered to this cache and layer: transformers' ``update`` then traces
        into writes and reads of the stand-ins, which ``kvcompile.passes.paged`` rewrites into
        ``kvcompile.paged_ops``. A stand-in is one token row ``[1, H, D]`` over ``H + D - 1`` elements: what
        the graph does with the pool (``index_copy_``/``index_select`` along dim 0) does not depend on ``N``
        when traced, every such use is rewritten (or the pass refuses the graph), and the rewritten ops never
        touch the stand-in; a stand-in of ``N`` rows would cost ``N`` elements per layer, and ``N`` grows
        with the pool and the number of layers."""
        allocator = self.cache_allocators[tcache.FULL_ATTENTION]
        for layer_idx, (kv, vv) in list(allocator._kv_token_views.items()):
            heads = self.specs[layer_idx].heads  # the rank's (transformers' views count every head: _OneRank)
            k = standin.make_standin((1, heads, kv.shape[2]), kv.dtype, self.device)
            v = standin.make_standin((1, heads, vv.shape[2]), vv.dtype, self.device)
            paged_ops.register(k, v, self, layer_idx)
            allocator._kv_token_views[layer_idx] = (k, v)
        allocator._kv_page_views = {}  # no block-table decode path (max_blocks_per_request=0)

    @property
    def standin_nbytes(self) -> int:
        """Bytes of the compiled forward's stand-ins of transformers' page pool (0 when eager)."""
        if not self.compiled:
            return 0
        views = self.cache_allocators[tcache.FULL_ATTENTION]._kv_token_views.values()
        return sum(t.untyped_storage().nbytes() for kv in views for t in kv)

    # ---- sizes
    @property
    def allocated_nbytes(self) -> int:
        """Bytes of every tensor the stores allocated (pools, rings, sinks, lengths, tables)."""
        return sum(state_nbytes(st.state) for st in self.stores)

    @property
    def free_blocks_count(self) -> int:
        """Pages no running request holds: free in transformers' pool, or kept only as a cached prompt prefix
        (evicted as soon as a request needs the page). Every layer's pool has the same count."""
        a = self._allocator
        return (self.pool.count_free_blocks(a.index) + self.pool.num_free_sectors * a.blocks_per_sector
                + len(a.ledger.cached_blocks))

    def _blocks(self, pages) -> list[int]:
        """transformers' page ids as blocks of the stores' pools."""
        return [p - self._first_page for p in pages]

    def _table(self, request_id: str) -> list[int]:
        """The request's pages, as blocks of the stores' pools."""
        return self._blocks(self._allocator.block_table.get(request_id, ()))

    # ---- slots
    def _take_slot(self, request_id: str) -> int:
        slot = self.free_slots.pop()
        self.slot_of[request_id] = slot
        return slot

    def _drop(self, request_id: str) -> None:
        """Clear the request's row. The request in the highest held slot moves into it (its blocks are
        shared, then released: only its ring and sinks are copied), so held slots stay 0..n-1 and a
        batch of every running request reads the stores' rows in place."""
        slot = self.slot_of.get(request_id)
        if slot is None:
            return
        last = max((s for r, s in self.slot_of.items() if r != request_id), default=-1)
        if last > slot:
            mover = next(r for r, s in self.slot_of.items() if s == last)
            for st in self.stores:
                st.fork(last, slot)
                st.clear([last])
            self.slot_of[mover] = slot  # before the request leaves: a reader never sees it gone, unmoved
            slot = last
        else:
            for st in self.stores:
                st.clear([slot])
        del self.slot_of[request_id]
        self.free_slots.append(slot)
        self.free_slots.sort(reverse=True)  # the lowest free slot is taken next

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        new = state.request_id not in self.slot_of
        if new and not self.free_slots and state.request_id != "":
            return False  # every slot is held: the request waits, as for pages
        ok = super().can_store_request_tokens(state, request_len, dry_run)
        if ok and new and not dry_run and state.request_id != "":
            self._take_slot(state.request_id)
        return ok

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        slot = self.slot_of.get(request_id)
        if self.keep_freed is not None and slot is not None:  # an eviction that may offload the request:
            # its row copied to host memory now (its pages are handed out again, its slot moved into)
            self.keep_freed[request_id] = [st.save(slot, "cpu") for st in self.stores]
        super().free_blocks(request_id, no_cache)
        self._drop(request_id)

    def restore(self, request_id: str, rows: list) -> None:
        """An offloaded request comes back (``KVCompileOffloading``): each layer's saved row into the slot
        and the pages transformers gave it for this forward."""
        slot, table = self.slot_of[request_id], self._table(request_id)
        for st, row in zip(self.stores, rows):
            st.restore(slot, row, table)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        for rid in list(self.slot_of):
            self._drop(rid)
        self._pending, self._plan, self._work = [], None, {}

    def prompt_rows(self, request_id: str) -> int:
        """How many of the request's prompt tokens have their log probabilities asked (0: none), by what the
        request carries (``sampling.PROMPT_ROWS``): under tensor parallelism every rank's engine has the
        request, and so keeps the same rows, though only rank 0 records them."""
        sched = None if self._scheduler is None else self._scheduler()
        if sched is None:
            return 0
        state = sched.active_requests.get(request_id) or sched.waiting_requests.get(request_id)
        return 0 if state is None else int(state.logit_processor_kwargs.get(PROMPT_ROWS, 0))

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """transformers' prefix match (pages of an earlier request whose tokens begin this prompt); the request
        starts with those pages and their length in its row. Only with a free slot: a matched request holds
        its pages while it waits, so one that would wait for a slot stays unmatched until it gets one."""
        if request_id not in self.slot_of and not self.free_slots:
            return 0
        if self.prompt_rows(request_id):
            return 0  # its prompt's log probabilities are asked: every prompt token is computed
        if self.quantized:  # only pages it would have computed itself (see shareable)
            shareable = self.shareable(prompt_ids)
            if not shareable:
                return 0
            prompt_ids = prompt_ids[:shareable + 1]  # transformers matches the pages before the last token
        n = super().search_prefix_match(request_id, prompt_ids)
        if n:
            self.prefix_tokens += n
            slot = self.slot_of.get(request_id)
            slot = self._take_slot(request_id) if slot is None else slot
            for st in self.stores:
                st.set_tables({slot: self._table(request_id)})
                st.set_length(slot, n)
        return n

    def shareable(self, prompt_ids: list[int]) -> int:
        """Under a quantized policy, the tokens of ``prompt_ids`` a request may take from shared pages: those it
        would have computed itself (``pool.shareable_tokens``). Only pages that prompts' pieces completed are
        shared (``count_new_complete_blocks``): a decoded token was computed reading its predecessors as stored,
        where a prompt's piece reads them in full precision."""
        matched = min(len(a.match_prefix_blocks(prompt_ids)) * a.tokens_per_page
                      for a in self.cache_allocators.values())
        page = math.lcm(*(a.tokens_per_page for a in self.cache_allocators.values()))
        return shareable_tokens(matched, page, self.max_batch_tokens)

    def count_new_complete_blocks(self, state, request_len: int) -> dict[str, int]:
        if self.quantized and state.generated_tokens:  # a decode step's page is never shared (see shareable)
            return {}
        return super().count_new_complete_blocks(state, request_len)

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst):
        src = self.slot_of[src_state.request_id]
        forked = super().prepare_fork_request(src_state, list(dst_req_ids)[:len(self.free_slots)],
                                              copy_src_and_dst)
        for rid in forked:
            dst = self._take_slot(rid)
            for st in self.stores:
                st.fork(src, dst)  # length, ring and sinks
                st.set_tables({dst: self._table(rid)})  # its own pages: shared ones and copies
        return forked

    def perform_cache_copy(self, copy_src_and_dst) -> None:
        """The forks' pages that transformers does not share are copied, block by block, in every layer."""
        for src, dst in copy_src_and_dst.values():
            src, dst = self._blocks(src), self._blocks(dst)
            for st in self.stores:
                st.copy_blocks(src, dst)

    # ---- the forward (the applied model hands it to the cache: extension.ForwardOwner)
    def kvcompile_forward(self, forward, /, *args, **kwargs):
        """The applied model's forward when transformers' continuous batching calls it: eager (``update`` and
        the ``kvcompile_paged`` attention do the work) or traced by the compiled CB forward. A request whose
        prompt's log probabilities are asked has the rows of its prompt's logits recorded (``_prompt_places``)."""
        wanted = _prompt_places(self)
        if not wanted:
            return forward(*args, **kwargs)
        keep = kwargs.get("logits_to_keep")
        rows = torch.tensor([i for i, _, _ in wanted])
        if isinstance(keep, torch.Tensor):  # the head runs on the kept rows and the prompt's rows, then they part
            out = forward(*args, **{**kwargs, "logits_to_keep": torch.cat([keep, rows.to(keep.device)])})
            logits, out.logits = out.logits[0, len(keep):], out.logits[:, :len(keep)]
        else:  # the head ran on every row; the engine picks its own
            out = forward(*args, **kwargs)
            logits = out.logits[0, rows.to(out.logits.device)]
        for row, (_, rid, place) in zip(logits, wanted):
            options = self.requests.of(rid)  # None on the other ranks, or once its reply is gone
            if options is not None and options.asked is not None:
                options.asked.took_prompt(place, row)
        return out

    # ---- the batch
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
        # Record the batch: kvcompile's attention reads each request's row of the store. Eager: no indices.
        # Compiled: indices of transformers' lengths, which the traced graph takes (the rewritten ops ignore
        # their values; transformers' own would point into pages a windowed request does not hold)
        self._pending.append((request_id, past_length, query_length))
        if self.exact:  # transformers' own indices: its SDPA reads the pages through them (read_exact)
            return super().extend_read_and_write_indices(request_id, past_length, query_length, read_index,
                                                         write_index)
        if self.compiled:
            for w in write_index:
                w.extend([0] * query_length)
            for r in read_index or ():
                r.extend([0] * (past_length + query_length))

    def fill_block_table(self, *a, **k):
        raise UnsupportedError("kvcompile serving has no block-table decode path (max_blocks_per_request=0)")

    def _plan_for(self, total: int) -> _Plan:
        if self._pending:
            entries = []
            for rid, past, n in self._pending:
                slot = self.slot_of.get(rid)
                if slot is None:
                    raise UnsupportedError(f"kvcompile serving: request {rid} has no slot")
                # transformers' compile warmup runs fake requests that "continue" a past they never wrote:
                # their rows are computed as padding (zeros) and nothing is stored
                skip = self.compiled and rid.startswith(WARMUP_PREFIX)
                have = self.stores[0].lengths[slot]
                if have != past and not skip:
                    raise UnsupportedError(
                        f"kvcompile serving: request {rid} continues at position {past} but its store holds "
                        f"{have} tokens")
                entries.append((rid, slot, past, n, skip))
            tables = {slot: self._table(rid) for rid, slot, _, _, skip in entries if not skip}
            for st in self.stores:  # the pages transformers allocated for this forward
                st.set_tables(tables)
            self._plan, self._pending = _Plan(entries, self.slots, self.device), []
        plan = self._plan
        # a compiled forward is padded to a static size: the tokens past the plan's are padding
        if plan is None or (plan.total > total if self.compiled else plan.total != total):
            raise UnsupportedError(
                f"kvcompile serving: the forward has {total} tokens but the batch scheduled "
                f"{None if plan is None else plan.total}"
                + ("" if self.compiled else " (padded inputs need a compiled forward: varlen_compile_config)"))
        return plan

    def update(self, key_states, value_states, layer_idx, kwargs):
        """Eager: store the batch's new keys and values ``[1, H, T, D]`` in each request's row and return them
        as they came (``kvcompile_paged`` reads the chunk in full precision, the rest from the store).
        Compiled: transformers' own paged update, traced over the stand-ins (kvcompile's pass rewrites it)."""
        if not self.compiled:
            if self.exact:
                return self._exact_update(key_states, value_states, layer_idx, kwargs)
            kwargs[CACHE_KWARG] = self  # what this layer's attention reads (``paged_attention``)
            return self._eager_update(key_states, value_states, layer_idx)
        if not torch.compiler.is_compiling():
            raise UnsupportedError(
                "kvcompile serving: this continuous-batching cache serves a compiled forward, but the forward ran "
                "without Dynamo (an eager fallback: torch._dynamo.config.suppress_errors, a recompile limit, "
                "torch.compiler.disable); its attention would read the stand-ins, not the store. Refusing.")
        return _BASE_UPDATE(self, key_states, value_states, layer_idx, kwargs)

    @torch.compiler.disable
    def _eager_update(self, key_states, value_states, layer_idx):
        self.store_layer(layer_idx, key_states, value_states)
        return key_states, value_states

    @torch.compiler.disable
    def _exact_update(self, key_states, value_states, layer_idx, kwargs):
        """Every layer exact: store, then return what transformers' own update returns -- the chunk as it came
        when no request has a past, else the batch's sequences read back through its read index, ``[1, H,
        T_read, D]`` as a transposed view of ``[T_read, H, D]`` (``read_exact``)."""
        self.store_layer(layer_idx, key_states, value_states)
        read_index = kwargs["read_index"][self._allocator.index]
        if read_index.numel() == 0:
            return key_states, value_states
        k, v = self.read_exact(layer_idx, read_index)
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def read_exact(self, layer_idx: int, read_index: torch.Tensor):
        """An exact layer's pages as transformers' ``index_select(k_cache, 0, read_index)`` reads its own:
        ``k, v [T, H, D]`` (contiguous). A physical index is ``page * block_physical_stride + offset`` (the page
        is block ``page - first`` of the layer's pool, the offset its row); an index outside the pool (the read
        trash padding rows read) gives zeros, as transformers' zeroed, never written trash sector does."""
        st = self.stores[layer_idx]
        stride = self._allocator.block_physical_stride
        idx = read_index.to(st.device).long()
        blk, row = idx // stride - self._first_page, idx % stride
        inside = (blk >= 0) & (blk < st.blocks) & (row < st.spec.block)
        blk, row = blk.clamp(0, max(st.blocks - 1, 0)), row.clamp(max=st.spec.block - 1)
        out = []
        for pool in (st.state.k_codes, st.state.v_codes):  # [NB, H, BS, D] in the model's dtype
            x = pool[blk, :, row]  # [T, H, D]
            out.append(torch.where(inside.view(-1, 1, 1), x, torch.zeros((), dtype=x.dtype, device=x.device)))
        return out[0], out[1]

    def store_layer(self, layer_idx: int, key_states, value_states) -> None:
        """Store the forward's new keys and values ``[1, H, T, D]`` in their requests' rows of the layer's
        store (per the batch's plan; a compiled forward's padding rows past it are not stored)."""
        plan = self._plan_for(key_states.shape[2])
        st = self.stores[layer_idx]
        if isinstance(st, WindowRing):
            self._work[layer_idx] = self._store_window(st, plan, key_states, value_states)
            return
        store = ops.backend(key_states.device).store
        work = []
        for n, rows, idx in plan.groups:
            R = rows.numel()
            k, v = _gather(key_states, idx, R, n), _gather(value_states, idx, R, n)
            # the rows' state (views of the store's rows when their slots are consecutive), read by ``attend``
            work.append((n, rows, idx, st.append_rows(rows, k, v, store), k, v))
        if not self.exact:  # (an exact layer is read by transformers' SDPA, not ``attend``)
            self._work[layer_idx] = work

    def attend(self, layer_idx: int, query: torch.Tensor, scaling) -> torch.Tensor:
        """Attention of the batch's queries ``[1, Hq, T, D]`` over their requests' rows: ``[1, T, Hq, D]``."""
        work = self._work.pop(layer_idx, None)
        if work is None:
            raise UnsupportedError(f"kvcompile serving: layer {layer_idx} attends before it stored its keys")
        spec = self.specs[layer_idx]
        be = ops.backend(query.device)
        _, Hq, T, D = query.shape
        padded = T != sum(n * rows.numel() for n, rows, *_ in work)  # padding or warmup rows: zeros
        out = query.new_zeros(T, Hq, D) if padded else query.new_empty(T, Hq, D)
        for n, rows, idx, sub, k, v in work:
            R = rows.numel()
            q = _gather(query, idx, R, n)
            if isinstance(spec, WindowSpec):  # sub: the window before the chunk, its positions, the chunk's past
                k_old, v_old, pos, past = sub
                o = window_attention(q, k_old, v_old, pos, k, v, past, spec.window, scaling)
            else:
                o = be.attention(q, sub, spec, None, scaling, k_new=k, v_new=v)  # [R, Hq, n, D]
            out.index_copy_(0, idx, o.permute(0, 2, 1, 3).reshape(R * n, Hq, D).to(out.dtype))
        return out.unsqueeze(0)

    @staticmethod
    def _store_window(ring: WindowRing, plan: _Plan, key_states, value_states) -> list:
        """A sliding-window layer: each group's window before its chunk is read, then the chunk written over it
        (``kvcompile.window``); the work for ``attend`` holds both."""
        work = []
        for n, rows, idx in plan.groups:
            R = rows.numel()
            k, v = _gather(key_states, idx, R, n), _gather(value_states, idx, R, n)
            slots = rows.tolist()
            past = [plan.past[b] for b in slots]
            k_old, v_old, pos = ring.before(rows, torch.tensor(past, device=rows.device))
            ring.write(slots, past, k, v)
            work.append((n, rows, idx, (k_old, v_old, pos, pos.new_tensor(past)), k, v))
        return work


# --------------------------------------------------------------------------- the attention
def paged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A continuous-batching forward's layer reads the cache that stored its keys (``CACHE_KWARG``, set by the
    cache's ``update`` in the keyword arguments transformers passes on to the attention)."""
    cache = kwargs.get(CACHE_KWARG)
    if cache is None:
        if "write_index" in kwargs:  # a continuous-batching forward whose keys went elsewhere
            raise UnsupportedError(f"attn_implementation={ATTN!r}: layer {module.layer_idx} of a continuous-batching "
                                   f"forward attends, but kvcompile's cache stored no keys for it (use "
                                   f"model.generate_batch / init_continuous_batching on a model kvcompile.apply "
                                   f"prepared)")
        raise UnsupportedError(
            f"this model's attention is {ATTN!r} while a continuous-batching manager runs on it, and that attention "
            f"serves only the manager's forwards: stop the manager (manager.stop()) before calling the model "
            f"otherwise (generate, a forward), or use a second model for it.")
    return cache.attend(module.layer_idx, query, scaling), None


def _register_attention() -> None:
    AttentionInterface.register(ATTN, paged_attention)


# --------------------------------------------------------------------------- the manager
def _is_kvcompile_backend(backend) -> bool:
    return backend == "kvcompile" or backend is kvcompile_backend


def _compiled_request(asked):
    """The user's ``varlen_compile_config`` if it asks for kvcompile's backend, None if nothing is compiled;
    anything else is refused (it would trace kvcompile's cache without rewriting it)."""
    if asked.decode_compile_config is not None:
        raise UnsupportedError(
            "kvcompile serving has no decode fast path (block tables), so decode_compile_config would never run: "
            "pass varlen_compile_config=kvcompile.serving.compile_config() instead; it compiles every forward, "
            "prefill chunks and decode steps alike")
    cfg = asked.varlen_compile_config
    if cfg is None:
        if getattr(asked, "default_compile_level", 0):
            raise UnsupportedError(
                f"kvcompile serving: default_compile_level={asked.default_compile_level} compiles the forward with "
                f"Inductor over transformers' own cache; pass varlen_compile_config=kvcompile.serving."
                f"compile_config() for a compiled forward over kvcompile's store")
        return None
    if not _is_kvcompile_backend(cfg.backend):
        raise UnsupportedError(
            f"kvcompile serving compiles continuous-batching forwards with the 'kvcompile' backend only (got "
            f"backend={cfg.backend!r}, which would trace the cache without kvcompile's pass): use "
            f"varlen_compile_config=kvcompile.serving.compile_config() or CompileConfig(backend='kvcompile', ...)")
    Options.parse(cfg.options)  # unknown options are refused now, not at the first forward
    return cfg


def _refuse(asked) -> None:
    """What kvcompile's cache does not serve yet, where the user asked for it."""
    def refuse(what):
        raise UnsupportedError(f"kvcompile serving does not support {what} yet")

    if asked.use_async_batching:
        refuse("use_async_batching=True")
    graphs = asked.use_cuda_graph
    if any(graphs) if isinstance(graphs, (tuple, list)) else graphs:
        refuse("CUDA graphs (use_cuda_graph)")
    if asked.cpu_offload_space is None:
        refuse("cpu_offload_space=None (a host swap sized from free memory); give its size in GiB")


def _restrict(cb, varlen=None, share: bool = False) -> None:
    """The resolved config, with what kvcompile's cache does not serve yet turned off; ``varlen``: the compile
    config of a compiled forward (kvcompile's backend), or None; ``share``: whether pages may be shared."""
    cb.use_async_batching = False
    cb.varlen_compile_config, cb.decode_compile_config = varlen, None
    cb.use_cuda_graph = (False, False)
    cb.cpu_offload_space = 0.0
    cb.max_blocks_per_request = 0
    cb.allow_block_sharing = bool(share and cb.allow_block_sharing)


_ATTN_LOCK = threading.Lock()
_ATTN_HOLDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model: {manager: compiled}


def _release_attention(model, manager) -> None:
    """``manager`` no longer runs on ``model``: the last eager one to stop puts ``sdpa`` back."""
    with _ATTN_LOCK:
        holders = _ATTN_HOLDERS.get(model, {})
        holders.pop(manager, None)
        if not holders and model.config._attn_implementation == ATTN:
            model.set_attn_implementation("sdpa")


class KVCompileBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` over ``PagedKVCompileCache`` and ``kvcompile_paged``."""

    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None):
        # everything that can refuse runs before transformers' manager switches the model's attention
        asked = continuous_batching_config
        _refuse(asked)
        self._compiled = _compiled_request(asked)  # and refuses what compiles otherwise
        opts: ServingOptions = model._kvcompile_serving
        if any(p.pre_rope for p in opts.policy.resolve(opts.layer_names)):
            raise UnsupportedError(
                "continuous batching (generate_batch, transformers serve) on a model applied with a pre_rope "
                "policy: its attention receives keys after their rotary embedding, so it cannot store them "
                "pre-RoPE. Apply a policy without pre_rope for serving.")
        text = model.config.get_text_config()
        self._specs = layer_specs(text, opts, model.dtype)
        if self._compiled is not None and any(isinstance(s, WindowSpec) for s in self._specs):
            raise UnsupportedError(
                "kvcompile serving: this model has sliding-window layers, which a compiled continuous-batching "
                "forward (varlen_compile_config) does not serve yet; drop varlen_compile_config (the eager forward "
                "serves them, quantizing the full-attention layers)")
        budget = opts.budget
        if budget is None:
            budget = (asked.num_blocks * asked.page_size  # the rank's heads, as transformers counts them
                      * full_precision_bytes_per_token(text, model.dtype, opts.kv_heads)
                      if asked.num_blocks else DEFAULT_BUDGET)
        self._max_tokens = request_limit(text)
        self._slots = slots_for(self._specs, budget, opts.max_requests, opts.request_tokens, self._max_tokens)
        self.budget = budget
        self._blocks = pool_blocks(self._specs, budget, self._slots, self._max_tokens)
        if all_exact(self._specs) and opts.budget is None and not asked.num_blocks:
            # transformers' own SDPA runs (Policy.full()), with its ragged mask over every page's tokens: the
            # default budget's pages are cut to what its mask leaves room for, as transformers' own sizing
            # removes sectors to pay for its masks (a small model's default budget buys ~10^6 tokens of pages,
            # whose mask at 8192 batch tokens would be tens of GiB): the pages' part of the mask costs at most
            # the budget
            self._blocks = min(self._blocks, _mask_blocks(asked, model.dtype, self._specs[0].block, budget))
        if model.config._attn_implementation not in ("sdpa", ATTN):
            raise UnsupportedError(f"kvcompile serving needs a model loaded with attn_implementation='sdpa' "
                                 f"(this one uses {model.config._attn_implementation!r})")
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        cb = self.continuous_batching_config
        share = shares_pages(self._specs)
        # (a model with sliding-window layers shares no pages, as in transformers' own engine: not the policy's
        # doing, so no warning)
        if cb.allow_block_sharing and not shares_pages([s for s in self._specs if isinstance(s, LayerSpec)]):
            warnings.warn(
                f"kvcompile serving: prefix sharing (ContinuousBatchingConfig.allow_block_sharing) is off for "
                f"{opts.policy}: the policy keeps each request's recent tokens or sinks in full precision "
                f"outside its pages, so a page cannot be handed to another request. Policies without a window "
                f"or sinks share pages (Policy.full(), Policy.int8(), 'tok+rot:4'); pass "
                f"allow_block_sharing=False to silence this.", stacklevel=3)
        self._offload_space = int(asked.cpu_offload_space * 2 ** 30)  # transformers' offloader gets 0 (below)
        _restrict(cb, self._varlen_config(model, self._compiled) if self._compiled is not None else None, share)
        cb.page_size = self._specs[0].block
        cb.num_blocks = self._blocks
        self._use_prefix_sharing = cb.allow_block_sharing
        # the options of the requests a server adds (``sampling.Requests``: kvcompile serve gives its own, through
        # ``sampling.sampling_manager``); empty for generate_batch and the manager API
        self.requests = Requests()

    def add_request(self, input_ids, request_id=None, *args, **kwargs):
        """transformers' ``add_request``; a request the server holds options for (``self.requests``) is added
        with their per-request arguments (``RequestOptions.processor_kwargs``: its sampling, its handle)."""
        options = None if request_id is None else self.requests.of(request_id)
        if options is not None:
            kwargs = {**options.processor_kwargs(), **kwargs}
        return super().add_request(input_ids, request_id, *args, **kwargs)

    @staticmethod
    def _varlen_config(model, asked):
        """The compile config transformers' model runner gets: the user's, its backend the kvcompile backend
        with the model's compiler unless ``options`` names one (and no report: the pass keeps its own)."""
        opts = Options.parse({"compiler": model._kvcompile.compiler, **(asked.options or {})})

        def kvcompile_paged_backend(gm, example_inputs, **_):
            return compile_graph(gm, example_inputs, opts)

        return CompileConfig(fullgraph=asked.fullgraph, dynamic=asked.dynamic, backend=kvcompile_paged_backend,
                             mode=None, options=None)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        """Eager: the model's attention is ``kvcompile_paged`` while this manager or another runs on it
        (``_ATTN_HOLDERS``: the last to stop puts ``sdpa`` back, not the first, whose restoring would leave
        the others' forwards reading their chunks alone). Compiled: transformers' own SDPA is traced, and
        kvcompile's pass rewrites it; every layer exact: transformers' own SDPA runs, over the pages read back
        (``read_exact``). A model's attention is one or the other: managers of both kinds cannot share it."""
        # ("compiled" below: the model's attention stays transformers' own SDPA)
        compiled = getattr(self, "_compiled", None) is not None or all_exact(self._specs)
        with _ATTN_LOCK:
            holders = _ATTN_HOLDERS.setdefault(model, weakref.WeakKeyDictionary())
            impl = model.config._attn_implementation
            if impl not in ("sdpa", ATTN):
                raise UnsupportedError(f"kvcompile serving needs a model loaded with attn_implementation='sdpa' "
                                     f"(this one uses {impl!r})")
            others = {c for m, c in holders.items() if m is not self}
            if others and others != {compiled}:
                mine, theirs = (("a compiled or exact", "an eager") if compiled else
                                ("an eager", "a compiled or exact (Policy.full())"))
                raise UnsupportedError(
                    f"kvcompile serving: another continuous-batching manager runs {theirs} forward on this "
                    f"model; {mine} one cannot run beside it (the two read the model's attention differently). "
                    f"Stop that manager first, or give both the same varlen_compile_config.")
            holders[self] = compiled
            if not compiled and impl != ATTN:
                _register_attention()
                model.set_attn_implementation(ATTN)
            elif compiled and impl == ATTN:  # left by an eager manager dropped without being stopped
                model.set_attn_implementation("sdpa")

    def start(self) -> None:
        if not self.is_running():  # stopped before: it holds the model's attention again
            self.switch_to_cb_friendly_attn(self.model)
        super().start()

    def _run_generation_loop(self, *args, **kwargs) -> None:
        try:
            super()._run_generation_loop(*args, **kwargs)
        finally:  # its last forward has run (stop(block=False) returns before that)
            _release_attention(self.model, self)

    def stop(self, *args, **kwargs) -> None:
        try:
            super().stop(*args, **kwargs)
        finally:
            if not self.is_running():  # never started, or joined
                _release_attention(self.model, self)

    def _create_batch_processor(self):
        bp = getattr(self, "batch_processor", None)
        if isinstance(bp, ContinuousBatchProcessor):
            bp.reset()
            return bp
        factory = functools.partial(PagedKVCompileCache, specs=self._specs, slots=self._slots, blocks=self._blocks,
                                    max_tokens=self._max_tokens, compiled=self._compiled is not None,
                                    requests=self.requests)
        # a quantized policy's prompts are cut at fixed positions, whatever else runs (kvcompile.scheduler)
        schedulers = SCHEDULERS if quantizes(self._specs) else continuous_api.SCHEDULER_MAPPING
        with _swapped(continuous_api, "PagedAttentionCache", factory), \
                _swapped(continuous_api, "SCHEDULER_MAPPING", schedulers), \
                _swapped(continuous_api, "FIFOScheduler", schedulers["fifo"]):  # its fallback for an unknown name
            bp = super()._create_batch_processor()
        if self._offload_space:
            old = bp.offloading_manager
            bp.offloading_manager = KVCompileOffloading(bp.cache, old.scheduler, self._offload_space,
                                                         old._compute_stream, bp.distributed_helper)
        bp.cache._scheduler = weakref.ref(bp.scheduler)
        self.cache = bp.cache
        return bp


class KVCompileOffloading(OffloadingManager):
    """transformers' offloading of evicted requests (``ContinuousBatchingConfig.cpu_offload_space``) over
    kvcompile's pages: a request the scheduler evicts to make room is copied to host memory as its store
    holds it -- its pages packed, its row's ring and sinks -- in every layer, and copied back into the pages
    and slot it gets when it is scheduled again, so that it goes on exactly where it was (a soft reset
    re-prefills it instead, computing its keys and values again). Up to ``space`` bytes of host memory, the
    packed bytes counted; a victim that does not fit is soft reset, as transformers does. Which requests are
    evicted, and when, is transformers' own decision."""

    def __init__(self, cache, scheduler, space: int, compute_stream, distributed_helper):
        super().__init__(cache, scheduler, 0.0, 0.8, compute_stream, distributed_helper)
        self.space, self.used = space, 0
        self.saved: dict[str, tuple[list, int]] = {}  # request id: (each layer's SavedRow, bytes)
        self.offloaded = self.restored = 0  # requests copied out and back in (``/kvcompile/stats``)

    def offload_requests(self) -> bool:
        self.cache.keep_freed = {}  # the rows the eviction frees, kept for _offload_to_cpu
        try:
            return super().offload_requests()
        finally:
            self.cache.keep_freed = None

    def _offload_to_cpu(self, victims, victim_block_tables) -> set[str]:
        out = set()
        for state in victims:
            rows = self.cache.keep_freed.get(state.request_id)
            if rows is None:
                continue
            size = sum(r.nbytes for r in rows)
            if self.used + size > self.space:
                continue  # soft reset
            self.saved[state.request_id] = (rows, size)
            self.used += size
            self.offloaded += 1
            state.is_cpu_offloaded = True
            out.add(state.request_id)
        return out

    def restore_scheduled_requests(self, requests_in_batch) -> None:
        for future in requests_in_batch:
            state = future.state
            if not state.is_cpu_offloaded:
                continue
            rows, size = self.saved.pop(state.request_id)
            self.used -= size
            state.is_cpu_offloaded = False
            self.cache.restore(state.request_id, rows)
            self.restored += 1
            if self.cache.use_prefix_sharing:  # its restored pages are complete: hashed at the next update
                for name, allocator in self.cache.cache_allocators.items():
                    whole = state.position_offset // allocator.tokens_per_page
                    if whole:
                        future.complete_blocks[name] = future.complete_blocks.get(name, 0) + whole

    def free_request_cpu_cache(self, state) -> None:
        if state.is_cpu_offloaded:
            self.used -= self.saved.pop(state.request_id)[1]
            state.is_cpu_offloaded = False

    def reset(self) -> None:
        self.free_all_waiting_cpu_caches()
        self.saved.clear()
        self.used = 0
