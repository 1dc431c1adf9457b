"""End to end on one GPU: a Llama-3-8B-shaped model with random bf16 weights (built from a config: nothing is
downloaded), decode throughput of a full-precision StaticCache against quantized caches, in one call that ends
inside its budget.

    python benchmarks/gpu_e2e.py --out e2e.json                      # the H200 run (--budget 450 s by default)
    python benchmarks/gpu_e2e.py --device cpu --tiny --out e2e.json  # the same plumbing at tiny shapes (tests)
    python benchmarks/gpu_e2e.py --only bf16-static kvc-kivi4-graphs --shapes 16x32768

Contenders (``CONTENDERS``):
  bf16-static        transformers' StaticCache, forward compiled with torch.compile(mode="reduce-overhead"): CUDA
                     graphs (gpt-fast style; the full-precision baseline)
  quanto-int4        transformers' QuantizedCache, optimum-quanto int4 (eager: it does not compile)
  kvc-<f>-apply      kvcompile.apply(model, policy): Inductor (apply's default on a GPU), no CUDA graphs
  kvc-<f>-graphs     torch.compile(model.forward, backend="kvcompile", mode="reduce-overhead") over a KVCompileCache:
                     Inductor, CUDA graphs between kvcompile's ops (kvcompile.backend.cudagraph_patches)
  f: int8 (Policy.int8()), fp8 (Policy.fp8()), kivi4 (Policy.kivi(4)), kivi2 (Policy.kivi(2))

Cases, most important first, each started only while the budget lasts (``plan``):
  decode   batch x context (16x32768, 64x8192, and max@32768: the largest batch whose cache fits beside the
           weights at 32K, from the contender's bytes per sequence): the cache filled to the context through the
           contender's own write path with random keys and values (a real prefill of 16 x 32K tokens through an 8B
           model takes tens of seconds per contender: decode time depends on the cache's size, not its values),
           then steps timed one by one (a device sync after each): tokens/s = batch x steps / time. The first
           steps compile (their time is reported as ``first_step_s``, compilation included) and are not timed.
  first    the time to the first token of a real prompt (batch 1 x --first-context tokens), compilation
           included: ``kvcompile.apply`` and ``generate(max_new_tokens=1)`` (the issue's "first generate after
           apply"), or the compiled prefill of the static-cache recipe.
Peak memory: ``torch.cuda.max_memory_allocated`` during the case, and the bytes the cache holds.

Serving (``--serve``, a run of its own): transformers' continuous batching (``generate_batch``'s engine, the
manager API) over one byte budget for the KV cache (--serve-budget-gib): transformers' own paged cache
(``transformers-paged``: its full-precision pages, as many as the budget buys) against kvcompile's packed pages
(``kvc-kivi4-serve``, ``kvc-kivi2-serve``: ``kvcompile.serving.configure(budget=, request_tokens=)``). Many
requests of --serve-prompt random tokens (8K), each decoding --serve-new tokens, all added at once: the most
requests holding cache at the same time (sampled), the wall time, and generated tokens/s. kvcompile's serving
runs over transformers 5.24's continuous batching: on an image with another transformers, carry that wheel and
put it first on the path for this run.

Results: a JSON file (--out) rewritten after every case, with the command, date, versions, device, every row
and every case skipped (and why). Progress is printed as it goes. From the GPU session script:
``python benchmarks/gpu_e2e.py --budget 450 --out "$OUT/e2e8b.json"`` under ``timeout 480``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import math
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=8192)  # head_dim 32: KIVI's value groups

FORMATS = ("int8", "fp8", "kivi4", "kivi2")
CONTENDERS = ("bf16-static", "quanto-int4") + tuple(f"kvc-{f}-{how}" for how in ("graphs", "apply") for f in FORMATS)
SHAPES = ("16x32768", "64x8192", "max@32768")
TINY_SHAPES = ("2x256", "4x128", "max@256")
# (case, contender) in the order they run: the targets first (16 x 32K: KIVI int4 against bf16 and
# QuantizedCache; the largest batch at 32K: int4 and 2-bit against bf16; the first generate after apply)
PRIORITY = [
    ("decode", "bf16-static", 0), ("decode", "kvc-kivi4-graphs", 0), ("decode", "kvc-kivi4-apply", 0),
    ("decode", "quanto-int4", 0), ("first", "kvc-kivi4-apply", None),
    ("decode", "kvc-kivi2-graphs", 0), ("decode", "kvc-int8-graphs", 0), ("decode", "kvc-fp8-graphs", 0),
    ("decode", "bf16-static", 2), ("decode", "kvc-kivi4-graphs", 2), ("decode", "kvc-kivi2-graphs", 2),
    ("decode", "bf16-static", 1), ("decode", "kvc-kivi4-graphs", 1), ("decode", "kvc-kivi4-apply", 1),
    ("decode", "quanto-int4", 1), ("decode", "kvc-int8-graphs", 1), ("decode", "kvc-fp8-graphs", 1),
    ("decode", "kvc-kivi2-graphs", 1), ("first", "bf16-static", None), ("first", "kvc-kivi4-graphs", None),
    ("decode", "kvc-int8-apply", 0), ("decode", "kvc-fp8-apply", 0), ("decode", "kvc-kivi2-apply", 0),
    ("decode", "kvc-int8-apply", 1), ("decode", "kvc-fp8-apply", 1), ("decode", "kvc-kivi2-apply", 1),
    ("decode", "kvc-kivi2-apply", 2), ("decode", "kvc-kivi4-apply", 2), ("first", "quanto-int4", None),
    ("decode", "kvc-int8-graphs", 2), ("decode", "kvc-fp8-graphs", 2),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


T0 = time.perf_counter()


def policy(fmt: str):
    from kvcompile import Policy
    return {"int8": Policy.int8(), "fp8": Policy.fp8(), "kivi4": Policy.kivi(4), "kivi2": Policy.kivi(2)}[fmt]


# --------------------------------------------------------------------------- the model
def build(tiny: bool, device: torch.device, dtype: torch.dtype):
    """The base model (random weights, on ``device``) every contender shares: each gets a twin holding the same
    parameter tensors (``twin``), since ``kvcompile.apply`` changes the model it is given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**(TINY if tiny else LLAMA3_8B), attn_implementation="sdpa")
    cfg.dtype = dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def twin(base):
    """A new model object with ``base``'s parameters (the same tensors: no memory)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM._from_config(base.config, dtype=next(base.parameters()).dtype)
    m.load_state_dict(base.state_dict(), assign=True)
    for name, buf in base.named_buffers():  # non-persistent ones (the rotary embedding's) are not in the state dict
        path, _, attr = name.rpartition(".")
        setattr(m.get_submodule(path), attr, buf)
    m.generation_config = base.generation_config
    return m.eval().requires_grad_(False)


def cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def kv_shape(cfg):
    return cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim


# --------------------------------------------------------------------------- filling a cache with random tokens
FILL_CHUNK = 4096  # tokens per write while filling (bounds the random chunk: 16 x 8 x 4096 x 128 bf16 = 128 MiB)


def fill_static(cache, B, ctx, cfg, dtype, device):
    L, H, D = kv_shape(cfg)
    cache.early_initialization(B, H, D, dtype, device)
    for layer in cache.layers:
        layer.keys[:, :, :ctx].normal_()
        layer.values[:, :, :ctx].normal_()
        if hasattr(layer, "cumulative_length"):  # transformers 5.x writes at this count
            layer.cumulative_length.fill_(ctx)


def fill_quanto(cache, B, ctx, cfg, dtype, device):
    L, H, D = kv_shape(cfg)
    k = torch.randn(B, H, ctx, D, dtype=dtype, device=device)
    v = torch.randn_like(k)
    for i in range(L):  # its first update quantizes the whole prompt (its own prefill path)
        cache.update(k, v, i)
    del k, v


def fill_kvcompile(cache, B, ctx, cfg, dtype, device, extra: int):
    from kvcompile import ops
    from kvcompile.hf import KVCompileLayer

    L, H, D = kv_shape(cfg)
    cache.prepare(B, 1, dtype, device)
    n = min(FILL_CHUNK, ctx)
    k = torch.randn(B, H, n, D, dtype=dtype, device=device)
    v = torch.randn_like(k)
    store = ops.backend(torch.device(device)).store
    for layer in cache.layers:
        if not isinstance(layer, KVCompileLayer):
            continue
        layer.store.expect(ctx + extra)
        for a in range(0, ctx, n):
            m = min(n, ctx - a)
            layer.store.append(k[:, :, :m], v[:, :, :m], kernel=store)  # kvcompile's store kernel, as a prefill
        layer.cumulative_length.fill_(ctx)
    del k, v


# --------------------------------------------------------------------------- contenders
class Case:
    """One contender at one shape: ``setup`` makes the cache (filled) and the step function."""

    def __init__(self, name, base, B, ctx, steps, device, dtype):
        self.name, self.base, self.B, self.ctx, self.steps = name, base, B, ctx, steps
        self.device, self.dtype = torch.device(device), dtype
        self.cfg = base.config
        self.pos = ctx

    def step_inputs(self, tok):
        pos = torch.full((self.B, 1), self.pos, dtype=torch.long, device=self.device)
        self.pos += 1
        return dict(input_ids=tok, position_ids=pos, use_cache=True, logits_to_keep=1)

    def setup(self, extra):
        kind = self.name
        m = twin(self.base)
        kw = cache_kwarg(m)
        if kind == "bf16-static":
            from transformers import StaticCache
            self.cache = StaticCache(config=self.cfg, max_cache_len=self.ctx + extra)
            fill_static(self.cache, self.B, self.ctx, self.cfg, self.dtype, self.device)
            fn = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
            self.fn = lambda tok: fn(**self.step_inputs(tok), **{kw: self.cache})
        elif kind == "quanto-int4":
            from transformers import QuantizedCache
            self.cache = QuantizedCache(backend="quanto", config=self.cfg, nbits=4)
            fill_quanto(self.cache, self.B, self.ctx, self.cfg, self.dtype, self.device)
            self.fn = lambda tok: m(**self.step_inputs(tok), **{kw: self.cache})
        else:
            import kvcompile
            from kvcompile.hf import KVCompileCache
            _, fmt, how = kind.split("-")
            pol = policy(fmt)
            self.cache = KVCompileCache(self.cfg, pol, batch_size=self.B, dtype=self.dtype, device=self.device)
            fill_kvcompile(self.cache, self.B, self.ctx, self.cfg, self.dtype, self.device, extra)
            if how == "apply":
                kvcompile.apply(m, pol)  # its forward prepares the cache and runs the compiled graph
                self.fn = lambda tok: m(**self.step_inputs(tok), **{kw: self.cache})
            else:
                fn = torch.compile(m.forward, backend="kvcompile", mode="reduce-overhead", fullgraph=True)

                def step(tok):
                    self.cache.prepare(self.B, 1, self.dtype, self.device)  # stand-ins wide enough (outside)
                    return fn(**self.step_inputs(tok), **{kw: self.cache})
                self.fn = step
        self.model = m

    def nbytes(self) -> int:
        c = self.cache
        if hasattr(c, "nbytes") and not callable(c.nbytes):
            return int(c.nbytes)
        return tensor_bytes(c)


def tensor_bytes(obj) -> int:
    """Bytes of every distinct storage reachable from a cache: ``benchmarks/cpu_decode.py``'s count (quanto's
    packed tensors counted by their parts), importable whether this file runs as a script or as a module."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.cpu_decode import tensor_bytes as count
    return count(obj)


def bytes_per_sequence(name: str, cfg, tokens: int, dtype, measured: dict) -> int | None:
    """What one sequence of ``tokens`` tokens costs in ``name``'s cache: exact for StaticCache and kvcompile
    (their layouts), measured (from an earlier case, per token) for QuantizedCache; None if unknown."""
    L, H, D = kv_shape(cfg)
    esize = torch.empty((), dtype=dtype).element_size()
    if name == "bf16-static":
        return 2 * L * H * D * esize * tokens
    if name.startswith("kvc-"):
        from kvcompile.store import DTYPE_NAMES, LayerSpec
        spec = LayerSpec(policy(name.split("-")[1]), H, D, DTYPE_NAMES[dtype])
        return L * spec.nbytes(1, tokens)
    per_token = measured.get(name)
    return None if per_token is None else int(per_token * tokens)


# --------------------------------------------------------------------------- running a case under a deadline
class Deadline(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ``Deadline`` in this (main) thread after ``seconds`` (checked between Python bytecodes: a long CUDA
    call or compile returns first)."""
    if seconds <= 0:
        raise Deadline("no time left")

    def fire(*_):
        raise Deadline(f"cut off after {seconds:.0f} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_compiled():
    """Free what compiled code and recorded CUDA graphs hold between cases (each case compiles its own)."""
    torch._dynamo.reset()
    with contextlib.suppress(Exception):
        from torch._inductor import cudagraph_trees
        cudagraph_trees.reset_cudagraph_trees()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cudagraph_counters() -> dict:
    from torch._dynamo.utils import counters
    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def run_decode(name, base, B, ctx, steps, warmup, device, dtype) -> dict:
    dev = torch.device(device)
    before = dict(cudagraph_counters())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        held = torch.cuda.memory_allocated(dev)
    case = Case(name, base, B, ctx, steps, device, dtype)
    t = time.perf_counter()
    case.setup(extra=warmup + steps + 1)
    sync(dev)
    fill_s = time.perf_counter() - t
    log(f"  {name} {B}x{ctx}: cache filled in {fill_s:.1f} s ({case.nbytes() / 2**30:.2f} GiB)")
    tok = torch.randint(0, base.config.vocab_size, (B, 1), device=dev)
    first = []
    for _ in range(warmup):  # the first calls compile (and record CUDA graphs): timed apart, compilation included
        t = time.perf_counter()
        out = case.fn(tok)
        tok = out.logits[:, -1:].argmax(-1)
        sync(dev)
        first.append(time.perf_counter() - t)
    log(f"  {name} {B}x{ctx}: first steps {', '.join(f'{s:.2f}' for s in first)} s (compilation included)")
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = case.fn(tok)
        tok = out.logits[:, -1:].argmax(-1)
        sync(dev)
        times.append(time.perf_counter() - t)
    times.sort()
    row = dict(case="decode", contender=name, batch=B, context=ctx, steps=steps, fill_s=fill_s,
               first_step_s=first[0] if first else None, warmup_s=first,
               step_ms_median=1e3 * times[len(times) // 2], step_ms_min=1e3 * times[0],
               decode_tok_s=B * len(times) / sum(times), cache_bytes=case.nbytes())
    if dev.type == "cuda":
        row.update(peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30,
                   peak_above_weights_gib=(torch.cuda.max_memory_allocated(dev) - held) / 2**30)
    after = cudagraph_counters()
    row["cudagraph_counters"] = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    del case, out
    return row


def run_first(name, base, ctx, device, dtype) -> dict:
    """The first token of a real ``ctx``-token prompt (batch 1), compilation included, from a fresh compile."""
    dev = torch.device(device)
    ids = torch.randint(0, base.config.vocab_size, (1, ctx), device=dev)
    m = twin(base)
    kw = cache_kwarg(m)
    sync(dev)
    t = time.perf_counter()
    if name == "bf16-static":
        from transformers import StaticCache
        cache = StaticCache(config=base.config, max_cache_len=ctx + 8)
        fn = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
        out = fn(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
        first = out.logits[:, -1].argmax(-1)
    elif name == "quanto-int4":
        out = m.generate(ids, max_new_tokens=1, do_sample=False, cache_implementation="quantized",
                         cache_config={"backend": "quanto", "nbits": 4})
        first = out[:, -1]
    else:
        import kvcompile
        from kvcompile.hf import KVCompileCache
        _, fmt, how = name.split("-")
        if how == "apply":
            kvcompile.apply(m, policy(fmt))
            first = m.generate(ids, max_new_tokens=1, do_sample=False)[:, -1]
        else:
            cache = KVCompileCache(base.config, policy(fmt), batch_size=1, dtype=dtype, device=dev)
            cache.prepare(1, ctx, dtype, dev)
            fn = torch.compile(m.forward, backend="kvcompile", mode="reduce-overhead", fullgraph=True)
            first = fn(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache}).logits[:, -1].argmax(-1)
    first.tolist()  # on the host: the token is there
    return dict(case="first", contender=name, batch=1, context=ctx, first_token_s=time.perf_counter() - t)


# --------------------------------------------------------------------------- the plan
def parse_shape(s: str):
    if s.startswith("max@"):
        return None, int(s[4:])
    b, c = s.split("x")
    return int(b), int(c)


def largest_batch(name, cfg, ctx, extra, dtype, device, measured, weights_bytes) -> int | None:
    """The most sequences of ``ctx`` tokens whose cache fits on the device beside the weights (and a reserve
    for activations, compiled code and CUDA graph pools: 6% of the device, at least 4 GiB)."""
    per = bytes_per_sequence(name, cfg, ctx + extra, dtype, measured)
    if per is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        reserve = max(4 * 2**30, 0.06 * total)
    else:  # the dry run: a pretend device that holds 4 full-precision sequences beside the weights
        reserve = 2**20
        total = weights_bytes + reserve + 4 * bytes_per_sequence("bf16-static", cfg, ctx + extra, dtype, measured)
    return max(1, int((total - weights_bytes - reserve) // per))


SERVE_CONTENDERS = ("transformers-paged", "kvc-kivi4-serve", "kvc-kivi2-serve")


def run_serve(name, base, budget: int, requests: int, prompt: int, new: int, device, dtype) -> dict:
    """``requests`` requests of ``prompt`` random tokens, ``new`` tokens each, added at once to a manager whose KV
    cache is ``budget`` bytes; the most requests holding cache at once is sampled every 20 ms."""
    import threading

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kvcompile
    from kvcompile import serving

    dev = torch.device(device)
    m = twin(base)
    cfg = base.config
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    chunk = min(8192, prompt)  # tokens per forward: one 8K prefill, or every running request's decode
    if name == "transformers-paged":
        page = 256
        pages = serving.transformers_pages(budget, page, serving.full_precision_bytes_per_token(cfg, dtype))
        cbc = ContinuousBatchingConfig(num_blocks=pages, page_size=page, max_batch_tokens=chunk)
    else:
        kvcompile.apply(m, policy(name.split("-")[1]))
        serving.configure(m, budget=budget, request_tokens=prompt + new)
        cbc = ContinuousBatchingConfig(max_batch_tokens=chunk)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt,), generator=g).tolist() for _ in range(requests)]
    held, stop = [0], threading.Event()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    with torch.no_grad():
        manager = m.init_continuous_batching(gen, cbc)
        manager.start()

        def watch():
            while not stop.is_set():
                bp = getattr(manager, "batch_processor", None)
                if bp is not None:
                    held[0] = max(held[0], len(bp.scheduler.active_requests))
                time.sleep(0.02)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            ids = manager.add_requests(inputs=prompts, max_new_tokens=new)
            done, tokens, first_done = 0, 0, None
            while done < len(ids):
                r = manager.get_result(timeout=600)
                if r is None:
                    raise RuntimeError("a request gave no result within 600 s")
                if r.error is not None:
                    raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                if r.is_finished():
                    done += 1
                    tokens += len(r.generated_tokens)
                    first_done = first_done or time.perf_counter() - t
        finally:
            stop.set()
            manager.stop(block=True, timeout=120)
    wall = time.perf_counter() - t
    row = dict(case="serve", contender=name, budget_gib=budget / 2**30, requests=requests, prompt=prompt,
               new=new, held_max=held[0], wall_s=wall, first_done_s=first_done, generated=tokens,
               tok_s=tokens / wall)
    if dev.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama and tiny shapes (a dry run, CPU included)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (cases stop before)")
    ap.add_argument("--only", nargs="+", choices=CONTENDERS + SERVE_CONTENDERS, default=None,
                    help="these contenders only")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"batch x context, or max@context (default {SHAPES})")
    ap.add_argument("--cases", nargs="+", choices=("decode", "first"), default=("decode", "first"))
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per case (default 8; tiny 3)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (compile, record CUDA graphs)")
    ap.add_argument("--first-context", type=int, default=None, help="prompt tokens of the first-token case")
    ap.add_argument("--case-limit", type=float, default=150.0, help="seconds at most per case")
    ap.add_argument("--serve", action="store_true", help="the serving comparison instead (see above)")
    ap.add_argument("--serve-budget-gib", type=float, default=None, help="KV cache bytes (default 32; tiny 0.002)")
    ap.add_argument("--serve-requests", type=int, default=None, help="requests added at once (default 128; tiny 24)")
    ap.add_argument("--serve-prompt", type=int, default=None, help="prompt tokens (default 8192; tiny 256)")
    ap.add_argument("--serve-new", type=int, default=16, help="tokens each request decodes")
    ap.add_argument("--out", default="benchmarks/results/gpu_e2e.json")
    args = ap.parse_args(argv)

    import transformers

    import kvcompile
    from kvcompile.api import _raise_recompile_limit

    deadline = time.perf_counter() + args.budget
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_e2e: --device cuda but no CUDA device is visible; use --device cpu --tiny for a dry run")
    dtype = torch.bfloat16
    shapes = args.shapes or (TINY_SHAPES if args.tiny else SHAPES)
    steps = args.steps or (3 if args.tiny else 8)
    first_ctx = args.first_context or (64 if args.tiny else 8192)
    _raise_recompile_limit()
    out = dict(command="python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
               date=datetime.datetime.now().isoformat(timespec="seconds"), device=str(dev),
               device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                             kvcompile=getattr(kvcompile, "__version__", "?")),
               model="tiny" if args.tiny else "llama-3-8b-shaped (random bf16 weights)", budget_s=args.budget,
               steps=steps, warmup=args.warmup, rows=[], skipped=[], done=False)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        path.write_text(json.dumps(out, indent=1, default=str))

    log(f"building the model ({out['model']}) on {dev}")
    base = build(args.tiny, dev, dtype)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    out["weights_gib"] = weights / 2**30
    log(f"model ready: {weights / 2**30:.2f} GiB of weights")
    save()
    try:
        import optimum.quanto  # noqa: F401
        have_quanto = True
    except ImportError:
        have_quanto = False
    measured = {}  # contender -> cache bytes per token (QuantizedCache's, for its largest batch)
    wanted = set(args.only or CONTENDERS)
    if args.serve:
        budget = int((args.serve_budget_gib or (0.002 if args.tiny else 32.0)) * 2**30)
        requests = args.serve_requests or (24 if args.tiny else 128)
        prompt = args.serve_prompt or (256 if args.tiny else 8192)
        out.update(serve=dict(budget_gib=budget / 2**30, requests=requests, prompt=prompt, new=args.serve_new))
        plan = [("serve", name, None) for name in SERVE_CONTENDERS if not args.only or name in args.only]
    else:
        plan = PRIORITY
    for kind, name, si in plan:
        if kind != "serve" and (name not in wanted or kind not in args.cases):
            continue
        if kind == "decode" and si >= len(shapes):
            continue
        left = deadline - time.perf_counter()
        what = dict(case=kind, contender=name,
                    shape=shapes[si] if kind == "decode" else "" if kind == "serve" else f"1x{first_ctx}")
        if name == "quanto-int4" and not have_quanto:
            out["skipped"].append(dict(what, reason="optimum-quanto is not importable"))
            continue
        if left < 20:
            out["skipped"].append(dict(what, reason=f"budget: {left:.0f} s left"))
            continue
        B = ctx = None
        if kind == "decode":
            B, ctx = parse_shape(shapes[si])
            if B is None:
                B = largest_batch(name, base.config, ctx, args.warmup + steps + 1, dtype, dev, measured, weights)
                if B is None:
                    out["skipped"].append(dict(what, reason="its bytes per token were not measured (an earlier "
                                                            "case of it did not run)"))
                    continue
                what["batch"] = B
        log(f"{kind} {name} {what['shape']}{f' (batch {B})' if what['shape'].startswith('max') else ''}: "
            f"{left:.0f} s left")
        try:
            with time_limit(min(args.case_limit, left - 10)):
                if kind == "decode" and name == "quanto-int4":
                    # each of its steps dequantizes the whole cache, and its first builds quanto's extension
                    row = run_decode(name, base, B, ctx, min(steps, 3), 1, dev, dtype)
                    row["shape"] = what["shape"]
                    measured.setdefault(name, row["cache_bytes"] / (B * (ctx + 1 + row["steps"])))
                    log(f"  -> {row['decode_tok_s']:.1f} tok/s, step {row['step_ms_median']:.2f} ms, cache "
                        f"{row['cache_bytes'] / 2**30:.2f} GiB")
                elif kind == "serve":
                    row = run_serve(name, base, budget, requests, prompt, args.serve_new, dev, dtype)
                    log(f"  -> held {row['held_max']} requests at once, {row['generated']} tokens in "
                        f"{row['wall_s']:.1f} s ({row['tok_s']:.1f} tok/s)")
                elif kind == "decode":
                    row = run_decode(name, base, B, ctx, steps, args.warmup, dev, dtype)
                    row["shape"] = what["shape"]
                    measured.setdefault(name, row["cache_bytes"] / (B * (ctx + args.warmup + steps)))
                    log(f"  -> {row['decode_tok_s']:.1f} tok/s, step {row['step_ms_median']:.2f} ms, cache "
                        f"{row['cache_bytes'] / 2**30:.2f} GiB, peak {row.get('peak_gib', 0):.1f} GiB")
                else:
                    row = run_first(name, base, first_ctx, dev, dtype)
                    log(f"  -> first token after {row['first_token_s']:.1f} s")
            out["rows"].append(row)
        except Deadline as e:
            out["skipped"].append(dict(what, reason=str(e)))
            log(f"  cut off: {e}")
        except torch.OutOfMemoryError as e:
            out["skipped"].append(dict(what, reason=f"out of memory: {str(e).splitlines()[0]}"))
            log("  out of memory")
        except Exception as e:  # a contender that fails is reported, and the next one runs
            out["skipped"].append(dict(what, reason=f"{type(e).__name__}: {e}"[:2000],
                                       traceback=traceback.format_exc()[-4000:]))
            log(f"  failed: {type(e).__name__}: {str(e)[:300]}")
        finally:
            reset_compiled()
            save()
    out["done"] = True
    out["elapsed_s"] = time.perf_counter() - T0
    save()
    log(f"done: {len(out['rows'])} rows, {len(out['skipped'])} skipped; {args.out}")
    return out


if __name__ == "__main__":
    main()
