"""transformers' own continuous batching over kvcompile's packed store (``kvcompile.serving``).

The contract: on a model ``kvcompile.apply`` prepared, ``generate_batch`` and the manager API run
transformers' engine (its scheduler, its page accounting) with kvcompile's cache and attention. Under
``Policy.full()`` the tokens are exactly transformers' own continuous batching's (and plain ``generate``'s);
under a quantized policy they are exactly what kvcompile's ``generate`` gives for the same policy (the same
stored bytes, read by the same kernels), so the quantization is kvcompile's and nothing falls back to full
precision: for prompts prefilled in one forward, exactly its whole-prompt ``generate``; for a prompt split across
forwards (longer than a forward's token budget), exactly its ``generate`` with the same prefill chunks, each
chunk reading the earlier ones as stored. Requests of mixed lengths, prefills split across forwards, finished
requests freeing their blocks, requests waiting for a slot. Tiny random Llamas, as in ``test_generate``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import kvcompile
from kvcompile import KVCompileError, Policy
from kvcompile import serving
from test_generate import tiny
from tiers import slow_after

torch.set_num_threads(1)

KIVI = Policy.kivi(4, group=4, residual=8)
KIVI2 = Policy.kivi(2, group=4, residual=4)
NEW = 12
GEN = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)


def prompts():
    g = torch.Generator().manual_seed(3)
    # mixed lengths: one token, short, several pages (64-token blocks), and two longer than a forward's token
    # budget (max_batch_tokens=64 below): their prefills are split across forwards, beside other requests' decodes
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (1, 5, 19, 70, 150, 33)]


def cb_config(**kw):
    return ContinuousBatchingConfig(**{"num_blocks": 8, "max_batch_tokens": 64, **kw})


def tokens(out) -> list[list[int]]:
    for r in out.values():
        assert r.error is None, r.error
    return [r.generated_tokens for r in out.values()]


def generated(model, p, config=GEN) -> list[int]:
    """The tokens ``generate`` gives after prompt ``p`` (a list of ids) under ``config``."""
    return model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist()


@pytest.fixture(scope="module")
def reference():
    """transformers' own continuous batching, and plain generate, on the unmodified model."""
    ref = tiny()
    with torch.no_grad():
        cb = tokens(ref.generate_batch(prompts(), GEN, continuous_batching_config=cb_config(), progress_bar=False))
        gen = [generated(ref, p) for p in prompts()]
    return ref, cb, gen


def applied(policy, **configure):
    model = kvcompile.apply(tiny(), policy)
    if configure:
        serving.configure(model, **configure)
    return model


def run_manager(model, inputs, cbc=None, while_running=None):
    """The manager API: start, add requests, collect every result; returns (tokens in order, the cache, what
    the cache looked like while the requests ran). ``while_running``: called once the requests are added."""
    manager = model.init_continuous_batching(GEN, cbc or cb_config())
    seen = {}
    manager.start()
    try:
        ids = manager.add_requests(inputs=inputs, max_new_tokens=NEW)
        if while_running is not None:
            while_running()
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=30)
            assert r is not None, "no result within 30 s"
            if r.is_finished():
                results[r.request_id] = r
                if "impl" not in seen:  # while the manager runs, attention is kvcompile's
                    seen["impl"] = model.config._attn_implementation
        cache = manager.batch_processor.cache
        seen["free_after"] = cache.free_blocks_count
        seen["slots_after"] = dict(cache.slot_of)
    finally:
        manager.stop(block=True, timeout=30)
    assert model.config._attn_implementation == "sdpa"  # restored
    out = [results[i] for i in ids]
    assert all(r.error is None for r in out), [r.error for r in out]
    return [r.generated_tokens for r in out], cache, seen


# --------------------------------------------------------------------------- Policy.full(): exactly transformers'
def test_full_policy_gives_transformers_own_continuous_batching_tokens(reference):
    _, want_cb, want_gen = reference
    assert want_cb == want_gen  # transformers' CB and its generate agree on this model (the premise)
    model = applied(Policy.full())
    with torch.no_grad():
        got = tokens(model.generate_batch(prompts(), GEN, continuous_batching_config=cb_config(), progress_bar=False))
    assert got == want_cb
    # and plain generate on the applied model still works afterwards (attention implementation restored)
    p = prompts()[2]
    assert generated(model, p) == want_gen[2]


def test_the_manager_runs_on_kvcompiles_store_and_finished_requests_free_their_blocks(reference):
    _, want, _ = reference
    model = applied(Policy.full())
    got, cache, seen = run_manager(model, prompts())
    assert got == want
    # Policy.full(): transformers' own SDPA reads the pages back (its arithmetic: test_exact.py)
    assert isinstance(cache, serving.cache_class()) and seen["impl"] == "sdpa"
    blocks = cache.stores[0].blocks
    assert blocks == cache.num_blocks  # one kvcompile block per transformers page
    assert seen["free_after"] == blocks and seen["slots_after"] == {}  # every block and slot back
    assert all(st.used_blocks == 0 and st.lengths == [0] * cache.slots for st in cache.stores)
    # the keys went through the store: the 150-token prompt's packed tokens filled whole blocks of the pool
    st = cache.stores[1]
    written = int((st.state.k_codes.flatten(1) != 0).any(1).sum())
    assert written >= (150 - st.spec.ring) // st.spec.block, (written, st.spec.block)
    # transformers' own full-precision cache tensor was never allocated
    assert cache.cache_tensor.device.type == "meta"


@pytest.mark.slow
def test_a_request_longer_than_the_models_positions_widens_its_table():
    """A slot's block table is as wide as a request of the model's positions needs (``table_width``); a request
    past them (transformers' engine does not refuse one) widens its store's table and decodes as transformers'
    own engine does."""
    def short(model):
        model.config.max_position_embeddings = 64  # the 70- and 150-token prompts are longer: one 64-token block
        return model

    with torch.no_grad():
        want = tokens(short(tiny()).generate_batch(prompts(), GEN, continuous_batching_config=cb_config(),
                                                   progress_bar=False))
        model = kvcompile.apply(short(tiny()), Policy.full())
        assert serving.table_width(serving.layer_specs(model.config, model._kvcompile_serving, model.dtype), 8, 64) == 1
        got = tokens(model.generate_batch(prompts(), GEN, continuous_batching_config=cb_config(), progress_bar=False))
    assert got == want


def test_generate_batch_with_no_configuration(reference):
    """The obvious call, ``model.generate_batch(prompts, generation_config)``: transformers' default continuous
    batching config (no page count, its default token budget) over kvcompile's default budget. transformers'
    memory check counts what it allocates itself (its full-precision pages are not allocated), so a small model
    whose default budget buys many pages is not refused; the tokens are transformers' own (its engine's with a
    given page count: its default would size its cache to most of this machine's free memory)."""
    _, want, _ = reference
    model = applied(Policy.full())
    with torch.no_grad():
        got = tokens(model.generate_batch(prompts(), GEN, progress_bar=False))
        again = tokens(model.generate_batch(prompts(), GEN, progress_bar=False))
    assert got == want and again == want


@pytest.fixture
def one_kernel_thread(monkeypatch):
    """kvcompile's CPU kernels on one thread whatever the load. They follow the free cores call by call, and the
    count sets how a decode's positions are split (flash-decoding), which moves the last bits of the attention:
    enough to flip a random tiny model's near-tied tokens when two threads load the machine in one run and not
    in the other. (New threads start with torch's default thread count, not this module's one.)"""
    from kvcompile.templates import cpu
    monkeypatch.setattr(cpu, "FIXED_THREADS", 1)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [Policy.full(), KIVI], ids=["full", "kivi4"])
def test_two_threads_batching_on_one_model(policy, one_kernel_thread):
    """Two threads each call ``generate_batch`` on the same applied model, as transformers' own engine allows
    (a manager and a cache each): one long call, and beside it short calls whose managers start and stop while
    the long one runs. Each gets exactly the tokens it gets alone: no forward reads the other manager's cache,
    and the first manager to stop does not take the model's attention from the one still running."""
    import threading

    model = applied(policy)
    long_gen = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=-1, pad_token_id=0)
    short_gen = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    short_prompts = prompts()[:3]
    with torch.no_grad():
        want_long = tokens(model.generate_batch(prompts(), long_gen, continuous_batching_config=WHOLE,
                                                progress_bar=False))
        want_short = tokens(model.generate_batch(short_prompts, short_gen, continuous_batching_config=WHOLE,
                                                 progress_bar=False))
    got, errors = {"short": []}, []
    # The long call's forwards run in its manager's thread: the first forward seen before any short call started
    # names it. Its third forward waits until the first short call has stopped, and the second short call waits
    # until the long call has run a forward after that stop: so the long call surely runs on after a short
    # manager stopped, whatever the machine's load (the two otherwise race).
    long_thread, long_forwards, short_started = [], [], threading.Event()
    long_running, short_stopped, short_running = threading.Event(), threading.Event(), threading.Event()
    forwards_after_a_stop, long_ran_after_a_stop = [], threading.Event()

    def pre_forward(*_):
        me = threading.get_ident()
        if not long_thread and not short_started.is_set():
            long_thread.append(me)
        if long_thread and me == long_thread[0]:
            long_forwards.append(1)
            long_running.set()
            if len(long_forwards) == 3 and not short_stopped.wait(timeout=120):
                errors.append(AssertionError("no short call stopped within 120 s of the long call's start"))
            if short_stopped.is_set() and not short_running.is_set():
                forwards_after_a_stop.append(1)
                long_ran_after_a_stop.set()

    hook = model.model.register_forward_pre_hook(pre_forward)

    def long_call():
        try:
            with torch.no_grad():
                got["long"] = tokens(model.generate_batch(prompts(), long_gen, continuous_batching_config=WHOLE,
                                                          progress_bar=False))
        except BaseException as e:  # noqa: BLE001 -- reported below, in the test's thread
            errors.append(e)

    def short_calls():
        try:
            assert long_running.wait(timeout=120), "the long call never ran a forward"
            short_started.set()
            with torch.no_grad():
                for i in range(3):
                    short_running.set()
                    got["short"].append(tokens(model.generate_batch(
                        short_prompts, short_gen, continuous_batching_config=WHOLE, progress_bar=False)))
                    short_running.clear()
                    short_stopped.set()
                    if i == 0:  # the next short call starts once the long one has run alone
                        assert long_ran_after_a_stop.wait(timeout=120), "the long call stopped with the short one"
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=long_call), threading.Thread(target=short_calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    hook.remove()
    assert not errors, errors
    assert got["long"] == want_long
    assert got["short"] == [want_short] * 3
    assert forwards_after_a_stop, "no forward of the long call ran after a short call had stopped"
    assert model.config._attn_implementation == "sdpa"  # put back once both are done


@pytest.mark.slow
def test_generate_while_a_manager_runs_is_refused_and_the_manager_goes_on():
    """While a manager runs, the model's attention is kvcompile's paged one, which serves only the manager's
    forwards: plain ``generate`` in another thread is refused saying what to do, and the manager's requests get
    their tokens all the same; once it stops, ``generate`` runs again. (int8: under Policy.full() the attention
    stays transformers' own.)"""
    model = applied(Policy.int8())
    p = prompts()[4]
    with torch.no_grad():
        want_cb = tokens(model.generate_batch(prompts(), GEN, continuous_batching_config=WHOLE, progress_bar=False))
        want_gen = generated(model, p)

    def refused():
        assert model.config._attn_implementation == serving.ATTN
        with torch.no_grad(), pytest.raises(KVCompileError, match="stop the manager"):
            generated(model, p)

    got, _, _ = run_manager(model, prompts(), WHOLE, while_running=refused)
    assert got == want_cb
    with torch.no_grad():
        assert generated(model, p) == want_gen


# --------------------------------------------------------------------------- quantized policies
# Forwards that hold every prompt whole (the six prompts' 278 tokens and their pages): what generate's one prefill
# reads; a split prefill has its own test below.
WHOLE = cb_config(max_batch_tokens=512, num_blocks=16)


@pytest.mark.parametrize("policy", slow_after(1, [KIVI, KIVI2]), ids=["kivi4", "kivi2"])
def test_quantized_policy_gives_kvcompiles_own_generate_tokens(reference, policy):
    """The same stored bytes as kvcompile's generate under the policy, so the same tokens; and not the
    unquantized model's everywhere at 2 bits (the cache really is quantized), while close at 4 bits."""
    _, want_full, _ = reference
    model = applied(policy)
    with torch.no_grad():
        got = tokens(model.generate_batch(prompts(), GEN, continuous_batching_config=WHOLE, progress_bar=False))
        gen = [generated(model, p) for p in prompts()]
    assert got == gen
    same = sum(a == b for g, w in zip(got, want_full) for a, b in zip(g, w)) / sum(len(w) for w in want_full)
    if policy is KIVI:
        assert same >= 0.75, same
    else:
        assert got != want_full


def kivi_fp8s(bits):
    return Policy.kivi(bits, group=8, residual=8, sink=4, rotate=True, scale_dtype="fp8_e4m3")


@pytest.mark.parametrize("policy", [
    Policy.int8(), Policy.fp8(residual=8), Policy.kivi(3, group=4, residual=8),
    Policy.kivi(4, group=4, residual=8, sink=4, rotate=True),  # kvcompile serve's default, scaled to this model
    Policy.kivi(2, group=4, residual=0, sink=2, rotate=True, scale_dtype="fp8_e4m3"),
    kivi_fp8s(4),  # values: the whole head
    kivi_fp8s(2).override({1: kivi_fp8s(3)}),  # bits per layer, as calibrate writes them: blocks differ in bytes
], ids=["int8", "fp8", "kivi3", "kivi4-rot-sink", "kivi2-r0-fp8-scales", "kivi4-head-groups-fp8-scales",
        "per-layer-bits"])
@pytest.mark.slow
def test_every_format_serves_kvcompiles_own_generate_tokens(policy):
    """Integers per token, fp8, 3-bit codes, sinks, the Hadamard rotation, fp8 scales, bits chosen per layer:
    continuous batching gives what kvcompile's generate gives under the same policy (three prompts of 1, 19
    and 70 tokens, each prefilled whole)."""
    ps = [prompts()[i] for i in (0, 2, 3)]
    model = applied(policy)
    with torch.no_grad():
        got = tokens(model.generate_batch(ps, GEN, continuous_batching_config=WHOLE, progress_bar=False))
        want = [generated(model, p) for p in ps]
    assert got == want


@pytest.mark.slow
def test_a_prompt_split_across_forwards_is_generates_chunked_prefill():
    """A prompt longer than a forward's token budget is prefilled in chunks, the later reading the earlier as
    stored: under a quantized policy continuous batching gives exactly kvcompile's generate with
    ``prefill_chunk_size`` at the forward's budget, which for this 2-bit policy and 150-token prompt differs from
    one whole prefill at 16 and 40 tokens a forward (so the split is seen); under ``Policy.full()`` every split
    is the whole prefill's."""
    p = prompts()[4]
    kivi2 = Policy.kivi(2, group=8, residual=8, sink=4, rotate=True)
    for quantized, policy in ((True, kivi2), (False, Policy.full())):
        model = applied(policy)
        with torch.no_grad():
            whole = generated(model, p)
            for chunk in (16, 40):
                got = tokens(model.generate_batch([p], GEN, progress_bar=False,
                                                  continuous_batching_config=cb_config(max_batch_tokens=chunk)))[0]
                chunked = GenerationConfig(**{**GEN.to_dict(), "prefill_chunk_size": chunk})
                split = generated(model, p, chunked)
                assert got == split, (policy, chunk)
                assert (split != whole) if quantized else (split == whole), (policy, chunk)


@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first", "no-such-scheduler"])
def test_a_quantized_prompts_pieces_are_generates_whatever_runs_beside_it(scheduler):
    """Under a quantized policy both of transformers' schedulers cut a prompt at multiples of the forward's token
    budget (``kvcompile.scheduler``), and so does the ``fifo`` transformers falls back to for a name it does not
    know: the 150-token prompt beside five others, all at 40 tokens a forward, gets kvcompile's ``generate``
    tokens with ``prefill_chunk_size=40``, as do the others (the shorter ones whole)."""
    kivi2 = Policy.kivi(2, group=8, residual=8, sink=4, rotate=True)
    model = applied(kivi2)
    chunked = GenerationConfig(**{**GEN.to_dict(), "prefill_chunk_size": 40})
    with torch.no_grad():
        got = tokens(model.generate_batch(prompts(), GEN, progress_bar=False, continuous_batching_config=cb_config(
            max_batch_tokens=40, num_blocks=16, scheduler_type=scheduler)))
        want = [generated(model, p, chunked) for p in prompts()]
    assert got == want


def recorded(manager, batch, ids) -> list[list[tuple]]:
    """Run ``batch`` (prompts, under request ids ``ids``) on a started ``sampling.sampling_manager``: each reply's
    tokens with their log probabilities (its logits' bits, to the float's last bit), recorded as the server
    records them (each request's options in the engine's table, by request id)."""
    from kvcompile.sampling import Asked, RequestOptions

    options = [manager.requests.add(rid, RequestOptions(asked=Asked(top=0))) for rid in ids]
    for p, rid in zip(batch, ids):
        manager.add_request(p, request_id=rid, max_new_tokens=NEW)
    for _ in ids:
        r = manager.get_result(timeout=120)
        assert r is not None and r.error is None, r
    out = [o.asked.take(0, NEW) for o in options]
    for rid in ids:
        manager.requests.remove(rid)
    return out


def exact_products(model):
    """``model`` with its linear layers in float64, rounded once (``benchmarks/batch_invariance.py``'s, which
    says why: torch's float32 products give a row other last bits beside other rows)."""
    from benchmarks.batch_invariance import exact_products as exact
    return exact(model)


def alone_and_together(policy, forward, monkeypatch):
    """Each request's tokens and log probabilities run alone on one thread, then all of them together on three
    (``test_a_request_gets_the_same_tokens_alone_and_in_a_batch``), the model's products exact."""
    from kvcompile.sampling import sampling_manager
    from kvcompile.templates import cpu

    if isinstance(policy, str):
        from kvcompile.evaluate import parse_entry, scheme_policy
        policy = scheme_policy(*parse_entry(policy))
    model = exact_products(applied(policy))
    ps = prompts() + [prompts()[2][::-1]]  # 19 tokens, as the third
    # room for every prompt at once; no prefix sharing: the batched requests would find the pages their own prompts
    # left alone, and read their tokens as stored (a quantized policy's: quantized), where alone they computed them
    cbc = cb_config(num_blocks=16, max_batch_tokens=forward, allow_block_sharing=False)
    monkeypatch.setattr(cpu, "MIN_TILES_PER_THREAD", 1)  # threads even for these short rows
    # the server's engine: each token's log probability is recorded (its logits' bits, to the float's last bit)
    manager = sampling_manager(model, GEN, cbc)
    manager.start()

    runs = iter(range(10**6))

    def run(batch):
        return recorded(manager, batch, [f"r{next(runs)}" for _ in batch])

    try:
        with torch.no_grad():
            monkeypatch.setattr(cpu, "available_threads", lambda: 1)
            alone = [run([p])[0] for p in ps]  # one at a time, in one engine
            monkeypatch.setattr(cpu, "available_threads", lambda: 3)
            together = run(ps)
    finally:
        manager.stop(block=True, timeout=30)
    return alone, together


@pytest.mark.slow
@pytest.mark.parametrize("forward", [512, 40], ids=["whole-prompts", "prompts-in-pieces"])
@pytest.mark.parametrize("policy", [Policy.kivi(2, group=4, residual=4, sink=2, rotate=True), "tok+rot:4"],
                         ids=["kivi2+rot+sink", "tok+rot:4"])
def test_a_request_gets_the_same_tokens_alone_and_in_a_batch(policy, forward, monkeypatch):
    """What kvcompile computes for a request does not depend on what else is in the batch, nor on the threads the
    machine's load leaves its kernels: its store codes each row alone, its decode attention cuts every sequence
    into the same pieces, a prefill piece attends alone, and a prompt longer than a forward is cut at the same
    positions whatever else runs (``kvcompile.scheduler``). So with the model's own products made batch-invariant
    (``exact_products``), a request gets the same tokens alone on one thread and beside the others on three,
    under quantized policies -- with every prompt prefilled in one forward (512 tokens a forward), and with the
    prompts of 70 and 150 tokens prefilled in pieces of 40 while the others prefill and decode beside them
    (docs/usage.md, "What a batch changes"; ``Policy.full()`` runs transformers' own attention instead: the test
    below). Two prompts of one length prefill in the same forward."""
    alone, together = alone_and_together(policy, forward, monkeypatch)
    if together != alone:
        # the control: the unmodified model's own arithmetic (Policy.full(): transformers' attention), products exact,
        # the same requests. Where it too gives a request other bits beside others (seen on an Intel Xeon with AMX,
        # not on the AMD EPYC), the difference is not kvcompile's to assert
        full_alone, full_together = alone_and_together(Policy.full(), forward, monkeypatch)
        if full_together != full_alone:
            pytest.skip("the unmodified model (Policy.full(), exact products) also gives a request other log "
                        "probabilities alone and in this batch on this CPU: its own ops are not batch-invariant here")
    assert together == alone  # every token, and its log probability (the logits) to the last bit


@pytest.mark.slow
def test_under_the_full_policy_a_batch_changes_only_what_it_changes_in_transformers_own_engine():
    """``Policy.full()`` serves through transformers' own attention (its SDPA over the whole forward's tokens, the
    pages read back: its engine's arithmetic bit for bit), and so a request's logits depend on the batch as they
    do in transformers' own engine, and no more: with the model's own products made batch-invariant
    (``exact_products``), each prompt alone and all of them together, kvcompile's tokens and log probabilities
    are transformers' own engine's, to the last bit (docs/usage.md, "What a batch changes")."""
    ps = prompts() + [prompts()[2][::-1]]
    cbc = cb_config(num_blocks=16, max_batch_tokens=512, allow_block_sharing=False, return_logprobs=True)

    def run(model, batch):
        with torch.no_grad():
            out = model.generate_batch(batch, GEN, continuous_batching_config=cbc, progress_bar=False)
        assert all(r.error is None for r in out.values())
        got = {tuple(r.prompt_ids): (r.generated_tokens, r.logprobs) for r in out.values()}
        return [got[tuple(p)] for p in batch]

    theirs, ours = exact_products(tiny()), exact_products(applied(Policy.full()))
    for batch in [[p] for p in ps] + [ps]:
        want = run(theirs, batch)
        assert all(len(lp) == NEW for _, lp in want)  # (the log probabilities are there to compare)
        assert run(ours, batch) == want, len(batch)


@pytest.mark.slow
def test_requests_wait_for_a_slot_and_all_complete(reference):
    """Two slots for six requests: the others wait (as for pages), every request completes with the tokens
    transformers' own engine gives, and every slot and block is free at the end."""
    _, want, _ = reference
    model = applied(Policy.full(), max_requests=2)
    got, cache, seen = run_manager(model, prompts())
    assert cache.slots == 2
    assert got == want
    assert seen["free_after"] == cache.stores[0].blocks and seen["slots_after"] == {}


@pytest.mark.slow
def test_requests_wait_for_pages_in_a_tight_budget(reference):
    """A budget of three slots and four 64-token blocks (256 tokens: the 150-token prompt and its 12 new tokens
    need three): transformers' scheduler holds requests back by the pages kvcompile's pool has, the pool never
    overflows, and every request completes with transformers' own tokens."""
    _, want, _ = reference
    model = applied(Policy.full())
    specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
    budget = 3 * sum(s.row_nbytes() for s in specs) + 4 * sum(s.block_nbytes() + 4 * 3 for s in specs)
    serving.configure(model, budget=budget, max_requests=3)
    got, cache, seen = run_manager(model, prompts())
    assert cache.stores[0].blocks == 4 and cache.allocated_nbytes <= budget
    assert got == want
    assert seen["free_after"] == 4 and seen["slots_after"] == {}


def eviction_setup(policy):
    """Three 60-token prompts that each grow to 160 tokens, three slots and five 64-token blocks: transformers'
    scheduler must evict one to let the others on. The model under ``policy``, the prompts, the config."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 64, (60,), generator=g).tolist() for _ in range(3)]
    gen = GenerationConfig(max_new_tokens=100, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model = applied(policy)
    specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
    serving.configure(model, max_requests=3,
                      budget=3 * sum(s.row_nbytes() for s in specs) + 5 * sum(s.block_nbytes() + 12 for s in specs))
    return model, ps, gen


@pytest.mark.slow
def test_requests_evicted_when_pages_run_out_are_prefilled_again(monkeypatch):
    """Five blocks for three requests that each grow to 160 tokens (three blocks): transformers' scheduler
    evicts a starved request (its soft reset: cache freed, request re-queued and prefilled again), kvcompile's
    row is cleared with it, and every request still gives the unmodified model's tokens."""
    cls = serving.cache_class()
    evicted, orig = [], cls.free_blocks

    def free_blocks(self, request_id, no_cache=False):
        if no_cache:
            evicted.append(request_id)
        return orig(self, request_id, no_cache)

    monkeypatch.setattr(cls, "free_blocks", free_blocks)
    ref = tiny()
    model, ps, gen = eviction_setup(Policy.full())
    with torch.no_grad():
        want = [generated(ref, p, gen) for p in ps]
        got = tokens(model.generate_batch(ps, gen, continuous_batching_config=cb_config(), progress_bar=False))
    assert evicted  # the path under test ran
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("policy", [Policy.full(), KIVI], ids=["full", "kivi"])
def test_evicted_requests_offloaded_to_host_memory_go_on_exactly(policy):
    """``ContinuousBatchingConfig(cpu_offload_space=...)``: a request transformers evicts is copied out as its
    store holds it (packed pages, ring, length) and back into new pages and a slot when it is scheduled again:
    every request gives the tokens it gives with nothing evicted -- the unmodified model's under
    ``Policy.full()``, kvcompile's own ``generate`` under KIVI (whose ring must come back as it was: a soft
    reset would re-prefill the evicted request instead, computing its keys again) -- and the host copies are
    gone at the end."""
    model, ps, gen = eviction_setup(policy)
    with torch.no_grad():
        want = [(tiny() if policy == Policy.full() else model).generate(torch.tensor([p]), generation_config=gen)[
            0, len(p):].tolist() for p in ps]
        got = tokens(model.generate_batch(ps, gen, continuous_batching_config=cb_config(cpu_offload_space=0.01),
                                          progress_bar=False, persistent_manager=True))
    manager = model._cached_continuous_batching_manager
    offload = manager.batch_processor.offloading_manager
    manager.stop(block=True, timeout=30)
    assert offload.offloaded >= 1 and offload.restored == offload.offloaded  # the path under test ran
    assert offload.used == 0 and not offload.saved
    assert got == want


@pytest.mark.slow
def test_an_offload_space_too_small_for_a_request_evicts_it_as_before():
    """Host memory for less than one request's packed cache: the evicted request is soft reset (freed,
    re-queued, prefilled again), as transformers does, and still gives the unmodified model's tokens."""
    model, ps, gen = eviction_setup(Policy.full())
    with torch.no_grad():
        want = [generated(tiny(), p, gen) for p in ps]
        got = tokens(model.generate_batch(ps, gen, continuous_batching_config=cb_config(cpu_offload_space=1e-6),
                                          progress_bar=False, persistent_manager=True))
    manager = model._cached_continuous_batching_manager
    offload = manager.batch_processor.offloading_manager
    manager.stop(block=True, timeout=30)
    assert offload.space == int(1e-6 * 2 ** 30) and offload.offloaded == 0
    assert got == want


def test_a_saved_row_comes_back_exactly_into_other_blocks_after_its_row_is_reused():
    """``KVStore.save`` / ``restore`` (what offloading does to an evicted request): the copy is the row's own
    (its row and blocks may be overwritten meanwhile), and the row restored into another slot and other blocks
    reads exactly what the original read: ring, sinks, packed blocks, length."""
    from kvcompile.store import KVStore, LayerSpec, dequantize_reference

    spec = LayerSpec(Policy.kivi(4, group=4, residual=8, sink=2), 2, 8, block_tokens=16)
    g = torch.Generator().manual_seed(0)
    st = KVStore(spec, 3, blocks=12)
    st.engine_owns_blocks()
    st.set_tables({0: [5, 2, 9]})
    k, v = torch.randn(1, 2, 45, 8, generator=g), torch.randn(1, 2, 45, 8, generator=g)
    st.reserve([45, 0, 0])
    st.append(torch.cat([k, torch.zeros(2, 2, 45, 8)]), torch.cat([v, torch.zeros(2, 2, 45, 8)]),
              n_new=torch.tensor([45, 0, 0]))
    before = [t[0].clone() for t in dequantize_reference(st.state, spec)]
    saved = st.save(0)
    assert saved.nbytes == 3 * spec.block_nbytes() + spec.row_nbytes() - 4  # blocks, ring, sinks (not the length)
    st.clear([0])  # the row and its blocks are reused by another request
    st.set_tables({0: [5, 2, 9]})
    st.append(torch.randn(3, 2, 45, 8, generator=g), torch.randn(3, 2, 45, 8, generator=g),
              n_new=torch.tensor([45, 0, 0]))
    st.restore(2, saved, [7, 1, 3, 4])
    after = dequantize_reference(st.state, spec)
    assert st.lengths[2] == 45 and st.tables[2] == [7, 1, 3, 4]
    assert all(torch.equal(b, a[2]) for b, a in zip(before, after))


@pytest.mark.slow
def test_a_request_cancelled_mid_stream_frees_its_blocks():
    """A streaming request cancelled after a few tokens (a client that went away): its slot and blocks return
    to the pool while another request keeps running to completion. The other request asks for 100 tokens, so
    that it is still running when the cancel comes, however far the engine's thread runs ahead of this one on
    a busy machine."""
    import time

    more = 100
    model = applied(KIVI)
    manager = model.init_continuous_batching(GEN, cb_config())
    manager.start()
    try:
        long = manager.add_request(input_ids=prompts()[4], max_new_tokens=400, streaming=True)
        other = manager.add_request(input_ids=prompts()[3], max_new_tokens=more)
        for i, out in enumerate(manager.request_id_iter(long)):
            if len(out.generated_tokens) >= 3:
                break
        cache = manager.batch_processor.cache
        assert long in cache.slot_of and cache.free_blocks_count < cache.stores[0].blocks
        assert cache.slot_of == {long: 0, other: 1}
        manager.cancel_request(long)
        deadline, moved = time.time() + 30, []
        while long in cache.slot_of and time.time() < deadline:
            time.sleep(0.01)
        moved.append(cache.slot_of.get(other))
        deadline, done = time.time() + 60, None
        while (done is None or not done.is_finished()) and time.time() < deadline:
            done = manager.get_result(other, timeout=0.5)  # None when another request's output came first
            if done is None:  # the cancelled request's last streamed output, requeued at once: do not spin on it
                time.sleep(0.01)  # (a loop of requeues holds the GIL, starving the engine's thread)
        assert done is not None and done.error is None and len(done.generated_tokens) == more
        deadline = time.time() + 30
        while cache.slot_of and time.time() < deadline:
            time.sleep(0.05)
        assert cache.slot_of == {} and cache.free_blocks_count == cache.stores[0].blocks
    finally:
        manager.stop(block=True, timeout=30)
    assert moved == [0]  # the running request moved into the cancelled one's slot (held slots stay 0..n-1) ...
    with torch.no_grad():  # ... mid-generation, and still gives kvcompile's generate tokens
        p = prompts()[3]
        assert done.generated_tokens == generated(model, p, GenerationConfig(**{**GEN.to_diff_dict(),
                                                                                 "max_new_tokens": more}))


@pytest.mark.slow
def test_parallel_sampling_forks_rows(reference):
    """num_return_sequences: transformers forks a request after its prefill, sharing its complete pages with
    the children and copying the last one (kvcompile copies that block's contents in every layer). Sampling
    from one seed: the same draws as transformers' own engine, so the same tokens, and children that differ."""
    ref, _, _ = reference
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=True, eos_token_id=-1, pad_token_id=0,
                           num_return_sequences=3)
    p = prompts()[3:5]
    with torch.no_grad():
        want = tokens(ref.generate_batch(p, gen, continuous_batching_config=cb_config(seed=7), progress_bar=False))
        model = applied(Policy.full())
        got = tokens(model.generate_batch(p, gen, continuous_batching_config=cb_config(seed=7), progress_bar=False))
    assert len(got) == 6 and got == want
    assert len({tuple(t) for t in got[:3]}) > 1  # the children of one prompt went their own ways


@pytest.mark.slow
def test_greedy_forks_copy_a_windowed_policys_pages_and_rows():
    """A policy with a full-precision window shares no pages: transformers gives each child fresh pages and
    lists them for copying; the child's row (window, length) is copied with them. Children sampled with
    top_k=1 are their parent's greedy tokens: kvcompile's generate tokens, three times each."""
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0,
                           num_return_sequences=3)
    ps = prompts()[3:5]
    model = applied(KIVI)
    with torch.no_grad():
        got = tokens(model.generate_batch(ps, gen, continuous_batching_config=cb_config(allow_block_sharing=False),
                                          progress_bar=False))
        want = [generated(model, p) for p in ps]
    assert got == [want[0]] * 3 + [want[1]] * 3


# --------------------------------------------------------------------------- prefix sharing
def shared_prefix_prompts():
    """Four prompts that begin with the same 150 tokens (two whole 64-token pages and a part), and one that
    does not."""
    g = torch.Generator().manual_seed(11)
    head = torch.randint(3, 64, (150,), generator=g).tolist()
    tails = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 20, 41, 90)]
    return [head + t for t in tails] + [torch.randint(3, 64, (30,), generator=g).tolist()]


@pytest.mark.slow
def test_prompts_that_begin_alike_share_pages_with_transformers_own_tokens():
    """Prefix sharing (transformers' default, allow_block_sharing=True) over kvcompile's pages: a request whose
    prompt begins with pages an earlier request wrote starts with those pages instead of computing them.
    Under Policy.full(): exactly transformers' own engine's tokens (which shares the same way); every page
    is free or only cached at the end."""
    ref = tiny()
    cbc = cb_config(num_blocks=32)
    with torch.no_grad():
        want = tokens(ref.generate_batch(shared_prefix_prompts(), GEN, continuous_batching_config=cbc,
                                         progress_bar=False))
    model = applied(Policy.full())
    got, cache, seen = run_manager(model, shared_prefix_prompts(), cb_config(num_blocks=32))
    assert got == want
    assert cache.use_prefix_sharing and cache.prefix_tokens >= 3 * 128  # three requests found two pages each
    assert seen["free_after"] == cache.stores[0].blocks and seen["slots_after"] == {}
    assert len(cache._allocator.ledger.cached_blocks) > 0  # the prompts' pages stay cached for later requests


@pytest.mark.slow
@pytest.mark.parametrize("policy", [Policy.int8(), "tok+rot:4"], ids=["int8", "tok+rot:4"])
def test_a_quantized_policy_without_a_window_shares_pages(policy):
    """Packed pages are shared as they are: each request gives kvcompile's own generate tokens for it."""
    if isinstance(policy, str):
        from kvcompile.evaluate import scheme_policy
        policy = scheme_policy(*policy.split(":")[:1], int(policy.split(":")[1]))
    model = applied(policy)
    got, cache, _ = run_manager(model, shared_prefix_prompts(), cb_config(num_blocks=32))
    with torch.no_grad():
        want = [generated(model, p) for p in shared_prefix_prompts()]
    assert cache.prefix_tokens >= 3 * 128
    assert got == want


@pytest.mark.slow
def test_under_a_quantized_policy_shared_pages_are_the_ones_a_prompt_would_compute():
    """Under a quantized policy a prompt takes from shared pages only what it would have computed itself: the
    match ends where one of its pieces ends (a multiple of the forward's token budget and of the page), and
    pages that a decode step completed are never shared (a decoded token read its predecessors as stored). So
    with the model's own products made batch-invariant, every reply -- its tokens and their log probabilities,
    to the last bit -- is the one it gets with prefix sharing off: at 64 tokens a forward the four prompts that
    begin with the same 150 tokens share their two whole pages; at 40 they share none (a match of 128 tokens
    would end inside a piece); and a second turn that repeats the first turn's prompt and reply shares the page
    the first prompt filled, not the page its reply completed."""
    from kvcompile.evaluate import scheme_policy
    from kvcompile.sampling import sampling_manager

    model = exact_products(applied(scheme_policy("tok+rot", 2)))  # 2 bits a token-head, no window: shared pages

    def serve(turns, size, share):
        """Each list of prompts in turn, in one engine (later turns find the pages earlier ones left): each
        reply's tokens with their log probabilities, and the tokens read from shared pages."""
        manager = sampling_manager(model, GEN, cb_config(num_blocks=32, max_batch_tokens=size,
                                                         allow_block_sharing=share))
        manager.start()
        try:
            got = []
            for n, batch in enumerate(turns):
                got.append(recorded(manager, batch, [f"t{n}r{i}" for i in range(len(batch))]))
            return got, manager.batch_processor.cache.prefix_tokens
        finally:
            manager.stop(block=True, timeout=30)

    ps = shared_prefix_prompts()
    first = torch.randint(3, 64, (120,), generator=torch.Generator().manual_seed(21)).tolist()
    more = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(22)).tolist()
    with torch.no_grad():
        for size, shared in ((64, 3 * 128), (40, 0)):
            got, prefix = serve([ps], size, share=True)
            want, none = serve([ps], size, share=False)
            assert got == want, size
            assert prefix == shared and none == 0, (size, prefix)
        # two turns: 120 prompt tokens (a whole page, and 56 of the next) and 12 decoded, which complete the
        # second page; the second turn repeats them and goes on
        ((reply,),), _ = serve([[first]], 64, share=False)
        second = first + [entry[0] for entry in reply] + more
        got, prefix = serve([[first], [second]], 64, share=True)
        want, _ = serve([[first], [second]], 64, share=False)
    assert got == want
    assert prefix == 64  # the first page only


@pytest.mark.slow
def test_shared_pages_hold_more_requests_at_once(monkeypatch):
    """Five pages for three requests of 150 shared tokens + 10 of their own + 12 new (three pages each, nine
    in all): with prefix sharing the two shared pages are held once, so all three hold their whole prompts at
    once; without it they take turns. The tokens are the same either way."""
    held, orig = [], serving.cache_class()._plan_for

    def plan_for(self, total):  # requests whose whole prompt is in the cache
        held.append(sum(self.stores[0].lengths[s] >= 160 for s in self.slot_of.values()))
        return orig(self, total)

    monkeypatch.setattr(serving.cache_class(), "_plan_for", plan_for)
    g = torch.Generator().manual_seed(12)
    head = torch.randint(3, 64, (150,), generator=g).tolist()
    ps = [head + torch.randint(3, 64, (10,), generator=g).tolist() for _ in range(3)]
    results = {}
    for share in (True, False):
        model = applied(Policy.full())
        specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
        budget = 3 * sum(s.row_nbytes() for s in specs) + 5 * sum(s.block_nbytes() + 12 for s in specs)
        serving.configure(model, max_requests=3, budget=budget)
        held.clear()
        got, cache, _ = run_manager(model, ps, cb_config(allow_block_sharing=share))
        assert cache.stores[0].blocks == 5
        results[share] = got, max(held)
    assert results[True][0] == results[False][0]
    assert results[True][1] == 3 and results[False][1] < 3
    # what kvcompile plan --serving --shared-tokens predicts for these pages: 172 tokens, 150 shared
    specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
    assert serving.requests_held(5, 3, 2) == 3 and serving.requests_held(5, 3) == 1
    assert serving.size_pool(specs, budget, 172, 3, shared_tokens=150).requests == 3


def test_a_windowed_policy_says_it_does_not_share_pages():
    """KIVI keeps each request's recent keys in full precision outside its pages: transformers' default
    prefix sharing is turned off with a warning that says why (none when the config already says so)."""
    model = applied(KIVI)
    with pytest.warns(UserWarning, match="prefix sharing .* is off"):
        manager = model.init_continuous_batching(GEN, cb_config())
    assert manager.continuous_batching_config.allow_block_sharing is False
    import warnings
    model = applied(KIVI)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.init_continuous_batching(GEN, cb_config(allow_block_sharing=False))


# --------------------------------------------------------------------------- refusals
def test_unsupported_configurations_are_refused_at_the_call():
    model = applied(KIVI)
    with pytest.raises(KVCompileError, match="use_async_batching"):
        model.init_continuous_batching(GEN, cb_config(use_async_batching=True))
    with pytest.raises(KVCompileError, match="cpu_offload_space=None"):
        model.init_continuous_batching(GEN, cb_config(cpu_offload_space=None))
    with pytest.raises(KVCompileError, match="a budget of 1,000 bytes does not hold one block"):
        serving.configure(model, budget=1000)  # (said when it is given, as below)
    # a budget and a slot count that cannot go together are refused when they are given, not at the first
    # request (kvcompile serve exits at start with the message instead of answering 500 to every request)
    with pytest.raises(KVCompileError, match=r"does not hold one block after 64 request slots"):
        serving.configure(model, budget=20_000, max_requests=64)
    assert model.config._attn_implementation == "sdpa"  # a refusal leaves the model as it was
    model.set_attn_implementation("eager")
    serving.configure(model)
    with pytest.raises(KVCompileError, match="sdpa"):
        model.init_continuous_batching(GEN, cb_config())


def test_transformers_own_paged_cache_is_refused_by_an_applied_model():
    """Never a silent full-precision fallback: transformers' own paged cache reaching the applied forward."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    model = applied(KIVI)
    fake = PagedAttentionCache.__new__(PagedAttentionCache)
    with pytest.raises(KVCompileError, match="full precision"):
        model(input_ids=torch.tensor([[5, 6]]), cache=fake, use_cache=False)


# --------------------------------------------------------------------------- the pool sized in bytes
SMOL = dict(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)  # SmolLM2-135M's cache geometry


def _scheme(entry):
    from kvcompile.evaluate import scheme_policy
    name, bits = entry.split(":")
    return scheme_policy(name, int(bits))


# The serving issue's bars: for one byte budget (256 MiB, a SmolLM2-shaped bf16 model, 1K-token requests), the
# tokens and the concurrent requests kvcompile's serving pool holds, over transformers' own paged cache's.
BARS = {"tok+rot:4": 3.5, "tok+rot:2": 6.0, "tok+rot+sym:8": 1.9, "fp8-r0": 1.9}


@pytest.mark.parametrize("name", ["tok+rot:4", "tok+rot:2", "tok+rot+sym:8", "fp8-r0", "int8", "kivi4", "kivi2",
                                  "tok+rot+fp8s:4", "kivi-r0+rot+sink+fp8s:2"])
def test_one_byte_budget_holds_more_tokens_than_transformers_own_cache(name):
    """Both caches allocated for the same 256 MiB on a SmolLM2-shaped bf16 model (the tensors only: no weights):
    kvcompile's allocation stays within the budget and is exactly its layout's arithmetic (slots' rings and
    sinks + pool blocks + tables as wide as the longest request); transformers' pages hold 23,040 bytes a token.
    The serving policies (no full-precision window per request) reach the issue's bars in tokens and in
    concurrent 1K-token requests; KIVI's and fp8's own windows (residual 128) are paid per slot, and
    Policy.int8's zero points cost 1/4 bit more than the symmetric int8's, so those are only checked to beat
    transformers' cache."""
    from transformers import LlamaConfig

    policy = {"fp8-r0": Policy.fp8(residual=0), "int8": Policy.int8(), "kivi4": Policy.kivi(4),
              "kivi2": Policy.kivi(2)}.get(name) or _scheme(name)
    cfg = LlamaConfig(**SMOL)
    budget = 256 * 2**20
    r = serving.capacity(cfg, policy, budget, torch.bfloat16, request_tokens=1024)
    ours, theirs = r["kvcompile"], r["transformers"]
    specs = serving.layer_specs(cfg, serving.ServingOptions(policy, [str(i) for i in range(30)], 3), torch.bfloat16)
    assert ours["allocated"] == (ours["slots"] * sum(s.row_nbytes() for s in specs)
                                 + ours["blocks"] * sum(s.block_nbytes() for s in specs)
                                 # tables: an int32 per slot and block a request of SmolLM2's 8,192 positions holds
                                 + 30 * 4 * ours["slots"] * min(ours["blocks"], serving.request_pages(specs, 8192)))
    assert ours["allocated"] <= budget
    fp_token = 30 * 2 * 3 * 64 * 2
    assert theirs["data"] == theirs["tokens"] * fp_token <= budget
    assert theirs["requests"] == theirs["blocks"] // 4  # 1,024 tokens: four 256-token pages
    # a request holds the blocks its store writes: 1,024 tokens less its full-precision window and sinks
    need = serving.request_pages(specs, 1024)
    assert need == (1024 // specs[0].block if not (specs[0].ring or specs[0].sink) else
                    -(-(specs[0].boundary(1024) - specs[0].sink) // specs[0].block))
    assert ours["requests"] == min(ours["slots"], ours["blocks"] // need)
    bar = BARS.get(name, 1.0)
    assert r["token_ratio"] >= bar and r["request_ratio"] >= bar, (r["token_ratio"], r["request_ratio"])


def test_the_load_tests_budget_holds_28_kivi_requests_where_transformers_holds_8():
    """The load test's budget, counted in the dtype this CPU serves SmolLM2 in (fp32): 360 MiB, where
    transformers' own pages hold 8 requests of 1K tokens. KIVI int4 with rotation, sinks and one-byte scales
    (inside the 4-bit quality bar, docs/results.md) holds 28 there, its windows paid per slot; sizing the
    slots by the request length (``configure(request_tokens=)``, ``kvcompile serve --request-tokens``) gives
    exactly those 28, where the default slot rule leaves the windows a quarter of the budget (12 slots)."""
    from transformers import LlamaConfig

    cfg, policy, budget = LlamaConfig(**SMOL), _scheme("kivi+rot+sink+fp8s:4"), 360 * 2**20
    r = serving.capacity(cfg, policy, budget, torch.float32, request_tokens=1024)
    assert r["transformers"]["requests"] == 8 and r["kvcompile"]["requests"] == 28
    assert r["kvcompile"]["allocated"] <= budget
    specs = serving.layer_specs(cfg, serving.ServingOptions(policy, [str(i) for i in range(30)], 3), torch.float32)
    assert serving.slots_for(specs, budget, None, 1024, 8192) == r["kvcompile"]["slots"] == 28
    assert serving.slots_for(specs, budget, None, None, 8192) == serving.default_slots(specs, budget) == 12


def test_slots_sized_for_a_request_length_are_the_ones_plan_counts():
    """``configure(budget=, request_tokens=)``: the manager allocates the pool ``kvcompile plan --serving``
    predicts for requests of that length (as many slots as the budget holds such requests at once), and the
    requests run on it with transformers' own tokens under Policy.full(); refusals come at the call."""
    from kvcompile import plan as P

    model = applied(KIVI)
    specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
    budget = 5 * sum(s.row_nbytes() for s in specs) + 12 * sum(s.block_nbytes() + 4 * 64 for s in specs)
    serving.configure(model, budget=budget, request_tokens=100)
    want = serving.size_pool(specs, budget, 100, max_tokens=serving.request_limit(model.config))
    shape = replace(P.shape_from_config(model.config, weight_bytes=0), dtype_bytes=4)
    assert P.serving_pool("kivi", KIVI, shape, budget, 100).slots == want.slots
    manager = model.init_continuous_batching(GEN, cb_config(allow_block_sharing=False))
    assert (manager._slots, manager._blocks) == (want.slots, want.blocks) and want.slots >= 3
    with pytest.raises(ValueError, match="both give the number of request slots"):
        serving.configure(model, budget=budget, max_requests=3, request_tokens=100)
    with pytest.raises(KVCompileError, match="holds no request of 4,000 tokens"):
        serving.configure(model, budget=budget, request_tokens=4000)
    with pytest.raises(ValueError, match="request_tokens=0"):
        serving.configure(model, request_tokens=0)


@pytest.mark.slow
def test_full_policy_on_slots_sized_for_the_requests(reference):
    """Slots sized for requests of 170 tokens (the longest here: 150 + 12): the six requests run on the
    slots the budget holds such requests for, with transformers' own tokens."""
    _, want, _ = reference
    model = applied(Policy.full())
    specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
    budget = 4 * sum(s.row_nbytes() for s in specs) + 12 * sum(s.block_nbytes() + 4 * 64 for s in specs)
    serving.configure(model, budget=budget, request_tokens=170)
    got, cache, _ = run_manager(model, prompts())
    assert got == want
    assert cache.slots == serving.slots_for(specs, budget, None, 170, serving.request_limit(model.config)) == 4


def test_fork_and_clear_rows_of_a_store():
    """KVStore.fork shares blocks, copies on write; clear returns a row's blocks (what serving relies on)."""
    from kvcompile.store import KVStore, LayerSpec, dequantize_reference

    spec = LayerSpec(KIVI, 2, 8, block_tokens=16)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    st = KVStore(spec, 3)
    st.append(torch.cat([k, torch.zeros_like(k), torch.zeros_like(k)]),
              torch.cat([v, torch.zeros_like(v), torch.zeros_like(v)]), n_new=torch.tensor([40, 0, 0]))
    used = st.used_blocks
    st.fork(0, 2)
    assert st.used_blocks == used and st.lengths == [40, 0, 40]  # shared, not copied
    k2, v2 = torch.randn(3, 2, 9, 8, generator=g), torch.randn(3, 2, 9, 8, generator=g)
    st.append(k2, v2, n_new=torch.tensor([0, 0, 9]))  # the child writes: its shared last block is copied
    alone = KVStore(spec, 1)
    alone.append(torch.cat([k, k2[2:]], 2), torch.cat([v, v2[2:]], 2))
    got = dequantize_reference(st.state, spec)
    want = dequantize_reference(alone.state, spec)
    assert torch.equal(got[0][2], want[0][0]) and torch.equal(got[1][2], want[1][0])
    parent = dequantize_reference(st.state, spec, end=40)
    solo = KVStore(spec, 1)
    solo.append(k, v)
    assert torch.equal(parent[0][0], dequantize_reference(solo.state, spec)[0][0])  # the parent is untouched
    st.clear([0, 2])
    assert st.used_blocks == 0 and st.lengths == [0, 0, 0] and len(st.free) == st.blocks



def test_a_store_whose_blocks_an_engine_owns():
    """KVStore.engine_owns_blocks (transformers' pages are the pool's blocks): a row writes into the blocks it
    is given, in any order, and reads what a store that owns its blocks reads; a prefix of whole blocks is
    adopted with its length; copied blocks are copies; the store never takes a block (an append past the
    row's table is a CapacityError) nor frees one."""
    from kvcompile.store import CapacityError, KVStore, LayerSpec, dequantize_reference

    spec = LayerSpec(Policy.int8(), 2, 8, block_tokens=16)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    k2, v2 = torch.randn(3, 2, 8, 8, generator=g), torch.randn(3, 2, 8, 8, generator=g)

    def alone(kk, vv):
        own = KVStore(spec, 1)
        own.append(kk, vv)
        return [t[0] for t in dequantize_reference(own.state, spec)]

    def row(st, b):
        return [t[b] for t in dequantize_reference(st.state, spec)]

    z = torch.zeros_like
    st = KVStore(spec, 3, max_blocks=8, blocks=8)
    st.engine_owns_blocks()
    st.set_tables({0: [5, 2, 7]})
    st.append(torch.cat([k, z(k), z(k)]), torch.cat([v, z(v), z(v)]), n_new=torch.tensor([40, 0, 0]))
    assert all(torch.equal(a, b) for a, b in zip(row(st, 0), alone(k, v)))
    # row 1 starts with row 0's two whole blocks (32 tokens), then writes its own 8 into a block of its own
    st.set_tables({1: [5, 2, 3]})
    st.set_length(1, 32)
    st.append(k2, v2, n_new=torch.tensor([0, 8, 0]))
    want = alone(torch.cat([k[:, :, :32], k2[1:2]], 2), torch.cat([v[:, :, :32], v2[1:2]], 2))
    assert all(torch.equal(a, b) for a, b in zip(row(st, 1), want))
    assert all(torch.equal(a, b) for a, b in zip(row(st, 0), alone(k, v)))  # row 0 untouched
    # a fork: the last block copied, the others shared
    st.copy_blocks([7], [4])
    st.fork(0, 2)
    st.set_tables({2: [5, 2, 4]})
    assert all(torch.equal(a, b) for a, b in zip(row(st, 2), alone(k, v)))
    free = list(st.free)
    k3 = torch.randn(3, 2, 9, 8, generator=g)
    with pytest.raises(CapacityError, match="serving engine"):  # 49 tokens need a fourth block
        st.append(k3, k3, n_new=torch.tensor([9, 0, 0]))
    st.clear([0, 1, 2])
    assert st.free == free and st.lengths == [0, 0, 0]  # nothing freed: the engine frees its pages
    with pytest.raises(RuntimeError, match="outside the blocks"):
        w = KVStore(LayerSpec(KIVI, 2, 8, block_tokens=16), 1, max_blocks=4, blocks=4)
        w.engine_owns_blocks()
        w.set_tables({0: [0, 1]})
        w.set_length(0, 32)

def test_default_slots_leave_most_of_the_budget_to_the_pool():
    """By default at most 32 slots, and never so many that their full-precision rings (KIVI's residual window)
    take over a quarter of the budget: on SmolLM2 in float32 a KIVI slot holds 30 x 159-token rings."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SMOL)
    budget = 256 * 2**20
    for policy in (Policy.kivi(4), Policy.int8()):
        specs = serving.layer_specs(cfg, serving.ServingOptions(policy, [str(i) for i in range(30)], 3),
                                    torch.float32)
        slots = serving.default_slots(specs, budget)
        rows = slots * sum(s.row_nbytes() for s in specs)
        assert 1 <= slots <= serving.DEFAULT_SLOTS and rows <= budget // 4
        if policy.residual == 0:
            assert slots == serving.DEFAULT_SLOTS  # no ring: the slots cost a length each
        else:
            assert (slots + 1) * sum(s.row_nbytes() for s in specs) > budget // 4  # as many as fit


# --------------------------------------------------------------------------- decode-step memory
def _step_allocations(policy, context: int, batch: int = 2):
    """What one decode step of ``batch`` requests of ``context`` tokens allocates through ATen ops
    (``benchmarks.serve_memory.NewTensors``: every new tensor, views and in-place results excluded), on the
    tiny model: kvcompile's cache under ``policy``, or transformers' own paged cache (``policy=None``)."""
    from benchmarks.serve_memory import decode_step, engine, new_tokens, prefill, step_allocations

    with torch.inference_mode():
        model = tiny()
        new = new_tokens(batch, context, 2, context + batch)
        gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        manager, bp = engine(model, policy if policy is not None else "transformers", batch, context + new,
                             context + batch, gen)
        g = torch.Generator().manual_seed(5)
        prefill(manager, bp, [torch.randint(3, 64, (context,), generator=g).tolist() for _ in range(batch)], new)
        decode_step(manager, bp)  # one-time allocations of the decode path
        return step_allocations(manager, bp)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [Policy.int8(), KIVI], ids=["int8", "kivi4"])
def test_a_decode_step_materialises_no_full_precision_copy_of_the_cache(policy):
    """A decode step over kvcompile's paged store allocates the same tensors at 256 and at 2048 tokens of
    context (the kernels read the packed blocks where they lie), where transformers' own paged path allocates
    at least one full-precision copy of every layer's keys and values per step (its read through the read
    indices) -- which is what this accounting sees, so it would see one on kvcompile's path too. (Not
    Policy.full(): it reads the pages back as transformers' own path does, to compute exactly what it computes.)"""
    short, long_ = 256, 2048
    cfg = tiny().config
    # one full-precision copy of every layer's keys and values of the batch's extra context: what a step that
    # dequantizes or gathers the cache would allocate on top at the longer context
    copy_growth = cfg.num_hidden_layers * 2 * 2 * (long_ - short) * cfg.num_key_value_heads * cfg.head_dim * 4
    theirs = _step_allocations(None, long_).total - _step_allocations(None, short).total
    assert theirs >= copy_growth, (theirs, copy_growth)  # the accounting sees transformers' copy
    a, b = _step_allocations(policy, short), _step_allocations(policy, long_)
    assert b.total - a.total < 0.05 * copy_growth, (a.total, b.total, b.largest_op, copy_growth)
    one_layer = 2 * 2 * long_ * cfg.num_key_value_heads * cfg.head_dim * 4
    assert b.largest < one_layer / 8, (b.largest, b.largest_op, one_layer)


# --------------------------------------------------------------------------- sliding-window layers (Gemma 3)
def gemma3():
    """A tiny random Gemma 3: its first and last layers attend over a 16-token window, the middle one to every
    token (untied embeddings and this width make its greedy tokens vary, so that a wrong window shows)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        attn_implementation="sdpa")
    return transformers.Gemma3ForCausalLM(cfg).eval()


def windowed_prompts():
    """Prompts shorter and longer than the window; the 45-token one is prefilled in two forwards (32 tokens a
    forward), the second reading the first's window; 24 new tokens slide every window further."""
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 20, 45, 9)]


WINDOW_GEN = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1, pad_token_id=0)


@pytest.mark.slow
def test_a_sliding_window_model_gives_transformers_own_continuous_batching_tokens():
    """Gemma 3 under Policy.full(): exactly the tokens of transformers' own continuous batching (its sliding
    allocator's rings) and of plain generate. The sliding layers keep each request's window in its slot's ring,
    in full precision; the full-attention layer is in kvcompile's pages."""
    ps, cbc = windowed_prompts(), cb_config(max_batch_tokens=32)
    ref = gemma3()
    with torch.no_grad():
        want = tokens(ref.generate_batch(ps, WINDOW_GEN, continuous_batching_config=cbc, progress_bar=False))
        assert want == [generated(ref, p, WINDOW_GEN) for p in ps]  # the premise: transformers' two paths agree
        model = kvcompile.apply(gemma3(), Policy.full())
        got, cache, _ = run_manager(model, ps, cbc)  # (run_manager's requests: NEW tokens each)
        assert got == [w[:NEW] for w in want]
        got = tokens(model.generate_batch(ps, WINDOW_GEN, continuous_batching_config=cbc, progress_bar=False))
    assert got == want
    from kvcompile.window import WindowRing

    assert [type(st).__name__ for st in cache.stores] == ["WindowRing", "KVStore", "WindowRing"]
    assert isinstance(cache.stores[0], WindowRing) and cache.stores[0].k.shape[2] == 16  # the window, no more
    assert cache.cache_tensor.device.type == "meta" and list(cache.cache_allocators) == ["full_attention"]
    specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
    assert cache.allocated_nbytes == serving.pool_nbytes(specs, cache.slots, cache.stores[1].blocks, 512)


@pytest.mark.slow
def test_a_sliding_window_model_quantizes_its_full_attention_layers():
    """Under a 2-bit policy the full-attention layer is quantized into kvcompile's pages and the sliding layers
    keep their windows as transformers keeps them: exactly kvcompile's own generate under the policy (whose
    cache keeps transformers' ring for a sliding layer at this horizon), not the full-precision tokens."""
    from kvcompile.hf import KVCompileCache

    ps, policy = windowed_prompts(), Policy.kivi(2, group=4, residual=4)
    model = kvcompile.apply(gemma3(), policy)
    assert KVCompileCache(model.config, policy).rings == {0: 16, 2: 16}  # generate's cache: the same layers
    with torch.no_grad():
        got = tokens(model.generate_batch(ps, WINDOW_GEN, continuous_batching_config=cb_config(max_batch_tokens=128),
                                          progress_bar=False))
        want = [generated(model, p, WINDOW_GEN) for p in ps]
        full = [generated(gemma3(), p, WINDOW_GEN) for p in ps]
    assert got == want
    assert got != full  # the full-attention layer's cache really is 2-bit


def test_sliding_window_models_refused_where_not_served():
    """A compiled continuous-batching forward over sliding-window layers, and a model whose every layer slides
    (nothing left to quantize), are refused at the call, saying what to do."""
    import transformers

    model = kvcompile.apply(gemma3(), Policy.int8())
    with pytest.raises(KVCompileError, match="sliding-window layers, which a compiled continuous-batching forward"):
        model.init_continuous_batching(GEN, cb_config(varlen_compile_config=serving.compile_config()))
    assert model.config._attn_implementation == "sdpa"
    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16,
                                        layer_types=["sliding_attention"] * 2, attn_implementation="sdpa")
    slides = kvcompile.apply(transformers.Gemma3ForCausalLM(cfg).eval(), Policy.int8())
    with pytest.raises(KVCompileError, match="every attention layer of this model attends over a sliding window"):
        slides.init_continuous_batching(GEN, cb_config())


@pytest.mark.slow
def test_a_sliding_window_models_rings_fork_and_go_to_host_memory_and_back():
    """The row operations on the rings: parallel sampling forks a request after its prefill (each child gets a
    copy of its parent's windows; sampled from one seed: transformers' own engine's tokens, children that differ),
    and a request evicted when the pages run out is copied to host memory with its windows and back (every
    request then gives plain generate's tokens, as with nothing evicted)."""
    ps = windowed_prompts()
    fork = GenerationConfig(max_new_tokens=NEW, do_sample=True, eos_token_id=-1, pad_token_id=0,
                            num_return_sequences=3)
    with torch.no_grad():
        want = tokens(gemma3().generate_batch(ps[1:3], fork, continuous_batching_config=cb_config(seed=7),
                                              progress_bar=False))
        model = kvcompile.apply(gemma3(), Policy.full())
        got = tokens(model.generate_batch(ps[1:3], fork, continuous_batching_config=cb_config(seed=7),
                                          progress_bar=False))
    assert len(got) == 6 and got == want
    assert len({tuple(t) for t in got[:3]}) > 1
    # three requests that grow to 160 tokens over pages for two of them: one is evicted, its windows go along
    g = torch.Generator().manual_seed(5)
    long_ = [torch.randint(3, 64, (60,), generator=g).tolist() for _ in range(3)]
    gen = GenerationConfig(max_new_tokens=100, do_sample=False, eos_token_id=-1, pad_token_id=0)
    specs = serving.layer_specs(model.config, model._kvcompile_serving, torch.float32)
    serving.configure(model, max_requests=3, budget=3 * sum(s.row_nbytes() for s in specs)
                      + 5 * sum(s.block_nbytes() + 12 for s in specs))
    with torch.no_grad():
        want = [generated(gemma3(), p, gen) for p in long_]
        got = tokens(model.generate_batch(long_, gen, continuous_batching_config=cb_config(cpu_offload_space=0.01),
                                          progress_bar=False, persistent_manager=True))
    manager = model._cached_continuous_batching_manager
    offload = manager.batch_processor.offloading_manager
    manager.stop(block=True, timeout=30)
    assert offload.offloaded >= 1 and offload.restored == offload.offloaded  # the path under test ran
    assert got == want
