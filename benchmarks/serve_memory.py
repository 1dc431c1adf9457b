"""Decode-step memory on the serving path: what one continuous-batching decode step allocates on top of a
filled cache, kvcompile's paged store against transformers' own ``PagedAttentionCache``.

    python benchmarks/serve_memory.py                                  # 8 x 1K and 8 x 4K, SmolLM2-135M fp32
    python benchmarks/serve_memory.py --grid 8x1024 4x4096 --steps 4 --repeats 3
    python benchmarks/serve_memory.py --random --grid 2x256 --steps 2 --repeats 2   # seconds: a smoke run

For each contender (kvcompile under ``Policy.int8()``, ``Policy.kivi(4)``, ``Policy.full()``; transformers'
own engine on the unapplied model) and each ``B x T``: a fresh model, a continuous-batching manager whose
cache holds exactly the workload (``B`` requests of ``T`` prompt tokens plus the new ones: kvcompile's pool
blocks = transformers' pages, ``ceil(tokens / page)`` per request in both engines, each at its own page size),
and the ``B`` random prompts prefilled. The engine is driven step by step in this thread
(``_generation_loop_body``, the background loop's own body: scheduling, the batch's tensors, the forward,
sampling, the update), so the prefill and the decode steps are separated exactly. Then:

- ``decode peak``: the RSS high-water mark during ``--steps`` decode steps minus the RSS just before them
  (``benchmarks.cpu_decode.PeakRSS``: a sampling thread, freed heap trimmed before each window), median over
  ``--repeats`` windows after one unmeasured step. A full-precision copy of the cache, per layer or whole,
  shows here; the prompt's activations do not.
- ``largest new tensor`` and ``new bytes``: one more decode step under a ``TorchDispatchMode`` that records
  every tensor an ATen op allocates (outputs whose storage is not one of the op's inputs': views and in-place
  results excluded): the largest one, and their sum over the step. Exact and noise-free, but blind to memory
  a kernel allocates internally (the RSS column sees that).
- ``cache``: bytes the cache allocated (kvcompile: pools, rings, sinks, lengths, block tables; transformers:
  its paged tensor), and, for scale, one layer's keys and values of the batch in the model's dtype: what a
  full-precision read of the cache materializes per layer (transformers' ``index_select`` through its read
  indices does, before SDPA).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cpu_decode import PeakRSS  # noqa: E402

MiB = 2**20
TRANSFORMERS_PAGE = 256  # transformers' page size here (its ContinuousBatchingConfig default)


# --------------------------------------------------------------------------- allocation accounting
class NewTensors(TorchDispatchMode):
    """Records the bytes of every tensor an op allocates while active: each output whose storage is none of
    the op's tensor inputs' (so views and in-place results are not counted). ``largest`` and ``total``."""

    def __init__(self):
        super().__init__()
        self.largest, self.total, self.ops, self.largest_op = 0, 0, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            self.total += st.nbytes()
            self.ops += 1
            if st.nbytes() > self.largest:
                self.largest, self.largest_op = st.nbytes(), str(func)
        return out


# --------------------------------------------------------------------------- the engine, step by step
def policy_of(name: str):
    from kvcompile import Policy
    return {"kvc-int8": Policy.int8(), "kvc-kivi4": Policy.kivi(4), "kvc-full": Policy.full()}.get(name)


def engine(model, name: str, batch: int, tokens: int, max_batch_tokens: int, generation_config):
    """A manager over a cache that holds ``batch`` requests of ``tokens`` tokens, and one page more each
    (transformers' scheduler holds back a request's prefill when the pages left are exactly what it needs;
    the same margin for both engines), its batch processor created in this thread, nothing started (kvcompile when
    ``name`` names a policy: ``model`` is applied here; transformers' own otherwise), its batch processor
    created in this thread (nothing started): ``(manager, batch processor)``."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kvcompile
    from kvcompile import serving

    policy = name if not isinstance(name, str) else policy_of(name)  # a Policy, or a contender's name
    if policy is None:
        cbc = ContinuousBatchingConfig(num_blocks=batch * (serving.pages_for(tokens, TRANSFORMERS_PAGE) + 1),
                                       page_size=TRANSFORMERS_PAGE, max_batch_tokens=max_batch_tokens)
    else:
        model = kvcompile.apply(model, policy)
        specs = serving.layer_specs(model.config.get_text_config(), model._kvcompile_serving, model.dtype)
        blocks = batch * (serving.pages_for(tokens, specs[0].block) + 1)
        serving.configure(model, budget=serving.pool_nbytes(specs, batch, blocks), max_requests=batch)
        cbc = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config, cbc)
    bp = manager._create_batch_processor()
    manager.batch_processor = bp
    manager.current_batch = 0  # as the background loop sets it
    return manager, bp


def cache_nbytes(bp) -> int:
    from kvcompile import serving

    cache = bp.cache
    if isinstance(cache, serving.cache_class()):
        return cache.allocated_nbytes
    t = cache.cache_tensor
    return t.numel() * t.element_size()


def all_decoding(bp, batch: int) -> bool:
    from transformers.generation.continuous_batching.requests import RequestStatus

    active = bp.scheduler.active_requests
    return (len(active) == batch and not bp.scheduler.waiting_requests
            and all(s.status == RequestStatus.DECODING for s in active.values()))


def prefill(manager, bp, prompts, max_new_tokens: int, progress=None) -> int:
    """Queue ``prompts`` and step the engine until every request is decoding: the forwards it took."""
    for i, p in enumerate(prompts):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=max_new_tokens, eos_token_id=-1)
    n = 0
    while not all_decoding(bp, len(prompts)):
        if (n and not bp.scheduler.has_pending_requests()) or n > 10 * len(prompts) * sum(map(len, prompts)):
            raise RuntimeError("requests finished before every prompt was prefilled: raise max_new_tokens")
        step(manager, bp)
        n += 1
        if progress is not None:
            progress.update(1)
    return n


def step(manager, bp) -> None:
    """One iteration of the engine's loop (schedule, forward, sample, update)."""
    if not manager._generation_loop_body(bp, bootstrapping=False):
        raise RuntimeError("the continuous-batching loop stopped")


def decode_step(manager, bp) -> None:
    """One step once every request decodes; they all still do after it (none finished, none evicted)."""
    n = len(bp.scheduler.active_requests)
    step(manager, bp)
    if not all_decoding(bp, n):
        raise RuntimeError("a request finished or was evicted during the decode steps")


def step_allocations(manager, bp) -> NewTensors:
    """One decode step under ``NewTensors``."""
    with NewTensors() as rec:
        decode_step(manager, bp)
    return rec


def new_tokens(batch: int, context: int, measured_steps: int, max_batch_tokens: int) -> int:
    """max_new_tokens such that every request still decodes after the prefill of all of them (the first
    prefilled decode a token per forward meanwhile), ``measured_steps``, and a few unmeasured steps."""
    prefill_forwards = -(-batch * context // max(1, max_batch_tokens - batch)) + batch
    return prefill_forwards + measured_steps + 8


def fp_layer_nbytes(config, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """One layer's keys and values for ``batch`` requests of ``tokens`` tokens, in ``dtype``."""
    from kvcompile.hf import model_shape

    _, kv, head_dim = model_shape(config.get_text_config())
    return 2 * batch * tokens * kv * head_dim * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- one measurement
@torch.inference_mode()
def measure(make_model, name: str, batch: int, context: int, steps: int, repeats: int, max_batch_tokens: int,
            seed: int = 0, progress=None) -> dict:
    from transformers import GenerationConfig

    max_batch_tokens = max_batch_tokens or context + batch  # a whole prompt per forward, beside the decodes
    model = make_model()
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    prompts = [torch.randint(100, min(vocab, 20000), (context,), generator=g).tolist() for _ in range(batch)]
    # enough new tokens that no request finishes before the last step: requests prefilled first decode while
    # the others prefill (a forward of max_batch_tokens holds one chunk and the decoding requests' tokens)
    new = new_tokens(batch, context, steps * repeats, max_batch_tokens)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager, bp = engine(model, name, batch, context + new, max_batch_tokens, gen)
    t0 = time.perf_counter()
    forwards = prefill(manager, bp, prompts, new, progress)
    prefill_s = time.perf_counter() - t0
    decode_step(manager, bp)  # unmeasured: one-time allocations of the decode path
    peaks, step_s = [], []
    for _ in range(repeats):
        with PeakRSS() as mem:
            mem.mark()
            s = time.perf_counter()
            for _ in range(steps):
                decode_step(manager, bp)
            step_s.append((time.perf_counter() - s) / steps)
        peaks.append(mem.decode_added)
    rec = step_allocations(manager, bp)
    config = model.config
    out = dict(contender=name, batch=batch, context=context, steps=steps, repeats=repeats,
               prefill_forwards=forwards, prefill_s=round(prefill_s, 2), step_ms=round(1e3 * statistics.median(step_s), 1),
               decode_peak=int(statistics.median(peaks)), decode_peaks=peaks, largest_new=rec.largest,
               largest_op=rec.largest_op, new_bytes=rec.total, cache_bytes=cache_nbytes(bp),
               fp_layer_bytes=fp_layer_nbytes(config, batch, context, model.dtype),
               pages=bp.cache.num_blocks, page_size=manager.continuous_batching_config.page_size)
    del manager, bp, model, rec
    gc.collect()
    return out


# --------------------------------------------------------------------------- main
CONTENDERS = ("transformers", "kvc-full", "kvc-int8", "kvc-kivi4")


def model_maker(random: bool, dtype: torch.dtype):
    """Fresh SmolLM2-135M (``kvcompile.models``), or its shape with random weights."""
    from kvcompile import models

    if not random:
        def make():
            m, _ = models.load(None, log=lambda *a: None)
            return m.to(dtype).eval()
        return make
    import transformers
    config = transformers.AutoConfig.from_pretrained(models.convert_default(log=lambda *a: None))

    def make():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                              attn_implementation="sdpa").eval()
    return make


def parse_grid(items):
    out = []
    for it in items:
        b, t = it.lower().split("x")
        out.append((int(b), int(t)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", nargs="+", default=["8x1024", "8x4096"], help="BATCHxCONTEXT")
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per measured window")
    ap.add_argument("--repeats", type=int, default=3, help="measured windows (median)")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="tokens per forward (default: a whole prompt and every request's decode token)")
    ap.add_argument("--random", action="store_true", help="SmolLM2's shape with random weights")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (kvcompile's forward caps its own; "
                    "one for both engines)")
    ap.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/serve_memory.json)")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    make = model_maker(args.random, torch.float32)
    grid = parse_grid(args.grid)
    rows = []
    runs = [(b, t, c) for b, t in grid for c in args.contenders]
    with tqdm(total=len(runs), desc="runs", position=0) as bar, \
            tqdm(desc="forwards", position=1, leave=False) as fwd:
        for b, t, c in runs:
            bar.set_postfix_str(f"{c} {b}x{t}")
            rows.append(measure(make, c, b, t, args.steps, args.repeats, args.max_batch_tokens, progress=fwd))
            bar.update(1)
            tqdm.write(json.dumps({k: v for k, v in rows[-1].items() if k != "decode_peaks"}))
    print()
    print("| B x T | contender | decode peak MiB (median; each) | largest new tensor MiB | new bytes/step MiB "
          "| cache MiB | 1 layer K+V fp32 MiB | step ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        each = " / ".join(f"{p / MiB:.1f}" for p in r["decode_peaks"])
        print(f"| {r['batch']} x {r['context']} | {r['contender']} | {r['decode_peak'] / MiB:.1f} ({each}) "
              f"| {r['largest_new'] / MiB:.2f} | {r['new_bytes'] / MiB:.1f} | {r['cache_bytes'] / MiB:.1f} "
              f"| {r['fp_layer_bytes'] / MiB:.1f} | {r['step_ms']} |")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "serve_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(date=datetime.date.today().isoformat(), argv=sys.argv[1:] if argv is None else argv,
                                   threads=torch.get_num_threads(), torch=torch.__version__, rows=rows), indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
