"""The kvcompile command: plan (the articles' numbers), eval and demo on a tiny random model."""
import json
import subprocess
import sys

import pytest
import torch

from kvcompile import cli, models


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama saved with SmolLM2's tokenizer (the real tokenizer, a model that runs fast)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    tok = transformers.AutoTokenizer.from_pretrained(models.convert_default(log=lambda *a: None))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id)
    d = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_plan_reproduces_the_plate(capsys):
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    seqs = {line.split()[1]: int(line.split()[-2]) for line in out.splitlines() if line.startswith("ideal")}
    assert seqs == {"16-bit": 52, "8-bit": 104, "4-bit": 208, "2-bit": 416}


def test_plan_70b_in_45_gib(capsys, tmp_path):
    cli.main(["plan", "--preset", "llama3-70b", "--available-gb", "45", "--gib", "--context", "4096",
              "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")])
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert rows[0]["bytes_per_token"] == 327680 and rows[0]["sequences"] == 36
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_plan_from_a_config(capsys, tiny_dir):
    cli.main(["plan", "--config", str(tiny_dir), "--gpu-gb", "1", "--context", "1024"])
    assert "2 layers x 2 KV heads x 32" in capsys.readouterr().out


def test_eval_writes_table_json_and_plot(capsys, tmp_path, tiny_dir):
    out = tmp_path / "res"
    cli.main(["eval", "--model", str(tiny_dir), "--entries", "kivi:2", "naive:4", "--window", "128", "--windows",
              "2", "--passkey", "full", "best:2", "--passkey-lengths", "256", "--trials", "2", "--out", str(out),
              "--no-progress"])
    res = json.loads((out / "eval.json").read_text())
    assert [(r["scheme"], r["bits"]) for r in res["rows"]] == [("full", 16), ("kivi", 2), ("naive", 4)]
    assert res["rows"][0]["loss_delta"] == 0 and len(res["rows"][1]["loss_delta_per_window"]) == 2
    assert set(res["passkey"]) == {"full:16", "kivi:2"} and res["passkey"]["kivi:2"]["trials"] == 2
    assert (out / "eval.png").read_bytes()[:4] == b"\x89PNG"
    assert "naive" in capsys.readouterr().out
    # merging runs re-renders without a model
    cli.main(["eval", "--merge", str(out / "eval.json"), str(out / "eval.json"), "--out", str(tmp_path / "m")])
    assert len(json.loads((tmp_path / "m" / "eval.json").read_text())["rows"]) == 3


def test_eval_passkey_only_with_a_prefill_chunk(capsys, tmp_path, tiny_dir):
    out = tmp_path / "pk"
    cli.main(["eval", "--model", str(tiny_dir), "--entries", "none", "--passkey", "kivi+rot+sink:2",
              "--passkey-lengths", "256", "--passkey-chunk", "64", "--trials", "2", "--out", str(out),
              "--no-progress"])
    res = json.loads((out / "eval.json").read_text())
    assert res["rows"] == [] and list(res["passkey"]) == ["kivi+rot+sink:2@chunk64"]
    pk = res["passkey"]["kivi+rot+sink:2@chunk64"]
    assert pk["prefill_chunk"] == 64 and len(pk["trials_detail"]["256"]) == 2
    assert pk["bytes_per_token_bf16"]["256"] > 0 and "256" in pk["needle_packed_trials"]
    assert "kivi+rot+sink:2@chunk64" in capsys.readouterr().out


def test_demo_prints_bytes_loss_speed_and_reply(capsys, tiny_dir):
    cli.main(["demo", "--model", str(tiny_dir), "--max-new-tokens", "4", "--capacity", "512", "--loss-window",
              "256", "--compiler", "eager"])
    out = capsys.readouterr().out
    full = int(out.split("full precision")[1].split("B")[0].replace(",", ""))
    quant = int(out.split("quantized")[1].split("B")[0].replace(",", ""))
    assert quant < full / 2
    assert "delta" in out and "tok/s" in out and "reply (quantized cache):" in out


def test_bad_policy_argument_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--policy", "fp8:4"])
    assert "no 4-bit policy" in capsys.readouterr().err


def test_python_dash_m_runs():
    r = subprocess.run([sys.executable, "-m", "kvcompile", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout and "plan" in r.stdout
