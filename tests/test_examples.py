"""Every example script runs (at tiny sizes), so none of them rots."""
import runpy
import sys
from pathlib import Path

import pytest


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(monkeypatch, name, *args):
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_plan_concurrency(monkeypatch, capsys, tmp_path):
    _run(monkeypatch, "plan_concurrency.py", "--plot", str(tmp_path / "p.png"))
    out = capsys.readouterr().out
    assert "ideal 16-bit" in out and " 52 " in out and (tmp_path / "p.png").exists()


def test_per_layer_policy(monkeypatch, capsys, tiny_dir):
    _run(monkeypatch, "per_layer_policy.py", "--model", str(tiny_dir), "--window", "256")
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn" in out and "per-layer mix" in out


def test_hf_generate(monkeypatch, capsys, tiny_dir):
    _run(monkeypatch, "hf_generate.py", "--model", str(tiny_dir), "--compiler", "eager", "--max-new-tokens", "3")
    out = capsys.readouterr().out
    assert out.count("assistant:") == 2 and "the cache holds" in out and "2 cache site(s) rewritten" in out


def test_serve_client(monkeypatch, capsys, tiny_dir):
    _run(monkeypatch, "serve_client.py", "--model", str(tiny_dir), "--max-tokens", "4")
    out = capsys.readouterr().out
    for line in ("chat:", "streamed:", "parsed:", "ids:", "cache:    PagedKVCompileCache"):
        assert line in out, out
