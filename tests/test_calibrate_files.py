"""Sensitivities as files: measured once, allocated at any budget (``Sensitivity.save/load``,
``kvcompile calibrate --save-sensitivity / --sensitivity``)."""
import json
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from tiers import slow_after

import kvcompile.calibrate  # noqa: F401  (the module; kvcompile.calibrate is also the function)
from kvcompile import Policy, PolicyError, cli
from kvcompile.accounting import cache_bytes
from kvcompile.evaluate import scheme_policy

C = sys.modules["kvcompile.calibrate"]
ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "benchmarks" / "results" / "calibrate"
CANDS = tuple(Policy.kivi(b, group=16, residual=16, sink=4, rotate=True) for b in (2, 4, 8))
SHAPE = (3, 2, 32)


def _sens(layers=3):
    # made-up sensitivities with a float that does not survive a careless format (repr round-trips it)
    keys = tuple((0.1 * (i + 1) + 1e-17, 0.01 / 3, 1e-9 * i) for i in range(layers))
    values = tuple((0.2 / (i + 1), 0.02, 0.0) for i in range(layers))
    return C.Sensitivity(CANDS, keys, values, 80)


def test_round_trip_is_exact_and_allocates_the_same(tmp_path):
    s = _sens()
    s2 = C.Sensitivity.load(s.save(tmp_path / "s.json"))
    assert s2 == s
    for bits in (7.0, 9.0, 12.0):
        a, b = C.allocate(s, SHAPE, budget=bits, context=160), C.allocate(s2, SHAPE, budget=bits, context=160)
        assert a.policy == b.policy and a.predicted_kl == b.predicted_kl


def _write(tmp_path, d):
    p = tmp_path / "s.json"
    p.write_text(d if isinstance(d, str) else json.dumps(d))
    return p


def _good():
    return json.loads(json.dumps({"kvcompile_sensitivity": 1, "tokens": 80,
                                  "candidates": [c.to_dict() for c in CANDS],
                                  "raw_keys": [[0.3, 0.2, 0.1]] * 3, "raw_values": [[0.3, 0.2, 0.1]] * 3}))


@pytest.mark.parametrize("edit, gist", [
    (lambda d: "{not json", r"not valid JSON \(.* at line 1 column 2\)"),
    (lambda d: {**d, "kvcompile_sensitivity": 2}, "no 'kvcompile_sensitivity': 1 field"),
    (lambda d: Policy.kivi(2).to_dict(), "a policy file goes to --policy"),
    (lambda d: {**d, "candidates": []}, "'candidates' must be a non-empty list"),
    (lambda d: {**d, "candidates": [Policy.kivi(2).to_dict(), Policy.kivi(4, sink=4).to_dict()]}, "differ in sink"),
    (lambda d: {**d, "raw_keys": [[0.3, 0.2]] * 3}, "'raw_keys' must be a list .* of 3 finite numbers a row"),
    (lambda d: {**d, "raw_values": [[0.3, float("nan"), 0.1]] * 3}, "'raw_values' must be .* finite"),
    (lambda d: {**d, "raw_values": [[0.3, True, 0.1]] * 3}, "'raw_values' must be .* finite"),
    (lambda d: {**d, "raw_values": [[0.3, 0.2, 0.1]] * 2}, "3 layers of key sensitivities but 2 of value"),
    (lambda d: {**d, "tokens": 0}, "'tokens' .* positive whole number, found 0"),
])
def test_bad_sensitivity_files_are_clear_errors(tmp_path, edit, gist):
    p = _write(tmp_path, edit(_good()))
    with pytest.raises(PolicyError, match=gist):
        C.Sensitivity.load(p)


def test_no_file_or_a_directory(tmp_path):
    with pytest.raises(PolicyError, match="no such file; expected a JSON file written by Sensitivity.save"):
        C.Sensitivity.load(tmp_path / "missing.json")
    with pytest.raises(PolicyError, match="a directory"):
        C.Sensitivity.load(tmp_path)


@pytest.mark.slow
def test_cli_saves_then_allocates_from_the_file_without_measuring(tiny_dir, tmp_path, capsys, monkeypatch):
    sfile, p3 = tmp_path / "sens.json", tmp_path / "p3.json"
    assert cli.main(["calibrate", "--model", str(tiny_dir), "--bytes-of", "kivi+rot+sink:3", "--tokens", "512",
                     "--window", "512", "--save-sensitivity", str(sfile), "--out", str(p3), "--no-progress"]) == 0
    assert f"wrote {sfile}" in capsys.readouterr().out
    sens = C.Sensitivity.load(sfile)
    assert sens.candidates == C.default_candidates(32) and len(sens.raw_keys) == 2

    def no_measure(*a, **k):
        raise AssertionError("--sensitivity must not measure")
    monkeypatch.setattr(C, "measure", no_measure)
    shape = (2, 2, 32)
    for scheme in ("kivi+rot+sink:3", "kivi+rot+sink:4"):
        out = tmp_path / f"{scheme[-1]}.json"
        assert cli.main(["calibrate", "--model", str(tiny_dir), "--bytes-of", scheme, "--sensitivity", str(sfile),
                         "--out", str(out)]) == 0
        assert "not measured again" in capsys.readouterr().out
        pol = scheme_policy(*scheme.rsplit(":", 1)[:1], int(scheme[-1]))
        want = C.allocate(sens, shape, bytes_per_token=Fraction(cache_bytes(pol, *shape, 2048), 2048)).policy
        assert Policy.load(out) == want
    assert Policy.load(tmp_path / "3.json") == Policy.load(p3)  # the same measurement, the same budget


@pytest.mark.parametrize("extra, gist", [
    (["--candidates", "kivi:2", "kivi:4"], "--sensitivity with --candidates: the file holds the measurement"),
    (["--tokens", "512"], "--sensitivity with --tokens"),
    (["--save-sensitivity", "x.json"], "--sensitivity with --save-sensitivity"),
])
def test_cli_sensitivity_clashes_are_one_line_errors(tiny_dir, tmp_path, capsys, extra, gist):
    sfile = _sens(layers=2).save(tmp_path / "s.json")
    argv = ["calibrate", "--model", str(tiny_dir), "--budget", "6", "--sensitivity", str(sfile),
            "--out", str(tmp_path / "p.json"), *extra]
    assert cli.main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.search(gist, errors[0]), errors
    assert not (tmp_path / "p.json").exists()


def test_cli_sensitivity_of_another_model_is_refused(tiny_dir, tmp_path, capsys):
    sfile = _sens(layers=3).save(tmp_path / "s.json")
    assert cli.main(["calibrate", "--model", str(tiny_dir), "--budget", "6", "--sensitivity", str(sfile),
                     "--out", str(tmp_path / "p.json")]) == 2
    assert "measured on a model of 3 layers, but --model has 2" in capsys.readouterr().err


@pytest.mark.parametrize("bits", slow_after(1, [2, 3]))
def test_shipped_smollm2_policies_come_from_the_shipped_measurement(bits):
    # docs/results.md: `kvcompile calibrate --sensitivity .../smollm2_sensitivity.json --bytes-of
    # kivi+rot+sink:BITS` gives the policy files whose held-out rows it reports
    shape = (30, 3, 64)  # SmolLM2-135M
    sens = C.Sensitivity.load(SHIPPED / "smollm2_sensitivity.json")
    assert sens.candidates == C.default_candidates(64)
    budget = Fraction(cache_bytes(scheme_policy("kivi+rot+sink", bits), *shape, 2048), 2048)
    alloc = C.allocate(sens, shape, bytes_per_token=budget)
    assert alloc.policy == Policy.load(SHIPPED / f"smollm2_cal{bits}.json")
    assert alloc.bytes_per_token <= budget
