"""One rank of the tensor-parallel tests (tests/test_tp.py), run as the user runs it:

    torchrun --nproc_per_node 2 tests/tp_worker.py OUT MODELS SCENARIO...

MODELS is a folder of tiny models saved by ``save_models`` (``llama``, ``qwen2``, ``kv1``, ``kv3``); each
scenario loads what it needs with ``from_pretrained(..., tp_plan="auto")`` (or shards it with a DeviceMesh and
``parallelize_module``), runs it, and writes ``OUT/<scenario>.<rank>.pt``: what it saw (tokens, bytes, the
stores' tensors, the appends each store received, errors as ``"Type: message"``) for the test to check.
A scenario that raises writes its error and the next one runs; collectives time out after ``TIMEOUT_S``, so
a rank left waiting fails fast instead of hanging the test.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT_S = 30
PROMPT = [5, 9, 13, 9, 13, 22, 7, 9, 13, 31, 17, 9, 13, 22, 40, 3, 11, 9, 13, 22]
NEW = 12


def policies():
    from kvcompile import Policy
    return {
        # per-layer policies, rotation, sinks, two formats (KIVI int2 per channel / per token, int8 per token)
        "llama": Policy.kivi(2, group=4, residual=4, sink=2, rotate=True).override({1: Policy.int8()}),
        # fp8 per token with a residual, int4 KIVI on layer 0
        "qwen2": Policy.fp8(residual=4).override({0: Policy.kivi(4, group=8, residual=2)}),
    }


def save_models(folder) -> None:
    """The tiny models the scenarios load: two families with GQA (4 heads, 2 KV heads of 16, 2 layers), and
    two whose KV heads do not split over 2 ranks (1 KV head; 3 KV heads of 6 heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    def save(name, cls, config, heads=4, kv=2, seed=0):
        torch.manual_seed(seed)
        cfg = config(vocab_size=64, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, max_position_embeddings=512,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls(cfg).save_pretrained(os.path.join(folder, name))

    save("llama", LlamaForCausalLM, LlamaConfig)
    save("qwen2", Qwen2ForCausalLM, Qwen2Config, seed=1)  # q/k/v biases, sharded with their rows
    save("kv1", LlamaForCausalLM, LlamaConfig, kv=1)
    save("kv3", LlamaForCausalLM, LlamaConfig, heads=6, kv=3)


# --------------------------------------------------------------------------- what each store received
APPENDS: dict[int, list] = defaultdict(list)


def record_appends():
    """Every KVStore.append keeps a copy of its keys and values (in the order they came), per store. Returns
    a function that stops recording."""
    from kvcompile.store import KVStore
    orig = KVStore.append

    def append(self, k, v, n_new=None, kernel=None):
        APPENDS[id(self)].append((k.detach().clone(), v.detach().clone(), None if n_new is None else n_new.clone()))
        return orig(self, k, v, n_new, kernel)

    KVStore.append = append

    def stop():
        KVStore.append = orig
        APPENDS.clear()
    return stop


def load(models, name, **kw):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.join(models, name), attn_implementation="sdpa",
                                                **kw).eval()


def generate(model, ids=None, **kw):
    ids = torch.tensor([PROMPT]) if ids is None else ids
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, **kw)


def stores(cache):
    """Per layer: (its state tensors, the appends it received, its spec's heads)."""
    from kvcompile.hf import KVCompileLayer
    out = []
    for layer in cache.layers:
        assert isinstance(layer, KVCompileLayer)
        st = layer.store
        out.append({"state": [t.clone() for t in st.state], "appends": APPENDS[id(st)], "heads": st.spec.heads,
                    "lengths": list(st.lengths), "tables": [list(t) for t in st.tables],
                    "width": layer.keys.shape[2], "nbytes": layer.nbytes, "store_nbytes": st.nbytes})
    return out


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- scenarios
def full(models, rank):
    """Policy.full() on the tp_plan="auto" Llama: greedy and sampled tokens, bytes."""
    import kvcompile
    from kvcompile import Policy
    model = kvcompile.apply(load(models, "llama", tp_plan="auto"), Policy.full())
    out = generate(model, return_dict_in_generate=True)
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=True, top_k=8)
    return {"tokens": out.sequences.tolist(), "sampled": sampled.tolist(), "nbytes": out.past_key_values.nbytes,
            "heads": model._kvcompile.sharding.heads, "world": model._kvcompile.sharding.world}


def quantized(family):
    def run(models, rank):
        import kvcompile
        APPENDS.clear()
        model = kvcompile.apply(load(models, family, tp_plan="auto"), policies()[family])
        out = generate(model, return_dict_in_generate=True)
        cache = out.past_key_values
        return {"tokens": out.sequences.tolist(), "nbytes": cache.nbytes, "stores": stores(cache)}
    return run


def user_mesh(models, rank):
    """The Llama sharded by the user: a DeviceMesh and torch's parallelize_module (no tp_plan)."""
    import kvcompile
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = load(models, "llama")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    APPENDS.clear()
    model = kvcompile.apply(model, policies()["llama"])
    out = generate(model, return_dict_in_generate=True)
    return {"tokens": out.sequences.tolist(), "nbytes": out.past_key_values.nbytes,
            "heads": model._kvcompile.sharding.heads}


def errors(models, rank):
    """An error on rank 1 only: every rank raises (rank 0 a RankError), and the ranks still work together."""
    import kvcompile
    from kvcompile import Policy
    from kvcompile.hf import KVCompileCache
    from kvcompile.hf_model import cache_kwarg
    got = {}

    def case(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
            got[name] = "no error"
        except Exception as e:  # noqa: BLE001  (the test reads which error each rank saw)
            got[name] = err(e)
        got[name + ".s"] = time.perf_counter() - t0
        dist.barrier()  # both ranks are here again (a rank left in a collective would time out instead)

    model = load(models, "llama", tp_plan="auto")
    bad = Policy.int8().override({7: Policy.full()}) if rank == 1 else Policy.int8()  # layer 7: none
    case("policy", lambda: kvcompile.apply(model, bad))
    model = kvcompile.apply(load(models, "llama", tp_plan="auto"), Policy.int8())  # (rank 0's is applied already)
    model_limited = load(models, "llama", tp_plan="auto")
    limited = kvcompile.apply(model_limited, Policy.int8(), max_cache_len=8 if rank == 1 else None)
    case("capacity", lambda: generate(limited))
    cache = KVCompileCache(model.config, Policy.int8(), batch_size=2 if rank == 1 else 1, kv_heads=1)
    case("wrong_cache", lambda: model(torch.tensor([PROMPT]), use_cache=True, **{cache_kwarg(model): cache}))
    ids = torch.tensor([PROMPT[:-3] if rank == 1 else PROMPT])
    case("different_input", lambda: generate(model, ids))
    case("after", lambda: generate(model))  # the ranks still run together after all that
    return got


def gqa(models, rank):
    """KV heads that do not split into whole heads per rank: 1 KV head on 2 ranks, 3 on 2."""
    import kvcompile
    from kvcompile import Policy
    got = {}
    for name in ("kv1", "kv3"):
        model = load(models, name, tp_plan="auto")
        try:
            with torch.no_grad():
                model(torch.tensor([PROMPT]))  # the sharded model itself, without kvcompile
            got[name + ".model"] = "no error"
        except Exception as e:  # noqa: BLE001
            got[name + ".model"] = err(e)
        dist.barrier()
        try:
            kvcompile.apply(model, Policy.full())
            got[name] = "no error"
        except Exception as e:  # noqa: BLE001
            got[name] = err(e)
        dist.barrier()
    return got


def cb_prompts() -> list[list[int]]:
    """Continuous batching's requests: mixed lengths, two that open with the same 130 tokens (two whole pages of
    64, shared where the policy shares pages), and one longer than a forward's 64-token budget."""
    head = [3 + (7 * i) % 60 for i in range(130)]
    return [PROMPT, PROMPT[:5], head + [9, 13, 22], head + [40, 3, 11, 9, 13, 22, 7], head[:90]]


def continuous_batching(model, compiled: bool = False, prompts=None, new: int = NEW,
                        offload: float = 0.0) -> tuple[list[list[int]], object]:
    """transformers' manager API on ``model`` (every rank runs it; the scheduling is the same on each): the
    tokens per request, in order, and the batch processor it ran (its cache, its offloading manager).
    ``compiled``: its forward compiled through kvcompile's backend; ``prompts`` (default ``cb_prompts()``)
    each generate ``new`` tokens; ``offload``: GiB of host memory for evicted requests."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcompile import serving
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(num_blocks=24, max_batch_tokens=64, cpu_offload_space=offload,
                                   varlen_compile_config=serving.compile_config("eager") if compiled else None)
    manager = model.init_continuous_batching(gen, cbc)
    manager.start()
    try:
        ids = manager.add_requests(inputs=cb_prompts() if prompts is None else prompts, max_new_tokens=new)
        done = {}
        while len(done) < len(ids):
            r = manager.get_result(timeout=TIMEOUT_S)
            if r is None:
                raise TimeoutError(f"no result within {TIMEOUT_S} s ({len(done)} of {len(ids)} done)")
            if r.error is not None:
                raise RuntimeError(r.error)
            if r.is_finished():
                done[r.request_id] = r.generated_tokens
        processor = manager.batch_processor
    finally:
        manager.stop(block=True, timeout=TIMEOUT_S)
    return [done[i] for i in ids], processor


def serving(models, rank):
    """transformers' continuous batching under tensor parallelism: its own paged cache on the plain sharded
    Llama, and kvcompile's pages under Policy.full(), int8 (prompts that begin alike share pages; also with the
    forward compiled) and the Llama's windowed policy (no sharing): tokens, each rank's store heads and bytes,
    the prompt tokens read from shared pages."""
    import warnings

    import kvcompile
    from kvcompile import Policy
    got = {"plain": continuous_batching(load(models, "llama", tp_plan="auto"))[0]}
    for name, policy in (("full", Policy.full()), ("int8", Policy.int8()), ("llama", policies()["llama"])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the windowed policy's "prefix sharing is off"
            tokens, processor = continuous_batching(kvcompile.apply(load(models, "llama", tp_plan="auto"), policy))
        cache = processor.cache
        got[name] = {"tokens": tokens, "heads": cache.specs[0].heads, "allocated": cache.allocated_nbytes,
                     "prefix_tokens": cache.prefix_tokens, "free": cache.free_blocks_count,
                     "blocks": cache.stores[0].blocks}
    got["int8_compiled"] = continuous_batching(kvcompile.apply(load(models, "llama", tp_plan="auto"), Policy.int8()),
                                               compiled=True)[0]
    # pages for fewer requests than run at once: transformers evicts some, and their caches wait in host memory
    # (each rank its heads', the same requests on every rank) and come back as they were
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (60,), generator=g).tolist() for _ in range(3)]
    plain = load(models, "llama")
    with torch.no_grad():
        want = [plain.generate(torch.tensor([p]), max_new_tokens=100, do_sample=False, eos_token_id=-1,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    model = kvcompile.apply(load(models, "llama", tp_plan="auto"), Policy.full())
    specs = kvcompile.serving.layer_specs(model.config, model._kvcompile_serving, model.dtype)
    kvcompile.serving.configure(model, max_requests=3, budget=3 * sum(s.row_nbytes() for s in specs)
                                + 5 * sum(s.block_nbytes() + 12 for s in specs))
    tokens, processor = continuous_batching(model, prompts=prompts, new=100, offload=0.01)
    offloading = processor.offloading_manager
    got["offload"] = {"tokens": tokens, "want": want, "offloaded": offloading.offloaded,
                      "restored": offloading.restored}
    return got



SCENARIOS = {"full": full, "quant_llama": quantized("llama"), "quant_qwen2": quantized("qwen2"),
             "user_mesh": user_mesh, "errors": errors, "gqa": gqa, "serving": serving}


def main(argv):
    out, models, names = argv[0], argv[1], argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    record_appends()
    for name in names:
        t0 = time.perf_counter()
        try:
            result = SCENARIOS[name](models, rank)
        except Exception as e:  # noqa: BLE001  (written for the test, which fails on it)
            result = {"error": err(e), "traceback": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - t0
        torch.save(result, os.path.join(out, f"{name}.{rank}.pt"))
        print(f"rank {rank}: {name} {result['seconds']:.1f}s {result.get('error', '')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
