"""kvcompile under tensor parallelism (kvcompile.tp), run as a user runs it: ``torchrun --nproc_per_node 2``,
gloo on the CPU, tiny Llama and Qwen2 models (GQA: 4 heads, 2 KV heads) loaded with ``tp_plan="auto"``.

One torchrun job (tests/tp_worker.py) runs every scenario on 2 ranks and writes what each rank saw; the
unsharded references are computed here meanwhile. The contract:

- Policy.full(): each rank generates exactly the unsharded model's tokens (greedy and sampled);
- quantized policies: exactly the unsharded kvcompile model's tokens, and each rank's store holds its KV
  heads coded bit for bit as an unsharded store codes them (quantization is per KV head);
- each rank's cache is 1/world of the unsharded one plus the per-sequence bytes every store has, counted
  exactly; the planner's per-GPU bytes (``plan.shard``) are the rank's store bytes;
- an error on one rank is raised on every rank, at once (collectives time out after 30 s: a rank left
  waiting fails the test instead of hanging it);
- KV heads that do not split into whole heads per rank are refused with what to do.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

import kvcompile
import profiles
import tp_worker as W
from kvcompile import Policy, Quant
from kvcompile import plan as P
from kvcompile.hf import KVCompileCache, _width
from kvcompile.store import KVState, KVStore, LayerSpec, store_reference

WORLD = 2
JOB_TIMEOUT_S = 240  # the whole job; each collective gives up after tp_worker.TIMEOUT_S
SCENARIOS = ["full", "quant_llama", "quant_qwen2", "user_mesh", "errors", "gqa", "serving"]
NAMES = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


class Job:
    def __init__(self, out: Path, log: str, refs: dict):
        self.out, self.log, self.refs = out, log, refs

    def rank(self, scenario: str, rank: int) -> dict:
        path = self.out / f"{scenario}.{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} did not finish {scenario!r}; the job's log ends:\n{self.log[-4000:]}")
        got = torch.load(path, weights_only=False)
        if "error" in got:
            pytest.fail(f"rank {rank}, {scenario}: {got['error']}\n{got['traceback']}")
        return got

    def ranks(self, scenario: str) -> list[dict]:
        return [self.rank(scenario, r) for r in range(WORLD)]


def references(models: str) -> dict:
    """The unsharded runs: the plain Llama's tokens, and each family under kvcompile with its policy (tokens,
    bytes, stores and what each store received)."""
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(os.path.join(models, "llama"), attn_implementation="sdpa").eval()
    refs = {"plain": W.generate(plain).tolist()}
    torch.manual_seed(0)
    with torch.no_grad():
        refs["sampled"] = plain.generate(input_ids=torch.tensor([W.PROMPT]), max_new_tokens=W.NEW, do_sample=True,
                                         top_k=8).tolist()
    stop = W.record_appends()
    try:
        for family, policy in W.policies().items():
            model = kvcompile.apply(W.load(models, family), policy)
            out = W.generate(model, return_dict_in_generate=True)
            refs[family] = {"tokens": out.sequences.tolist(), "nbytes": out.past_key_values.nbytes,
                            "stores": W.stores(out.past_key_values)}
    finally:
        stop()
    # continuous batching, unsharded: transformers' own paged cache, and kvcompile's under each policy
    refs["cb_plain"] = W.continuous_batching(W.load(models, "llama"))[0]
    for name, policy in (("int8", Policy.int8()), ("llama", W.policies()["llama"])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the windowed policy's "prefix sharing is off"
            tokens, processor = W.continuous_batching(kvcompile.apply(W.load(models, "llama"), policy))
        cache = processor.cache
        refs["cb_" + name] = {"tokens": tokens, "allocated": cache.allocated_nbytes, "heads": cache.specs[0].heads}
    return refs


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    models = tmp_path_factory.mktemp("tp_models")
    W.save_models(models)
    out = tmp_path_factory.mktemp("tp_out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           W.__file__, str(out), str(models), *SCENARIOS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: a timeout ends every rank
    try:
        refs = references(str(models))
        log, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0] + f"\n[killed after {JOB_TIMEOUT_S} s]"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Job(out, log, refs)


# --------------------------------------------------------------------------- tokens
@pytest.mark.slow
def test_full_policy_gives_the_unsharded_models_tokens(job):
    for r, got in enumerate(job.ranks("full")):
        assert (got["world"], got["heads"]) == (2, 1), got  # 2 KV heads over 2 ranks: one each
        assert got["tokens"] == job.refs["plain"], r
        assert got["sampled"] == job.refs["sampled"], r


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_tokens_equal_the_unsharded_kvcompile_models(job, family):
    for r, got in enumerate(job.ranks(f"quant_{family}")):
        assert got["tokens"] == job.refs[family]["tokens"], r


@pytest.mark.slow
def test_continuous_batching_under_tensor_parallelism(job):
    """transformers' continuous batching on every rank over kvcompile's pages of the rank's heads: under
    Policy.full() exactly transformers' own engine's tokens (sharded and not); quantized, exactly kvcompile's
    unsharded engine's (each head is coded as an unsharded store codes it); prompts that begin alike share
    pages on every rank (not under the windowed policy); each rank's cache holds its one KV head, for half
    the unsharded cache's bytes plus what every pool has per page and slot (lengths, block tables). A
    compiled forward (kvcompile's backend on every rank) gives the eager tokens. Requests evicted when the
    pages run out, offloaded to host memory on every rank, give the unsharded model's tokens."""
    for r, got in enumerate(job.ranks("serving")):
        assert got["plain"] == job.refs["cb_plain"], r  # transformers' own, sharded == unsharded (the premise)
        assert got["full"]["tokens"] == job.refs["cb_plain"], r
        assert got["int8_compiled"] == job.refs["cb_int8"]["tokens"], r  # the compiled forward on each rank
        for name in ("int8", "llama"):
            assert got[name]["tokens"] == job.refs["cb_" + name]["tokens"], (r, name)
            assert got[name]["heads"] == 1 and job.refs["cb_" + name]["heads"] == 2
            assert got[name]["free"] == got[name]["blocks"]  # every page back (or only cached)
        assert got["full"]["prefix_tokens"] >= 128 and got["int8"]["prefix_tokens"] >= 128, r
        assert got["llama"]["prefix_tokens"] == 0, r
        whole = job.refs["cb_int8"]["allocated"]
        assert whole // 2 < got["int8"]["allocated"] < whole, r
        # evicted requests offloaded to host memory (cpu_offload_space) on every rank: the unsharded model's tokens
        off = got["offload"]
        assert off["offloaded"] >= 1 and off["restored"] == off["offloaded"], (r, off)
        assert off["tokens"] == off["want"], r


@pytest.mark.slow
def test_a_model_sharded_by_the_user_with_parallelize_module(job):
    for r, got in enumerate(job.ranks("user_mesh")):
        assert got["heads"] == 1
        assert got["tokens"] == job.refs["llama"]["tokens"], r


# --------------------------------------------------------------------------- stores, bit for bit
def _heads(t: torch.Tensor, r: int, h: int) -> torch.Tensor:
    """Rank ``r``'s heads of an unsharded store tensor: dimension 1 of the pool ``[NB, H, ...]`` and of the
    per-sequence ``[B, H, ...]`` tensors; lengths ``[B]`` and the table ``[B, MB]`` are whole."""
    return t[:, r * h:(r + 1) * h] if t.dim() >= 3 else t


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_rank_stores_its_heads_as_an_unsharded_store_does(job, family):
    """Every layer: an unsharded store fed what the ranks' stores received (their heads side by side, the
    same appends) holds, in each rank's heads, that rank's store bit for bit -- codes, scales, zero points,
    ring, sinks, lengths, block table."""
    ranks = job.ranks(f"quant_{family}")
    for i, policy in enumerate(W.policies()[family].resolve(NAMES)):
        mine = [got["stores"][i] for got in ranks]
        h = mine[0]["heads"]
        assert [m["heads"] for m in mine] == [1, 1]
        whole = KVStore(LayerSpec(policy, WORLD * h, 16, "float32"), 1)
        appends = list(zip(*(m["appends"] for m in mine)))
        assert len(appends) == len(mine[0]["appends"]) == W.NEW  # the prefill, then each token but the last
        for per_rank in appends:
            k = torch.cat([a[0] for a in per_rank], 1)
            v = torch.cat([a[1] for a in per_rank], 1)
            whole.append(k, v, per_rank[0][2], kernel=kvcompile.ops.backend(k.device).store)
        for r, m in enumerate(mine):
            for name, a, b in zip(whole.state._fields, m["state"], whole.state):
                assert torch.equal(a, _heads(b, r, h)), (family, i, r, name)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_layer_0_holds_the_unsharded_models_own_bits(job, family):
    """Layer 0's keys and values come from the embedding through the rank's rows of k_proj and v_proj, with
    no collective before them: they are the unsharded model's, and so is every bit of the rank's store."""
    ref = job.refs[family]["stores"][0]
    for r, got in enumerate(job.ranks(f"quant_{family}")):
        mine = got["stores"][0]
        for (k, v, _), (K, V, _) in zip(mine["appends"], ref["appends"]):
            assert torch.equal(k, K[:, r:r + 1]) and torch.equal(v, V[:, r:r + 1]), \
                "the premise: rank's layer-0 inputs differ from the unsharded model's (its matmul rounds otherwise)"
        for name, a, b in zip(KVState._fields, mine["state"], ref["state"]):
            assert torch.equal(a, _heads(b, r, 1)), (family, r, name)


# --------------------------------------------------------------------------- bytes
def per_rank_constant(store: dict, es: int = 4) -> int:
    """Bytes of one layer's cache that do not shrink with its heads: per sequence an int32 length and an
    int32 block-table entry per block, and the two stand-ins' ``B + H + C + D - 3`` elements less their H."""
    B = len(store["lengths"])
    return 4 * B + 4 * sum(len(t) for t in store["tables"]) + 2 * (B + store["width"] + 16 - 3) * es


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_ranks_bytes_are_a_world_th_of_the_unsharded_plus_constants(job, family):
    ref = job.refs[family]
    L = len(ref["tokens"][0]) - 1  # the last token is generated, not stored
    const = 0
    for s in ref["stores"]:
        assert s["lengths"] == [L] and s["width"] == _width(L)
        const += per_rank_constant(s)
    for r, got in enumerate(job.ranks(f"quant_{family}")):
        assert WORLD * got["nbytes"] == ref["nbytes"] + (WORLD - 1) * const, (r, got["nbytes"], ref["nbytes"])
        assert got["nbytes"] < 0.65 * ref["nbytes"]  # (the constants are large next to these tiny stores)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_planners_per_gpu_bytes_are_a_ranks_store_bytes(job, family):
    """``kvcompile plan --tp 2``'s bytes per sequence on one GPU are what a rank's stores hold."""
    shape = P.shard(P.ModelShape(family, 2, 2, 16, 0.0, dtype_bytes=4), WORLD)
    L = len(job.refs[family]["tokens"][0]) - 1
    planned = P.sequence_bytes_expr(W.policies()[family], shape).subs(P.C, L)
    for got in job.ranks(f"quant_{family}"):
        assert sum(s["store_nbytes"] for s in got["stores"]) == planned


# --------------------------------------------------------------------------- errors
@pytest.mark.slow
def test_an_error_on_one_rank_is_raised_on_every_rank(job):
    r0, r1 = job.ranks("errors")
    # rank 1's own errors
    assert r1["policy"].startswith("PolicyError: policy override 7 matches none of the 2 attention layers")
    assert r1["capacity"].startswith("CapacityError: KV cache overflow: sequence 0 holds 0 tokens and appends 20, "
                                     "but the cache is limited to 8 tokens")
    assert r1["wrong_cache"].startswith("ArgumentError: this KVCompileCache holds 2 sequences but the call passes a "
                                        "batch of 1")
    # rank 0 ran fine, and stops with rank 1, told why
    for case in ("policy", "capacity", "wrong_cache"):
        assert r0[case].startswith("RankError: "), (case, r0[case])
        assert f"failed on rank 1 of the tensor-parallel group ({r1[case]})" in r0[case]
    # different calls on the two ranks: both refuse, saying what each was given
    for got in (r0, r1):
        assert got["different_input"].startswith("UnsupportedError: LlamaForCausalLM.forward under kvcompile: the "
                                                  "ranks of the tensor-parallel group were given different calls "
                                                  "(rank 0: batch 1 x 20 tokens, cache holding 0; rank 1: batch "
                                                  "1 x 17 tokens, cache holding 0)")
        assert got["after"] == "no error"  # and they go on together afterwards
        # at once: a rank left waiting would have given up after the collective timeout instead
        assert max(got[c + ".s"] for c in ("policy", "capacity", "wrong_cache", "different_input")) < 10


@pytest.mark.slow
def test_kv_heads_that_do_not_split_into_whole_heads_are_refused(job):
    for r, got in enumerate(job.ranks("gqa")):
        # transformers shards k_proj by rows whatever the heads (it does not replicate KV heads): the sharded
        # model itself cannot run. If a transformers version replicates them, revisit kvcompile.tp.sharding.
        assert got["kv1.model"].startswith("RuntimeError: shape"), got["kv1.model"]
        assert got["kv3.model"].startswith("RuntimeError: shape"), got["kv3.model"]
        assert got["kv1"].startswith("UnsupportedError: tensor parallelism over 2 ranks: this model has fewer KV heads "
                                     "(1) than ranks (2)"), got["kv1"]
        assert f"rank {r} holds 8 of the 16 rows of keys (0.5 heads of 16)" in got["kv1"]
        assert "tensor-parallel size that divides 1 (1)" in got["kv1"]
        assert got["kv3"].startswith("UnsupportedError: tensor parallelism over 2 ranks: this model has 3 KV heads, "
                                     "which 2 ranks cannot split evenly"), got["kv3"]
        assert "tensor-parallel size that divides 3 (1, 3)" in got["kv3"]


# --------------------------------------------------------------------------- without torch.distributed
FORMATS = ["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "none"]
quants = st.builds(Quant, format=st.sampled_from(FORMATS), axis=st.sampled_from(["token", "channel"]),
                   group=st.sampled_from([4, 8, 16]))


@profiles.KERNEL
@given(k=quants, v=quants, residual=st.integers(0, 9), sink=st.integers(0, 3), rotate=st.booleans(),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=5), seed=st.integers(0, 2 ** 16))
def test_a_store_of_some_heads_is_those_heads_of_a_store_of_all(k, v, residual, sink, rotate, chunks, seed):
    """Every format, axis, residual, sink and rotation: storing heads 2-3 of 4 alone (a rank's, contiguous)
    gives those heads of the store of all 4 bit for bit -- nothing in a head's codes depends on another."""
    policy = Policy(k, v, residual=residual, sink=sink, rotate=rotate)
    g = torch.Generator().manual_seed(seed)
    whole, part = (KVStore(LayerSpec(policy, h, 16, "float32"), 2) for h in (4, 2))
    for n in chunks:
        x, y = (torch.randn(2, 4, n, 16, generator=g) * torch.exp(torch.randn(2, 4, n, 1, generator=g)) for _ in "kv")
        whole.append(x, y, kernel=store_reference)
        part.append(x[:, 2:].contiguous(), y[:, 2:].contiguous(), kernel=store_reference)
    for name, a, b in zip(whole.state._fields, part.state, whole.state):
        assert torch.equal(a, b[:, 2:] if b.dim() >= 3 else b), name


def test_a_cache_for_other_heads_is_refused_at_the_call():
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"kv_heads=0 is not valid: expected a positive number of KV heads"):
        KVCompileCache(cfg, Policy.int8(), kv_heads=0)
    cache = KVCompileCache(cfg, Policy.int8(), batch_size=1, dtype=torch.float32)  # the config's 2 heads
    with pytest.raises(ValueError, match=r"holds 2 KV heads per layer, but the model's attention computes 1 here "
                                         r"\(under tensor parallelism.*create the cache with kv_heads=1"):
        cache.prepare(1, 4, torch.float32, "cpu", heads=1)
    fresh = KVCompileCache(cfg, Policy.int8())
    fresh.prepare(1, 4, torch.float32, "cpu", heads=1)
    assert fresh.layers[0].store.spec.heads == 1


# --------------------------------------------------------------------------- kvcompile plan --tp
def test_plan_shards_the_kv_heads_and_weights_over_the_gpus():
    whole = P.PRESETS["llama3-70b"]
    row = P.plan_policy("bf16", 16, P.shard(whole, 2), 4096, 45 * P.GiB)  # 45 GiB for the cache on each GPU
    assert row.bytes_per_token == 320 * 1024 // 2  # 4 of the 8 KV heads: half of 320 KiB per token
    assert row.sequences == 2 * 36                  # each GPU holds half of each of twice the 36 conversations
    # 80 GB GPUs at 90 %: the 141 GB of weights leave nothing on one GPU, 1.5 GB on each of 2, 36.75 GB on 4
    rows = {tp: {r.label: r.sequences for r in P.plan(whole, 4096, tp=tp)} for tp in (2, 4, 8)}
    assert [rows[tp]["ideal 16-bit"] for tp in (2, 4, 8)] == [2, 109, 324]
    assert rows[4]["KIVI 4-bit G32 R128"] == 320
    # per GPU, a sequence's store is 1/tp of the whole one plus its per-sequence ints (length, table entries)
    for policy in (Policy.full(), Policy.kivi(2, sink=4, rotate=True)):
        one, four = (P.sequence_bytes_expr(policy, s).subs(P.C, 4096) for s in (whole, P.shard(whole, 4)))
        ints = sum(4 + 4 * LayerSpec(p, 8, 128).blocks_for(4096) for p in policy.resolve([""] * 80))
        assert 4 * four == one + 3 * ints


def test_plan_refuses_kv_heads_the_gpus_cannot_split():
    with pytest.raises(P.PlanError, match=r"8 KV heads, which 3 GPUs cannot split into whole heads .* divides 8 "
                                          r"\(1, 2, 4, 8\)"):
        P.shard(P.PRESETS["llama3-70b"], 3)


def test_kvcompile_plan_tp(capsys, tmp_path):
    from kvcompile import cli
    assert cli.main(["plan", "--preset", "llama3-70b", "--tp", "4", "--context", "4096",
                     "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Llama 3 70B, per GPU of 4 (tensor parallel: a sequence's cache is split across all 4): "
                          "80 layers x 2 of 8 KV heads x 128, 4,096-token sequences, 36.8 GB"), out
    seqs = {line.split()[1]: int(line.split()[-2]) for line in out.splitlines() if line.startswith("ideal")}
    assert seqs["16-bit"] == 109
    import json
    assert json.loads((tmp_path / "p.json").read_text())["model"]["tp"] == 4
    assert cli.main(["plan", "--preset", "llama3-70b", "--tp", "3"]) == 2
    assert "kvcompile plan: error: --tp 3: tensor parallelism over 3 GPUs: Llama 3 70B has 8 KV heads" in \
        capsys.readouterr().err
