"""Per-layer bits for a byte budget: the knapsack, the sensitivities, the budget, policy files and the CLI."""
import argparse
import itertools
import json
import math
import re
import sys
from fractions import Fraction

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

import kvcompile
import profiles
from kvcompile import Policy, PolicyError, Quant, cli
from kvcompile import evaluate as E
from kvcompile.calibrate import (BudgetError, allocate, calibration_text, check_candidates, default_candidates,
                                 measure, solve)

import kvcompile.calibrate  # noqa: E402,F401  (kvcompile.calibrate the attribute is the function)

CAL = sys.modules["kvcompile.calibrate"]
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 32
SHAPE = (LAYERS, KV_HEADS, HEAD_DIM)
CONTEXT = 160  # tokens per calibration window and per sequence of the budget
# Small groups and residual so that a 160-token window quantizes most of what it attends to.
CANDS = tuple(Policy.kivi(b, group=16, residual=16, sink=4, rotate=True) for b in (2, 4, 8))


# --------------------------------------------------------------------------- the knapsack
def _brute(costs, values, budget):
    best = None
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        if sum(c[j] for c, j in zip(costs, pick)) <= budget:
            v = sum(vs[j] for vs, j in zip(values, pick))
            best = v if best is None else min(best, v)
    return best


@st.composite
def _instance(draw):
    groups = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 4)) for _ in range(groups)]
    costs = [draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)) for n in sizes]
    # integer-valued floats: sums are exact in any order, so the optimum compares with ==
    values = [[float(v) for v in draw(st.lists(st.integers(-5, 40), min_size=n, max_size=n))] for n in sizes]
    return costs, values, draw(st.integers(0, 100))


@profiles.CHEAP
@given(_instance())
def test_solve_is_optimal_against_brute_force(inst):
    costs, values, budget = inst
    want = _brute(costs, values, budget)
    if want is None:
        with pytest.raises(BudgetError) as e:
            solve(costs, values, budget)
        assert e.value.minimum == sum(min(c) for c in costs)
        return
    pick = solve(costs, values, budget)
    assert sum(c[j] for c, j in zip(costs, pick)) <= budget
    assert sum(vs[j] for vs, j in zip(values, pick)) == want


@profiles.CHEAP
@given(_instance(), st.integers(1, 6))
def test_solve_with_coarse_units_still_fits_the_budget(inst, max_states):
    # fewer states than the budget spans: costs are rounded up, so the choice may be worse but never over
    costs, values, budget = inst
    if _brute(costs, values, budget) is None:
        return
    pick = solve(costs, values, budget, max_states=max_states)
    assert sum(c[j] for c, j in zip(costs, pick)) <= budget


def test_solve_breaks_ties_towards_the_later_choice():
    assert solve([[1, 2], [1, 2]], [[0.0, 0.0], [1.0, 1.0]], 4) == [1, 1]
    assert solve([[1, 2], [1, 2]], [[0.0, 0.0], [1.0, 1.0]], 3) in ([0, 1], [1, 0])


# --------------------------------------------------------------------------- sensitivities and allocation
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                   max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 512, (1, CONTEXT), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def sens(tiny, windows):
    return measure(tiny, windows, CANDS, chunk=16, progress=False)


def _bpt(policy):
    return kvcompile.bytes_per_token(policy, *SHAPE, CONTEXT)


def _exact_bpt(policy, shape=SHAPE, context=CONTEXT):
    return Fraction(kvcompile.cache_bytes(policy, *shape, context), context)


def test_measure_gives_each_layer_side_and_candidate(sens):
    assert len(sens.raw_keys) == len(sens.raw_values) == LAYERS
    assert all(len(r) == len(CANDS) for r in sens.raw_keys + sens.raw_values)
    assert sens.tokens == CONTEXT // 2
    # 2-bit values move the next-token distribution more than 8-bit ones, in every layer
    assert all(r[0] > r[-1] for r in sens.raw_values)
    # what the knapsack reads is the running minimum: more bits never scored worse
    for raw, used in zip(sens.raw_keys + sens.raw_values, sens.keys + sens.values):
        assert used == tuple(min(raw[:c + 1]) for c in range(len(raw)))


def test_a_full_precision_candidate_has_sensitivity_exactly_zero(tiny, windows):
    # stored in full precision, through the same store: the logits are the reference's bit for bit
    cands = (Policy.kivi(2, group=16, residual=16, sink=4), Policy(residual=16, sink=4))
    s = measure(tiny, windows, cands, chunk=16, progress=False)
    assert all(r[1] == 0.0 for r in s.raw_keys + s.raw_values)
    assert all(r[0] > 0.0 for r in s.raw_values)


def test_allocation_respects_the_budget_and_is_optimal(sens):
    lo, hi = _bpt(CANDS[0]), _bpt(CANDS[-1])
    n = len(CANDS)
    for budget in (lo, lo + 1, (2 * lo + hi) / 3, (lo + hi) / 2, hi - 1, hi, hi + 100):
        a = allocate(sens, SHAPE, bytes_per_token=budget, context=CONTEXT)
        assert a.bytes_per_token == _bpt(a.policy) <= budget
        # brute force over every (keys, values) candidate pair of every layer, bytes by kvcompile's accounting
        best = math.inf
        for pick in itertools.product(itertools.product(range(n), repeat=2), repeat=LAYERS):
            pol = Policy.full().override({i: Policy(CANDS[k].key, CANDS[v].value, residual=16, sink=4, rotate=True)
                                          for i, (k, v) in enumerate(pick)})
            if _bpt(pol) <= budget:
                best = min(best, sum(sens.keys[i][k] + sens.values[i][v] for i, (k, v) in enumerate(pick)))
        assert a.predicted_kl == best


def test_budget_at_the_top_takes_the_most_accurate_everywhere(sens):
    a = allocate(sens, SHAPE, bytes_per_token=_bpt(CANDS[-1]), context=CONTEXT)
    assert a.policy == CANDS[-1] and a.choice == ((2, 2),) * LAYERS


def test_budget_at_the_bottom_takes_the_cheapest_everywhere(sens):
    a = allocate(sens, SHAPE, bytes_per_token=_bpt(CANDS[0]), context=CONTEXT)
    assert a.policy == CANDS[0] and a.choice == ((0, 0),) * LAYERS


def test_bits_per_element_counts_everything_the_store_holds(sens):
    # the uniform 4-bit candidate's all-in bits per element, as a budget, affords exactly its bytes
    bits = _bpt(CANDS[1]) * 8 / (2 * LAYERS * KV_HEADS * HEAD_DIM)
    assert bits > 4  # scales, zero points, residual and sinks are counted
    a = allocate(sens, SHAPE, bits_per_element=bits, context=CONTEXT)
    assert _bpt(CANDS[1]) - 1e-9 <= a.bytes_per_token <= _bpt(CANDS[1])  # float rounding of bits only
    assert a.predicted_kl <= sum(sens.keys[i][1] + sens.values[i][1] for i in range(LAYERS))


def test_a_budget_in_bits_is_the_bytes_of_a_uniform_cache_of_those_bits(sens):
    """budget=4 is what a uniform 4-bit cache of the candidates holds (scales, residual and sinks included), so it
    affords exactly the 4-bit candidate everywhere or a better mix; the widths the candidates have are exact, the
    others in proportion (codes are linear in bits)."""
    per_bit = Fraction(2 * LAYERS * KV_HEADS * HEAD_DIM, 8)  # bytes per token of one bit per element
    for bits, cand in ((2, CANDS[0]), (4, CANDS[1]), (8, CANDS[2])):
        assert CAL.budget_bytes(SHAPE, CANDS, CONTEXT, budget=bits) == _exact_bpt(cand)
        a = allocate(sens, SHAPE, budget=bits, context=CONTEXT)
        assert a.bytes_per_token <= _bpt(cand)
        assert a.predicted_kl <= sum(sens.keys[i][CANDS.index(cand)] + sens.values[i][CANDS.index(cand)]
                                     for i in range(LAYERS))
    assert CAL.budget_bytes(SHAPE, CANDS, CONTEXT, budget=3) == (_exact_bpt(CANDS[0]) + _exact_bpt(CANDS[1])) / 2
    assert CAL.budget_bytes(SHAPE, CANDS, CONTEXT, budget=9) == _exact_bpt(CANDS[2]) + per_bit
    assert allocate(sens, SHAPE, budget=2, context=CONTEXT).policy == CANDS[0]
    with pytest.raises(PolicyError, match=r"no candidate stores keys and values in the same number of bits"):
        CAL.budget_bytes(SHAPE, [Policy(CANDS[0].key, CANDS[1].value, residual=16, sink=4, rotate=True)], CONTEXT,
                         budget=3)


def test_the_default_candidates_budget_of_3_is_the_bytes_of_uniform_3_bit_kivi():
    """What a user means by calibrate(model, budget=3.0): the bytes of `kivi+rot+sink:3` (groups of 32), whatever the
    model's shape, although the default candidates also have a cheaper 3-bit layout (groups of 64)."""
    for shape in ((30, 3, 64), (32, 8, 128), (28, 4, 96), (32, 32, 80)):  # SmolLM2, Llama 3 8B, Phi-3, Phi-2
        for bits in (2, 3, 4, 8):
            want = _exact_bpt(Policy.kivi(bits, sink=4, rotate=True), shape, 2048)
            assert CAL.budget_bytes(shape, None, 2048, budget=bits) == want


def test_a_too_small_budget_says_the_minimum(sens):
    lo = _bpt(CANDS[0])
    with pytest.raises(BudgetError, match=f"{lo:,.1f} bytes per token") as e:
        allocate(sens, SHAPE, bytes_per_token=lo - 0.01, context=CONTEXT)
    assert float(e.value.minimum) == lo
    with pytest.raises(BudgetError, match=r"3 bits per element .*below the cheapest.* bits per element"):
        allocate(sens, SHAPE, bits_per_element=3, context=CONTEXT)
    with pytest.raises(BudgetError, match=r"a budget of 1.5 bits \(the bytes of a uniform 1.5-bit cache of these "
                                          r"candidates: .*below the cheapest"):
        allocate(sens, SHAPE, budget=1.5, context=CONTEXT)


@pytest.mark.parametrize("kw, gist", [
    (dict(), "exactly one budget, not none"),
    (dict(budget=4, bytes_per_token=100), "exactly one budget, not budget and bytes_per_token"),
    (dict(budget=4, bits_per_element=4), "exactly one budget"),
    (dict(budget=-1), r"budget=-1 \(bits of a uniform cache\)"),
    (dict(bits_per_element=0), r"bits_per_element=0 \(average bits per element, all in\)"),
    (dict(budget=float("nan")), "positive finite"),
    (dict(bytes_per_token=True), "bytes_per_token=True"),
    (dict(bytes_per_token="100"), "bytes_per_token='100'"),
    (dict(budget=4, context=0), "context=0"),
])
def test_bad_budgets_are_clear_errors(sens, kw, gist):
    kw.setdefault("context", CONTEXT)
    with pytest.raises(PolicyError, match=gist):
        allocate(sens, SHAPE, **kw)


def test_default_candidates_fit_the_head():
    assert default_candidates(64) == default_candidates() and len(default_candidates()) == 7
    assert [(c.key.format, c.key.group) for c in default_candidates()] == [
        ("int2", 64), ("int2", 32), ("int3", 64), ("int3", 32), ("int4", 64), ("int4", 32), ("int8", 32)]
    small = default_candidates(32)  # values in groups of 64 channels need a head of 64
    for c in small:
        c.check(32)
    assert [c.key.format for c in small] == ["int2", "int3", "int4", "int8"]
    phi2 = default_candidates(80)  # Phi-2's head: the groups of 32 fit it, as Policy.kivi's default does
    assert [(c.key.format, c.key.group, c.value.group_for(80)) for c in phi2] == [
        ("int2", 32, 16), ("int3", 32, 16), ("int4", 32, 16), ("int8", 32, 16)]
    assert phi2[1] == Policy.kivi(3, sink=4, rotate=True).for_head_dim(80)
    check_candidates(default_candidates())


def test_candidates_must_share_residual_sinks_and_rotation():
    with pytest.raises(PolicyError, match="differ in sink"):
        check_candidates([Policy.kivi(2, sink=4), Policy.kivi(4)])
    with pytest.raises(PolicyError, match="non-empty list"):
        check_candidates([])
    with pytest.raises(PolicyError, match="overrides"):
        check_candidates([Policy.kivi(2).override({0: None})])
    with pytest.raises(PolicyError, match="pre-RoPE"):  # the eager measurement could not honour it
        check_candidates([Policy.kivi(2), Policy.kivi(4, pre_rope=True)])


@pytest.mark.slow
def test_calibrate_returns_a_policy_the_cache_and_apply_take(tiny, windows, sens, monkeypatch):
    budget = (_bpt(CANDS[0]) + _bpt(CANDS[1])) / 2
    pol = kvcompile.calibrate(tiny, windows, bytes_per_token=budget, candidates=CANDS, context=CONTEXT, chunk=16,
                              progress=False)
    assert isinstance(pol, Policy) and _bpt(pol) <= budget
    # the policy it returns is what allocate chose from the same measurement (``sens``: measure's own result for
    # these windows and candidates, computed once for the module)
    want = allocate(sens, SHAPE, bytes_per_token=budget, context=CONTEXT).policy
    assert pol == want
    assert len(E.heldout_loss(tiny, windows, pol, chunk=16)) == 1
    ids = windows[:, :20]
    applied = kvcompile.apply(tiny, pol, max_cache_len=64, compiler="eager")
    with torch.no_grad():
        out = applied.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 23)

    # a budget below the minimum fails before anything is measured
    def boom(*a, **k):
        raise AssertionError("measured")
    monkeypatch.setattr(CAL, "measure", boom)
    with pytest.raises(BudgetError, match="below the cheapest"):
        kvcompile.calibrate(tiny, windows, bytes_per_token=_bpt(CANDS[0]) - 1, candidates=CANDS, context=CONTEXT)
    with pytest.raises(PolicyError, match="data=list"):
        kvcompile.calibrate(tiny, [1, 2, 3], budget=8, candidates=CANDS, context=CONTEXT)


def test_calibration_text_is_not_the_heldout_text():
    def runs(text, n=12):
        w = text.split()
        return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}
    cal = calibration_text()
    assert len(cal) > 50_000
    assert not runs(cal) & runs(E.heldout_text())


# --------------------------------------------------------------------------- policy files
_quant = (st.builds(Quant, format=st.sampled_from(["int2", "int3", "int4", "int8", "none"]), axis=st.just("token"),
                    group=st.sampled_from([None, 16, 32]), symmetric=st.sampled_from([None, True, False]),
                    scale_dtype=st.sampled_from(["float16", "float32", "fp8_e4m3"]))
          | st.builds(Quant, format=st.sampled_from(["int2", "int4"]), axis=st.just("channel"),
                      group=st.sampled_from([32, 64]))
          | st.builds(Quant, format=st.sampled_from(["fp8_e4m3", "fp8_e5m2"])))
_leaf = st.builds(Policy, key=_quant, value=_quant, residual=st.integers(0, 300), sink=st.integers(0, 8),
                  rotate=st.booleans())
_selector = (st.integers(-8, 8)
             | st.builds(range, st.integers(-4, 4), st.integers(-4, 8), st.sampled_from([1, 2, -1]))
             | st.sampled_from(["model.layers.0", "model.layers.3.self_attn", "re:layers\\.[0-3]\\.", "re:^model"]))


@profiles.CHEAP
@given(_leaf, st.lists(st.tuples(_selector, _leaf | st.none()), max_size=4))
def test_save_load_round_trip(tmp_path_factory, base, overrides):
    p = base
    for sel, leaf in overrides:
        p = p.override({sel: leaf})
    path = tmp_path_factory.mktemp("pol") / "p.json"
    back = Policy.load(p.save(path))
    assert back == p and str(back) == str(p) and hash(back) == hash(p)
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_load_reads_the_selectors_override_takes(tmp_path):
    d = Policy.int8().to_dict()
    leaf = Policy.kivi(2).to_dict()
    del leaf["kvcompile_policy"], leaf["overrides"]
    d["overrides"] = [{"layers": 3, "policy": leaf}, {"layers": "re:layers\\.1\\.", "policy": leaf},
                      {"layers": "model.layers.0", "policy": leaf}, {"layers": {"range": [4, 6, 1]}, "policy": leaf}]
    (tmp_path / "p.json").write_text(json.dumps(d))
    want = Policy.int8().override({3: Policy.kivi(2), "re:layers\\.1\\.": Policy.kivi(2),
                                   "model.layers.0": Policy.kivi(2), range(4, 6): Policy.kivi(2)})
    assert Policy.load(tmp_path / "p.json") == want


def _file(**changes):
    d = Policy.kivi(4, sink=4).override({0: Policy.int8()}).to_dict()
    for k, v in changes.items():
        if v is _DEL:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d)


_DEL = object()
_BAD_LEAF = {"key": {"format": "int5"}, "value": {"format": "none"}}


@pytest.mark.parametrize("content, gist", [
    ("{not json", r"not valid JSON \(.* at line 1 column 2\)"),
    ("[1, 2]", r"found a list \[1, 2\], expected a JSON object written by Policy.save"),
    (_file(kvcompile_policy=_DEL), "'kvcompile_policy' .the file format version. is no such field, expected 1"),
    (_file(kvcompile_policy=2), "is 2, expected 1; upgrade kvcompile"),
    (_file(residal=128), "unknown field 'residal'; expected only 'key', 'value', 'residual', 'sink', 'rotate', 'pre_rope'"),
    (_file(residual=1.5), "Policy.residual=1.5 is not valid"),
    (_file(rotate="yes"), "Policy.rotate='yes'"),
    (_file(key={"axis": "channel"}), r"bad\.json', at key: no 'format' field"),
    (_file(overrides={"0": {}}), r"overrides: found an object .*expected a list"),
    (_file(overrides=[{"layers": 0, "policy": _BAD_LEAF}]),
     r"overrides\[0\]\.policy\.key: Quant\.format='int5' is not valid"),
    (_file(overrides=[{"layers": {"range": [0, 4, 0]}, "policy": _BAD_LEAF}]),
     r"overrides\[0\]\.layers: found an object .*expected a layer selector"),
    (_file(overrides=[{"layers": True, "policy": _BAD_LEAF}]), r"overrides\[0\]\.layers: found a boolean true"),
    (_file(overrides=[{"layers": 0}]), r"overrides\[0\]: found an object .*exactly the fields"),
    (_file(overrides=[{"layers": 0, "policy": {"overrides": []}}]), "has no overrides of its own"),
])
def test_bad_policy_files_are_clear_errors(tmp_path, content, gist):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(PolicyError, match=gist) as e:
        Policy.load(path)
    assert str(path) in str(e.value)


def test_load_of_no_file_or_a_directory(tmp_path):
    with pytest.raises(PolicyError, match="no such file; expected a JSON file written by Policy.save"):
        Policy.load(tmp_path / "missing.json")
    with pytest.raises(PolicyError, match="a directory"):
        Policy.load(tmp_path)


# --------------------------------------------------------------------------- the command
@pytest.mark.slow
def test_cli_calibrate_then_eval_and_plan_read_the_file(tiny_dir, tmp_path, capsys):
    out = tmp_path / "pol.json"
    assert cli.main(["calibrate", "--model", str(tiny_dir), "--bytes-of", "kivi+rot+sink:3", "--tokens", "512",
                     "--window", "512", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    pol = Policy.load(out)
    uniform3 = E.scheme_policy("kivi+rot+sink", 3)
    assert kvcompile.bytes_per_token(pol, 2, 2, 32, 2048) <= kvcompile.bytes_per_token(uniform3, 2, 2, 32, 2048)
    assert f"{kvcompile.bytes_per_token(pol, 2, 2, 32, 2048):,.1f}" in text
    assert sum(line.split()[0] in ("0", "1") for line in text.splitlines() if line.strip()) == 2  # a row a layer

    res = tmp_path / "res"
    assert cli.main(["eval", "--model", str(tiny_dir), "--entries", str(out), "--window", "256", "--windows", "1",
                     "--passkey", "--out", str(res), "--no-progress"]) == 0
    rows = json.loads((res / "eval.json").read_text())["rows"]
    assert [r["scheme"] for r in rows] == ["full", "pol.json"] and rows[1]["policy"] == str(pol)
    assert rows[1]["bytes_per_token_bf16"] == kvcompile.bytes_per_token(pol, 2, 2, 32, 256)
    capsys.readouterr()
    assert cli.main(["plan", "--config", str(tiny_dir), "--gpu-gb", "1", "--policy", str(out)]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(str(out))]
    assert len(row) == 1 and f"{kvcompile.bytes_per_token(pol, 2, 2, 32, 8192):,.0f}" in row[0]


@pytest.mark.parametrize("args, gist", [
    ([], "no budget given: pass exactly one of --budget"),
    (["--budget", "4", "--bytes-per-token", "100"], "--budget and --bytes-per-token given"),
    (["--budget", "1"], r"1 bits \(the bytes of a uniform 1-bit cache .* below the cheapest choice .* bits per "
                        r"element"),
    (["--bits-per-element", "1"], r"1 bits per element .* below the cheapest choice"),
    (["--budget", "3", "--bits-per-element", "4"], "--budget and --bits-per-element given"),
    (["--bytes-of", "kivi:5"], "argument --bytes-of"),
])
def test_cli_calibrate_errors_are_one_line(tiny_dir, tmp_path, capsys, args, gist):
    argv = ["calibrate", "--model", str(tiny_dir), "--out", str(tmp_path / "p.json"), "--no-progress", *args]
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err  # transformers' weight-loading bar may come first
    errors = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("kvcompile calibrate: error:")
    assert re.search(gist, errors[0]), err
    assert not (tmp_path / "p.json").exists()


def test_cli_policy_options_read_policy_files(tmp_path):
    p = Policy.kivi(3, sink=4, rotate=True).override({0: Policy.int8()}).save(tmp_path / "p.json")
    assert cli._policy_arg(str(p)) == Policy.load(p)
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):  # argparse's: exit status 2
        cli._policy_arg(str(tmp_path / "missing.json"))
