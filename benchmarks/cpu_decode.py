"""CPU decode benchmark: kvcompile against Hugging Face's caches, side by side in one process.

    pip install -e ".[test,bench]"                        # optimum-quanto for the QuantizedCache contenders
    python benchmarks/cpu_decode.py                       # the full table (SmolLM2, 1K-8K, batch 1 and 4)
    python benchmarks/cpu_decode.py --contexts 2048 --batches 1 --new 32 --repeats 2
    python benchmarks/cpu_decode.py --smoke               # a tiny random Llama, seconds (run by the tests)

    # the GPU end-to-end variant: a Llama-shaped 1B model with random weights, bf16, one call
    python benchmarks/cpu_decode.py --device cuda --random-llama 1b --dtype bfloat16 --batches 8 32 \
        --contexts 8192 32768 --contenders static+compile quanto-int4 kvc-int4 --record

Contenders run interleaved (A B C ... A B C ...) so machine drift hits all of them alike. For each one:
prefill time, decode tokens/s (median over repeats), the bytes the KV cache holds at the end (summed from
its tensors), peak process memory (RSS high-water mark sampled during the run, minus the baseline before
it; the prefill's activations usually set it), the decode peak (the high-water mark during the decode steps
above the memory held once the prompt is in the cache: what attending to the cache materializes per step),
and ratios to the full-precision DynamicCache. Writes JSON next to the printed table.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache, QuantizedCache, StaticCache

import kvcompile
from kvcompile import Policy
from kvcompile.api import _raise_recompile_limit
from kvcompile.hf import KVCompileCache

# --------------------------------------------------------------------------- memory measurement


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every distinct tensor storage reachable from a cache object (its real footprint)."""
    seen = set() if seen is None else seen
    total = 0
    stack = [obj]
    visited = set()
    while stack:
        o = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            if type(o) is not torch.Tensor and hasattr(o, "__tensor_flatten__"):
                # a wrapper subclass (quanto's packed tensors): count the tensors it is made of
                names, _ = o.__tensor_flatten__()
                stack.extend(getattr(o, n) for n in names)
                continue
            if o.numel() == 0:
                continue
            st = o.untyped_storage()
            key = st.data_ptr()
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__") and not isinstance(o, (type, torch.nn.Module)):
            stack.extend(vars(o).values())
    return total


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: RSS still works, only less tightly
        return None


# glibc keeps freed blocks below its (adaptive) mmap threshold in the heap: without a trim, the next contender
# reuses those pages without raising RSS and its peak reads as nearly zero. (Fixing the threshold low instead
# would distort the timings: DynamicCache's per-step torch.cat would page-fault fresh mappings every step.)
LIBC = _libc()


class PeakRSS:
    """Samples the process RSS in a thread; ``peak - base`` is what the run added at its worst (the cache,
    which some contenders allocate up front, included: the run starts before the cache is made).

    ``mark()`` (called once the prompt is in the cache) opens a second window: ``decode_added`` is the
    high-water mark after it above the RSS at it, i.e. what the decode steps materialize on top of the
    filled cache (a full-precision copy of the cache per step shows here; the prefill's activations do not)."""

    def __init__(self, interval=0.002):
        import psutil  # here, not at the top: the GPU variant measures with CUDA's allocator and needs none

        self.proc, self.interval = psutil.Process(), interval
        self.mark_base = self.mark_peak = None

    def _trim(self):
        gc.collect()
        if LIBC is not None:
            LIBC.malloc_trim(0)  # hand freed heap pages back, so they cannot hide this run's growth

    def __enter__(self):
        self._trim()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        rss = self.proc.memory_info().rss
        self.peak = max(self.peak, rss)
        if self.mark_peak is not None:
            self.mark_peak = max(self.mark_peak, rss)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def mark(self):
        self._trim()  # the prefill's freed activations go back first: decode growth cannot hide in them
        self.mark_base = self.mark_peak = self.proc.memory_info().rss

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()  # the last moments, which the sampling thread may have slept through

    @property
    def added(self) -> int:
        return self.peak - self.base

    @property
    def decode_added(self) -> int:
        return self.mark_peak - self.mark_base


class PeakCUDA:
    """GPU memory: the allocator's high-water mark during the run, minus what was allocated before it
    (``mark()``/``decode_added`` as for ``PeakRSS``).

    When the run raises, ``__exit__`` measures nothing and lets that error through: on the first GPU run
    (2026-12-04) a store's device assert was hidden behind this class's own ``AttributeError`` (no ``mark()``
    yet), and a synchronize after a device-side error would raise a second, unrelated CUDA error."""

    def __enter__(self):
        gc.collect()
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        self.before_mark = 0
        self.mark_base = None
        self.added = self.decode_added = None
        torch.cuda.reset_peak_memory_stats()
        return self

    def mark(self):
        torch.cuda.synchronize()
        self.before_mark = torch.cuda.max_memory_allocated()
        self.mark_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            return False  # the run's own error, unchanged
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.added = max(peak, self.before_mark) - self.base
        self.decode_added = None if self.mark_base is None else peak - self.mark_base


# Llama-shaped configs with random weights, for the GPU variant (no weights are downloaded)
RANDOM_LLAMAS = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072),
    "tiny": dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


# --------------------------------------------------------------------------- contenders
@dataclass
class Contender:
    name: str
    make: object                      # (model, batch, capacity) -> (model_to_call, cache or None)
    results: dict = field(default_factory=dict)


def dynamic(model, batch, capacity):
    return model, DynamicCache(config=model.config)


def static_compiled(model, batch, capacity, _cache={}):
    # dynamic=False: each shape gets its own static graph, as a user compiling for their one shape would. With
    # Dynamo's automatic dynamic shapes, the first grid run's later shapes took no compile time and ran up to
    # 3x slower than the eager DynamicCache (4K x 4: 882 ms a step against 270)
    if "fwd" not in _cache:
        _cache["fwd"] = torch.compile(model.forward, fullgraph=False, dynamic=False)
    return _cache["fwd"], StaticCache(config=model.config, max_cache_len=capacity)


def quanto(nbits):
    def make(model, batch, capacity):
        return model, QuantizedCache(backend="quanto", config=model.config, nbits=nbits, residual_length=128)
    return make


COMPILER = {"name": "auto"}
PREFILL_CHUNK = {"n": None}
SKIP_FIRST_STEP = {"on": False}  # --no-warmup: the first decode step compiles; the rate leaves it out


def kv(policy):
    applied = {}

    def make(model, batch, capacity):
        if "model" not in applied:
            applied["model"] = kvcompile.apply(applied.pop("copy"), policy, max_cache_len=capacity,
                                               compiler=COMPILER["name"])
        cache = KVCompileCache(model.config, policy, capacity)
        cache.expect(capacity)  # as generate does with its max_length: each pool is allocated once, not grown
        return applied["model"], cache

    def prepare(model):
        # apply changes the model it is given, so each kvcompile contender gets its own copy of the weights,
        # made here, outside the timed and measured run (a user applies kvcompile to the one model they have)
        if "model" not in applied and "copy" not in applied:
            applied["copy"] = _clone(model)
    make.prepare = prepare
    return make


def _clone(model):
    import copy
    return copy.deepcopy(model)


def contenders(names):
    table = {
        "dynamic": dynamic,
        "static+compile": static_compiled,
        "quanto-int4": quanto(4),
        "quanto-int2": quanto(2),
        "kvc-int8": kv(Policy.int8()),
        "kvc-fp8": kv(Policy.fp8()),
        "kvc-int4": kv(Policy.kivi(4)),
        "kvc-int2": kv(Policy.kivi(2)),
    }
    return [Contender(n, table[n]) for n in names]


# --------------------------------------------------------------------------- one measurement
@torch.no_grad()
def run_once(c: Contender, model, ids, new_tokens: int):
    B, T = ids.shape
    capacity = T + new_tokens
    # logits_to_keep=1: only the last position's logits are needed (a full [B, T, vocab] fp32 logits tensor is
    # 6 GiB at 8K x 4 and would dominate every contender's peak). No attention_mask: the rows are unpadded,
    # and a growing 2-D mask would change shape every step (a recompile per step for the compiled
    # contenders); the models build their causal masks from positions.
    if hasattr(c.make, "prepare"):
        c.make.prepare(model)
    cuda = ids.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with (PeakCUDA() if cuda else PeakRSS()) as mem:  # from before the cache exists: its bytes count
        t_make = time.perf_counter()
        fn, cache = c.make(model, B, capacity)  # kvcompile.apply runs here the first time
        t0 = time.perf_counter()
        step = PREFILL_CHUNK["n"] or T
        for a in range(0, T, step):  # chunked prefill bounds the [B, 1, n, C] masks at long context
            out = fn(input_ids=ids[:, a:a + step], past_key_values=cache, use_cache=True, logits_to_keep=1,
                     **({"cache_position": torch.arange(a, min(T, a + step), device=ids.device)} if a else {}))
            cache = out.past_key_values
        sync()
        t1 = time.perf_counter()
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        first_token = time.perf_counter() - t_make
        step_times = []
        skip = SKIP_FIRST_STEP["on"] and new_tokens > 1  # its first step compiles the decode graph: not counted
        if not skip:
            mem.mark()
        for i in range(new_tokens):
            if skip and i == 1:
                mem.mark()
            s = time.perf_counter()
            out = fn(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1,
                     cache_position=torch.tensor([T + i], device=ids.device))
            sync()
            step_times.append(time.perf_counter() - s)
            nxt = out.logits[:, -1:].argmax(-1)
    held = cache.nbytes if hasattr(cache, "nbytes") else tensor_bytes(cache)
    timed = step_times[1:] if skip else step_times
    return dict(prefill_s=t1 - t0, first_token_s=first_token, decode_tok_s=B * len(timed) / sum(timed),
                step_ms=[1e3 * s for s in step_times], cache_bytes=held, peak_added=mem.added,
                decode_added=mem.decode_added)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local HF model dir (default: the embedded SmolLM2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contenders", nargs="+",
                    default=["dynamic", "static+compile", "quanto-int4", "quanto-int2",
                             "kvc-int8", "kvc-fp8", "kvc-int4", "kvc-int2"])
    ap.add_argument("--out", default="benchmarks/results/cpu_decode.json")
    ap.add_argument("--compiler", default="auto", choices=["auto", "inductor", "eager"],
                    help="what compiles the rest of kvcompile's graph")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed first run per shape (long contexts): the first timed run then compiles, "
                         "which its prefill time includes; the decode rate leaves out the first step (which "
                         "compiles the decode graph)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--plot", default=None, help="PNG: decode tokens/s and step time against context")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU end-to-end variant")
    ap.add_argument("--random-llama", choices=sorted(RANDOM_LLAMAS), default=None,
                    help="a Llama-shaped model with random weights instead of SmolLM2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill the prompt in chunks of this many tokens (default: all at once)")
    ap.add_argument("--record", action="store_true", help="put the table on top of docs/results.md, the results record")
    ap.add_argument("--smoke", action="store_true", help="tiny random Llama; checks the script runs")
    args = ap.parse_args(argv)
    started = time.time()

    if args.smoke or args.random_llama:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(**RANDOM_LLAMAS["tiny" if args.smoke else args.random_llama])
        model = LlamaForCausalLM(cfg).eval()
        if args.smoke:
            args.contexts, args.batches, args.new, args.repeats, args.compiler = [160], [1], 4, 1, "eager"
            args.contenders = [c for c in args.contenders if c in ("dynamic", "kvc-int4", "kvc-int8")]
        vocab = cfg.vocab_size
    else:
        from kvcompile.models import load
        model, tok = load(args.model)
        vocab = model.config.vocab_size

    model = model.to(device=args.device, dtype=getattr(torch, args.dtype))
    COMPILER["name"] = args.compiler
    # every shape of a grid compiles its own graphs (prefill and decode, per contender): the limits kvcompile's
    # apply sets, set before the first contender (StaticCache + compile may run before any apply)
    _raise_recompile_limit()
    PREFILL_CHUNK["n"] = args.prefill_chunk
    SKIP_FIRST_STEP["on"] = args.no_warmup
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    cs = contenders(args.contenders)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    total = len(args.contexts) * len(args.batches) * args.repeats * len(cs)
    with torch.no_grad():  # once per process, untimed: one-time allocations (thread pools, lazily built library
        # state) would otherwise land in the first contender's peak (the first grid's 1K x 1 full-precision run
        # read 600 MiB against 236 at 2K x 1)
        model(input_ids=torch.zeros(1, 16, dtype=torch.long, device=args.device), use_cache=True, logits_to_keep=1)
    bar = tqdm(total=total, desc="decode benchmark")
    for T in args.contexts:
        for B in args.batches:
            ids = torch.randint(0, vocab, (B, T), generator=g).to(args.device)
            per = {c.name: [] for c in cs}
            first = {}
            for c in cs:  # an untimed first run per shape: compilation (and its recompiles) happen here
                if args.no_warmup:
                    break
                bar.set_postfix_str(f"T={T} B={B} {c.name} (first call)")
                first[c.name] = run_once(c, model, ids, args.new)["first_token_s"]
            for r in range(args.repeats):
                for c in cs:  # interleaved: A B C ... then again
                    bar.set_postfix_str(f"T={T} B={B} {c.name}")
                    per[c.name].append(run_once(c, model, ids, args.new))
                    first.setdefault(c.name, per[c.name][-1]["first_token_s"])
                    bar.update()
            base = per[cs[0].name]
            base_tps = statistics.median(x["decode_tok_s"] for x in base)
            for c in cs:
                xs = per[c.name]
                tps = statistics.median(x["decode_tok_s"] for x in xs)
                rows.append(dict(
                    contender=c.name, context=T, batch=B, first_token_s=first[c.name],
                    prefill_s=statistics.median(x["prefill_s"] for x in xs),
                    decode_tok_s=tps, speed_vs_first=tps / base_tps,
                    cache_bytes=xs[-1]["cache_bytes"],
                    cache_vs_first=xs[-1]["cache_bytes"] / max(1, base[-1]["cache_bytes"]),
                    peak_added_mib=statistics.median(x["peak_added"] for x in xs) / 2 ** 20,
                    decode_added_mib=statistics.median(x["decode_added"] for x in xs) / 2 ** 20,
                    step_ms_median=statistics.median(s for x in xs for s in x["step_ms"]),
                    step_ms_first=xs[-1]["step_ms"][0], step_ms_last=xs[-1]["step_ms"][-1]))
            # every finished shape is saved at once: a long grid stopped part-way keeps what it measured
            out.write_text(json.dumps(dict(args=vars(args), rows=rows, complete=False), indent=1))
    bar.close()
    table = render(rows, args)
    print(table)
    out.write_text(json.dumps(dict(args=vars(args), rows=rows, complete=True), indent=1))
    print(f"wrote {out}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    if args.record:
        dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        cmd = "python benchmarks/cpu_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
        if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a script: benchmarks.record
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.record import record
        record(f"end to end, {dev} (benchmarks/cpu_decode.py)", f"`{cmd}` (torch {torch.__version__}, transformers "
               f"{transformers.__version__}, {time.time() - started:.0f} s)\n\n```\n{table}\n```")
    return rows


def render(rows, args) -> str:
    lines = [f"{args.threads} threads, {args.device}, {args.dtype}, compiler={args.compiler}, {args.new} new tokens, "
             f"median of {args.repeats}",
             f"{'contender':16} {'ctx':>6} {'B':>2} {'1st tok s':>9} {'prefill s':>9} {'tok/s':>7} {'x first':>7} "
             f"{'cache MiB':>9} {'x first':>7} {'peak+MiB':>8} {'decode+MiB':>10} {'step ms':>8}"]
    for r in rows:
        lines.append(f"{r['contender']:16} {r['context']:6d} {r['batch']:2d} {r['first_token_s']:9.1f} "
                     f"{r['prefill_s']:9.2f} {r['decode_tok_s']:7.2f} "
                     f"{r['speed_vs_first']:7.2f} {r['cache_bytes'] / 2 ** 20:9.1f} {r['cache_vs_first']:7.2f} "
                     f"{r['peak_added_mib']:8.1f} {r.get('decode_added_mib', float('nan')):10.1f} "
                     f"{r['step_ms_median']:8.1f}")
    for (name, B), v in slopes(rows).items():
        lines.append(f"decode step growth, {name}, batch {B}: {v:.1f} ms per 1K tokens of context (least squares)")
    return "\n".join(lines)


def slopes(rows) -> dict:
    """Least-squares decode-step growth, ms per 1K tokens of context, per (contender, batch) with 2+ contexts."""
    out = {}
    for key in dict.fromkeys((r["contender"], r["batch"]) for r in rows):
        rs = [r for r in rows if (r["contender"], r["batch"]) == key]
        if len({r["context"] for r in rs}) < 2:
            continue
        x = [r["context"] / 1024 for r in rs]
        y = [r["step_ms_median"] for r in rs]
        mx, my = sum(x) / len(x), sum(y) / len(y)
        out[key] = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    return out


def plot(rows, path):
    """Decode tokens/s, per-step time and the memory the decode steps add, against context, one line per
    contender, a column per batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in rows})
    slope = slopes(rows)
    decode_mem = all("decode_added_mib" in r for r in rows)  # files from before the decode peak have none
    nrows = 3 if decode_mem else 2
    fig, axes = plt.subplots(nrows, len(batches), figsize=(6 * len(batches), 4 * nrows), squeeze=False)
    for j, B in enumerate(batches):
        for name in dict.fromkeys(r["contender"] for r in rows):
            rs = sorted((r for r in rows if r["batch"] == B and r["contender"] == name), key=lambda r: r["context"])
            if not rs:
                continue
            ctx = [r["context"] for r in rs]
            axes[0][j].plot(ctx, [r["decode_tok_s"] for r in rs], "o-", label=name)
            extra = f" ({slope[name, B]:.1f} ms per 1K tokens)" if (name, B) in slope else ""
            axes[1][j].plot(ctx, [r["step_ms_median"] for r in rs], "o-", label=name + extra)
            if decode_mem:  # floored at 0.1 MiB for the log scale
                axes[2][j].plot(ctx, [max(r["decode_added_mib"], 0.1) for r in rs], "o-", label=name)
        axes[0][j].set(title=f"batch {B}", ylabel="decode tokens/s", xlabel="context (tokens)")
        axes[1][j].set(ylabel="decode step, median (ms)", xlabel="context (tokens)")
        axes[0][j].legend(fontsize=8)
        axes[1][j].legend(fontsize=8)
        if decode_mem:
            axes[2][j].set(yscale="log", xlabel="context (tokens)",
                           ylabel="memory the decode steps add (MiB)")
            axes[2][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
