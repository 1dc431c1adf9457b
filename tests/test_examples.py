"""Every example script runs (at tiny sizes), so none of them rots."""
import ast
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(monkeypatch, name, *args):
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


@pytest.mark.slow
def test_plan_concurrency(monkeypatch, capsys, tmp_path):
    """Llama 3 8B at 8K tokens on an 80 GB GPU (16.1 GB of weights, 90 %): the textbook 52 sequences at 16 bits
    and 208 at 4, and 159 with KIVI 4-bit's real layout; its bytes per sequence, as the printed expression in
    the context length C, are the table's at C = 8192."""
    import sympy
    _run(monkeypatch, "plan_concurrency.py", "--plot", str(tmp_path / "p.png"))
    out = capsys.readouterr().out
    rows = {line.rsplit(None, 4)[0].strip(): line.rsplit(None, 4)[1:] for line in out.splitlines()
            if line.startswith(("ideal", "KIVI"))}
    assert {k: int(v[2]) for k, v in rows.items()} == {"ideal 16-bit": 52, "ideal 4-bit": 208, "KIVI 4-bit": 159,
                                                      "KIVI 2-bit, first layer 8-bit": 241}
    expr = sympy.sympify(out.split("bytes per sequence, KIVI 4-bit:")[1].splitlines()[0])
    assert f"{float(expr.subs('C', 8192)) / 1e9:.3f}" == rows["KIVI 4-bit"][1]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_per_layer_policy(monkeypatch, capsys, tiny_dir):
    """Each layer's resolved policy and bytes, and the whole model's, are the policy's own accounting."""
    from kvcompile import Policy
    from kvcompile.accounting import bytes_per_token
    _run(monkeypatch, "per_layer_policy.py", "--model", str(tiny_dir), "--window", "256")
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.startswith("model.layers.")}
    # 2 layers: the first at 8 bits; the last is both "-1: None" and "range(1, 2)", and the later entry wins
    assert rows == {"model.layers.0.self_attn": Policy.kivi(8, sink=4).key_str(),
                    "model.layers.1.self_attn": Policy.kivi(4, sink=4).key_str()}
    mix = Policy.kivi(2, sink=4).override({0: Policy.kivi(8, sink=4), -1: None, range(1, 2): Policy.kivi(4, sink=4)})
    whole = float(re.search(r"whole model: ([\d,]+) B/token", out).group(1).replace(",", ""))
    assert whole == round(bytes_per_token(mix, 2, 2, 32, 256))
    assert len(re.findall(r"^(plain 2-bit KIVI|per-layer mix) +loss delta [+-]\d\.\d{4} nats/token$", out, re.M)) == 2


@pytest.mark.slow
def test_hf_generate(monkeypatch, capsys, tiny_dir):
    """Two turns of a chat in one cache: the second turn's cache holds the first's tokens and more; the report
    names both layers' cache sites."""
    _run(monkeypatch, "hf_generate.py", "--model", str(tiny_dir), "--compiler", "eager", "--max-new-tokens", "3")
    out = capsys.readouterr().out
    assert out.count("assistant:") == 2 and "2 cache site(s) rewritten" in out
    held = [int(n) for n in re.findall(r"the cache holds (\d+) tokens", out)]
    assert len(held) == 2 and held[1] > held[0] + 3, held


@pytest.mark.slow
def test_serve_client(monkeypatch, capsys, tiny_dir):
    _run(monkeypatch, "serve_client.py", "--model", str(tiny_dir), "--max-tokens", "4")
    out = capsys.readouterr().out
    for line in ("chat:", "streamed:", "parsed:", "ids:", "cache:    PagedKVCompileCache"):
        assert line in out, out


@pytest.mark.slow
def test_generate_tp_under_torchrun(tiny_dir):
    """examples/generate_tp.py as the README runs it, under torchrun with 2 ranks (gloo on loopback): every rank
    generates exactly the tokens the unsharded model generates under the same policy, and holds its share of
    the KV heads (1 of the tiny model's 2), about half the unsharded cache's bytes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvcompile
    from kvcompile import Policy

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(EXAMPLES / "generate_tp.py"), "--model", str(tiny_dir), "--max-new-tokens", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0] + "\n[killed after 240 s]"
    assert proc.returncode == 0, log[-4000:]

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = kvcompile.apply(AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval(),
                            Policy.kivi(4, sink=4, rotate=True))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    whole = kvcompile.nbytes(getattr(out, "cache", None) or out.past_key_values)

    assert ast.literal_eval(re.search(r"^tokens: (\[.*\])$", log, re.M).group(1)) == out.sequences[0, ids.shape[1]:].tolist()
    per_rank = {int(r): int(b.replace(",", "")) for r, b in re.findall(r"^rank (\d) of 2: cache ([\d,]+) bytes$", log, re.M)}
    assert sorted(per_rank) == [0, 1], log[-4000:]
    assert all(whole // 2 <= b < whole for b in per_rank.values()), (per_rank, whole)
