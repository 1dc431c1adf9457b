"""kvcompile's paths with quantized policies on the device ``--device`` names: the CUDA subset's own tests
(``pytest --device cuda``; on the CPU they run in the suite like any other). Every model, cache and input is on
the ``device`` fixture's device, and each test checks that the store's tensors are there too.

- ``apply`` across model families, and every ``generate`` mode, under KIVI int4: the tokens stay close to the
  unmodified model's (a bound on the logits of the same forced sequence), the cache is really packed;
- a long prompt's chunks over a packed past (on CUDA the prefill path in bf16: SDPA's flash kernel over the past
  read back in the model's dtype);
- the backend in transformers' recipe (the forward compiled, ``cache_implementation="static"``), with
  ``mode="reduce-overhead"`` (CUDA graphs between kvcompile's ops on a GPU; the same tokens and logits as without
  them), and over a gpt-fast-style module's own static buffers;
- continuous batching (``generate_batch``) under KIVI int4: the tokens kvcompile's own ``generate`` gives.

Policy.full()'s exactness on the device is ``tests/test_exact.py`` (in the subset too).
"""
from __future__ import annotations

import pytest
import torch
from tiers import slow_after
from transformers import GenerationConfig

import kvcompile
from kvcompile import Policy
from kvcompile.passes import counters

pytestmark = pytest.mark.device

KIVI = Policy.kivi(4, group=4, residual=8)
DT = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    yield


def on(device, store) -> bool:
    return all(t.device.type == device.type for t in store.state)


def close(want, got, frac=0.1):
    """Logits of the same forced sequence within ``frac`` of the largest (the quantized policies' bound in
    ``tests/test_generate.py``)."""
    w, g = torch.stack(want).float(), torch.stack(got).float()
    err = (g - w).abs().max()
    assert err < frac * w.abs().max(), err


def forced(model, ids, new):
    """Logits of ``model`` along the greedy continuation it picks (a forced sequence for the comparison)."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    return out


def family_model(family):
    """``tests/passes/test_model_families.py``'s tiny model of ``family`` (loaded by path: ``passes`` is also
    the name of the repository's pass package)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "kvcompile_test_model_families"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parent / "passes" / "test_model_families.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name].tiny(family)


FAMILIES = ["Llama", "Mistral", "Qwen2", "Qwen3", "Phi3", "Gemma3Text", "GPTNeoX", "GPTBigCode", "Mixtral"]


@pytest.mark.parametrize("family", slow_after(1, FAMILIES))
def test_apply_across_families_on_the_device(family, device):
    """``apply`` with KIVI int4 on each family, on the device: greedy decoding (logits within the bound of the
    unmodified model's along the same tokens), every layer's store on the device and holding packed blocks."""
    ref = family_model(family).to(DT).to(device)
    model = type(ref)(ref.config).to(DT).to(device).eval()
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    kvcompile.apply(model, Policy.kivi(4, group=4, residual=4), compiler="eager")
    got = forced(model, ids, 12)
    with torch.no_grad():  # the reference's logits along the applied model's tokens
        want = ref(got.sequences[:, :-1]).logits[:, ids.shape[1] - 1:]
    close(list(want.unbind(1)), got.logits, 0.15)
    cache = got.past_key_values
    stores = [layer.store for layer in cache.layers if hasattr(layer, "store")]
    assert stores and all(on(device, st) for st in stores)
    assert any(st.used_blocks > 0 for st in stores)  # tokens were packed, not all held in the window


MODES = {
    "greedy": dict(max_new_tokens=16, do_sample=False),
    "sampling": dict(max_new_tokens=16, do_sample=True, top_k=10),
    "beam-return-2": dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False),
    "prompt-lookup": dict(max_new_tokens=16, prompt_lookup_num_tokens=3, do_sample=False),
    "chunked-prefill": dict(max_new_tokens=16, prefill_chunk_size=7, do_sample=False),
}


@pytest.fixture(scope="module")
def kivi_pair(device):
    """One unmodified model and its KIVI twin on the device (compiled once for every mode, as a user's)."""
    from test_generate import tiny

    ref = tiny(dtype=DT, seed=3).to(device)
    model = tiny(dtype=DT, seed=3).to(device)
    return ref, kvcompile.apply(model, KIVI, compiler="eager")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_modes_under_kivi_on_the_device(kivi_pair, mode, device):
    from test_generate import PROMPT

    ref, model = kivi_pair
    ids = torch.cat([PROMPT, PROMPT.flip(1)], 1).to(device)  # 28 tokens: past the window, really packed
    with torch.no_grad():
        torch.manual_seed(0)
        got = model.generate(ids, return_dict_in_generate=True, output_logits=True, **MODES[mode])
        want = ref(got.sequences[:, :-1]).logits[:, ids.shape[1] - 1:]
    assert got.sequences.device.type == device.type
    if got.logits[0].shape[0] == want.shape[0]:  # (beam search's logits are the beams', not the sequences')
        close(list(want.unbind(1))[:len(got.logits)], got.logits, 0.15)
    assert all(on(device, layer.store) for layer in got.past_key_values.layers)


def test_long_prompt_chunks_over_a_packed_past_on_the_device(device, monkeypatch):
    """A 160-token prompt prefilled in chunks of 80 under KIVI int4 in bf16: the second chunk attends to 80
    queries over a packed past, which on CUDA is the prefill path in the model's dtype (``templates.prefill``:
    the past read back by ``templates.past``, then SDPA's flash kernel) and on the CPU the same path in fp32.
    The logits stay within the bound of the unmodified model's along the same tokens."""
    from kvcompile.templates import prefill
    from test_generate import tiny

    calls = []
    real = prefill.prefill_attention

    def spy(q, *a, **kw):
        calls.append((q.shape[2], kw.get("operands", torch.float32), kw.get("kernel", False)))
        return real(q, *a, **kw)

    monkeypatch.setattr(prefill, "prefill_attention", spy)
    ref = tiny(dtype=DT, seed=7).to(device)
    model = tiny(dtype=DT, seed=7).to(device)
    kvcompile.apply(model, KIVI, compiler="eager")
    ids = torch.randint(3, 64, (1, 160), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, prefill_chunk_size=80,
                             return_dict_in_generate=True, output_logits=True)
        want = ref(got.sequences[:, :-1]).logits[:, ids.shape[1] - 1:]
    close(list(want.unbind(1)), got.logits, 0.15)
    cuda = device.type == "cuda"
    assert (80, DT if cuda else torch.float32, cuda) in calls, calls
    assert all(on(device, layer.store) for layer in got.past_key_values.layers if hasattr(layer, "store"))


@pytest.mark.slow
def test_backend_in_transformers_static_cache_recipe(device):
    """transformers' recipe: the forward compiled by the backend (Inductor), ``cache_implementation="static"``.
    ``mode="reduce-overhead"`` records CUDA graphs between kvcompile's ops on a GPU (none skipped), and gives the
    tokens and logits the same recipe gives without them."""
    from torch._dynamo.utils import counters as dynamo_counters

    from test_generate import PROMPT, tiny

    outs = []
    for m in (None, "reduce-overhead"):
        torch._dynamo.reset()
        model = tiny(dtype=DT, seed=4).to(device)
        opts = {"policy": KIVI, **({"mode": m} if m else {})}
        model.forward = torch.compile(model.forward, backend="kvcompile", options=opts)
        with torch.no_grad():
            outs.append(model.generate(torch.cat([PROMPT, PROMPT], 1).to(device), max_new_tokens=16,
                                       do_sample=False, cache_implementation="static",
                                       return_dict_in_generate=True, output_logits=True))
    assert counters["attention_op"] > 0 and counters["allocation_standin"] > 0
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].logits, outs[1].logits))
    if device.type == "cuda":
        skips = {k: v for k, v in dynamo_counters["inductor"].items() if "cudagraph_skip" in k}
        assert not any(skips.values()), skips


@pytest.mark.slow
def test_backend_over_a_gpt_fast_modules_static_buffers(device):
    """gpt-fast's recipe: its model (cache buffers written by ``k_out[:, :, input_pos] = k``) compiled whole by
    the backend, decoding one token per call. The store shadows the buffers; with ``mode="reduce-overhead"`` the
    tokens are those without CUDA graphs."""
    from test_exact import gpt_fast

    gf = gpt_fast()
    runs = []
    for m in (None, "reduce-overhead"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = gf.Transformer(gf.ModelArgs()).eval().to(DT)
        model.setup_caches(max_batch_size=2, max_seq_length=96, dtype=DT)
        model.to(device)
        opts = {"policy": Policy.kivi(4, group=8, residual=8), **({"mode": m} if m else {})}
        fn = torch.compile(model, backend="kvcompile", options=opts)
        prompt = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5)).to(device)
        with torch.no_grad():
            logits = [fn(prompt, torch.arange(20, device=device))]
            for i in range(24):
                logits.append(fn(logits[-1][:, -1:].argmax(-1), torch.tensor([20 + i], device=device)))
        runs.append(torch.cat([x[:, -1] for x in logits]))
        from kvcompile import modules
        stores = modules.stores(model)
        assert stores and all(on(device, st) for st in stores.values())
    assert counters["attention_op"] > 0
    assert torch.equal(runs[0], runs[1])


@pytest.mark.slow
def test_continuous_batching_on_the_device(device, monkeypatch):
    """The manager API under KIVI int4 with the model on the device: every request gets the tokens kvcompile's
    own ``generate`` gives it (the same stored bytes, the same kernels; fp32, and on the CPU one kernel thread,
    as in ``test_serving``: a bf16 tiny model's near-tied tokens flip with a decode split's last bits), and the
    serving stores are on the device."""
    from kvcompile.templates import cpu
    from test_generate import tiny
    from test_serving import cb_config, prompts

    monkeypatch.setattr(cpu, "FIXED_THREADS", 1)
    gen = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model = kvcompile.apply(tiny(seed=6).to(device), KIVI, compiler="eager")
    ps = prompts()  # each prefilled whole (max_batch_tokens=512), as generate's one prefill
    with torch.no_grad():
        manager = model.init_continuous_batching(gen, cb_config(max_batch_tokens=512, num_blocks=16))
        manager.start()
        try:
            ids = manager.add_requests(inputs=ps, max_new_tokens=12)
            got = {}
            while len(got) < len(ids):
                r = manager.get_result(timeout=120)
                assert r is not None and r.error is None, r
                if r.is_finished():
                    got[r.request_id] = r.generated_tokens
            cache = manager.batch_processor.cache
            assert all(on(device, st) for st in cache.stores)
        finally:
            manager.stop(block=True, timeout=60)
        for p, rid in zip(ps, ids):
            want = model.generate(torch.tensor([p], device=device), generation_config=gen)[0, len(p):].tolist()
            assert got[rid] == want
