"""Model loading: the embedded SmolLM2 (converted once, cached) and local Hugging Face directories."""
import time

import pytest
import torch

from kvcompile import models


def test_a_path_that_is_not_a_model_says_what_to_do(tmp_path):
    with pytest.raises(models.ModelNotFound, match="no config.json"):
        models.resolve(tmp_path / "nothing-here")


def test_a_local_directory_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve(tmp_path) == tmp_path


def test_one_cache_folder_for_models_and_kernels_follows_one_variable(monkeypatch, tmp_path):
    """KVCOMPILE_CACHE_DIR names the folder of both the converted model and the compiled kernels; unset, the XDG
    rule; the old KVCOMPILE_CACHE is still honoured, with a FutureWarning naming the new variable, and loses to
    KVCOMPILE_CACHE_DIR when both are set."""
    import warnings

    from kvcompile.templates import cpu
    for var in ("KVCOMPILE_CACHE_DIR", "KVCOMPILE_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x" / "kvcompile" and cpu.cache_dir() == models.cache_dir() / "cpu"
    monkeypatch.setenv("KVCOMPILE_CACHE_DIR", str(tmp_path / "c"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.cache_dir() == tmp_path / "c" and cpu.cache_dir() == tmp_path / "c" / "cpu"
    monkeypatch.setenv("KVCOMPILE_CACHE", str(tmp_path / "old"))
    assert models.cache_dir() == tmp_path / "c"  # the new variable wins, silently
    monkeypatch.delenv("KVCOMPILE_CACHE_DIR")
    with pytest.warns(FutureWarning, match=rf"KVCOMPILE_CACHE is deprecated: set KVCOMPILE_CACHE_DIR={tmp_path}/old"):
        assert models.cache_dir() == tmp_path / "old"
    with pytest.warns(FutureWarning):
        assert cpu.cache_dir() == tmp_path / "old" / "cpu"


def test_a_conversion_finished_meanwhile_by_another_process_is_kept(monkeypatch, tmp_path, tiny_dir):
    """Two processes' first start (two servers, two test workers) convert at once: the one that finishes second
    keeps the first one's complete copy (it is already being read) instead of deleting it or failing. The other
    process is played by a copy that appears while this one converts (the loaders stand in for the GGUF's, to
    keep it fast: what is tested is the cache's files)."""
    import shutil

    import transformers

    monkeypatch.setenv("KVCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    target = models.converted_path()
    tiny = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)

    def load_model(*a, **k):  # meanwhile, the other process finishes its conversion
        shutil.copytree(tiny_dir, target)
        (target / "theirs").write_text("")
        return tiny

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    assert models.convert_default(log=lambda *a: None) == target
    assert (target / "theirs").exists() and (target / "config.json").exists()
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary copy left behind


def test_the_wheel_holds_a_gguf():
    g = models.find_gguf()
    assert g.suffix == ".gguf" and g.stat().st_size > 50_000_000


@pytest.mark.slow
def test_smollm2_loads_from_the_converted_copy_and_answers():
    path = models.convert_default(log=lambda *a: None)  # converts on the first run only
    t0 = time.perf_counter()
    model, tok = models.load()
    assert time.perf_counter() - t0 < 30  # a reload, not a conversion (~2 s on an idle machine)
    assert models.resolve("smollm2") == path and not hasattr(model.config, "quantization_config")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(ids["input_ids"], max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])
