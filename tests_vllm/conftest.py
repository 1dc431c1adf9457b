"""Tests of the vLLM plugin (``kvcompile.vllm``), run in an environment with vLLM's CPU build (``.ci/run`` makes
it: vLLM pins transformers below the 5.24 that ``kvcompile[test]`` pins, so the two cannot share one).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor), so a test can reach
vLLM's own cache tensors and watch what the backend receives; ``test_serve.py`` runs ``vllm serve`` as users do, in
vLLM's default processes. The model is a tiny random Llama with a byte-level BPE tokenizer trained here on
Python's own documentation (``pydoc_data``): nothing is downloaded.
"""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: let the OS place the threads
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
sys.path.append(str(Path(__file__).parent.parent / "tests"))  # shared helpers (stored_reference), after this folder

import pytest  # noqa: E402
import torch  # noqa: E402

KV_BYTES = 32 << 20  # each engine's KV memory (vLLM's kv_cache_memory_bytes)
MAX_LEN = 1024


def make_tiny(path, vocab: int = 512, seed: int = 0):
    """A 2-layer random Llama (4 query heads, 2 kv heads of 64 channels) and its tokenizer, saved in ``path``."""
    import transformers
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(list(topics.values()), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, initializer_range=0.1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("tiny")))


def make_sliding(path, tokenizer: str, layers: tuple = ("sliding", "full", "sliding", "full"), seed: int = 0,
                 window: int = 48):
    """A random Gemma 3 (text) with ``layers`` of sliding-window (``window`` tokens) and full attention, 4 query
    heads, 2 kv heads of 64 channels, and the tokenizer saved in ``tokenizer``, saved in ``path``."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, sliding_window=window,
        layer_types=[f"{kind}_attention" for kind in layers], bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=0, initializer_range=0.05, tie_word_embeddings=False)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def sliding(tmp_path_factory, tiny):
    """A model whose layers alternate sliding-window and full attention (``make_sliding``)."""
    return str(make_sliding(tmp_path_factory.mktemp("sliding"), tiny))


@pytest.fixture(scope="session")
def sliding_wide(tmp_path_factory, tiny):
    """``sliding`` with a window of 200 tokens: longer than KIVI's default window cache (159 positions)."""
    return str(make_sliding(tmp_path_factory.mktemp("sliding_wide"), tiny, window=200))


def engine(model: str, policy=None, dtype: str = "float32", **kw):
    """An ``LLM`` in this process, with ``policy`` (a name or a policy object) in its ``additional_config``."""
    from vllm import LLM
    extra = {"additional_config": {"kvcompile": {"policy": policy}}} if policy is not None else {}
    args = dict(model=model, dtype=dtype, enforce_eager=True, max_model_len=MAX_LEN, seed=0,
                distributed_executor_backend="uni", kv_cache_memory_bytes=KV_BYTES)
    return LLM(**{**args, **kw, **extra})


def close(llm) -> None:
    """Shut an in-process engine down and free its cache before the next one starts."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def caches(llm) -> dict:
    """The engine's per-layer cache tensors (vLLM's own, as bound to its attention layers), by layer name."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ctx = runner.compilation_config.static_forward_context
    return {name: layer.kv_cache for name, layer in ctx.items() if hasattr(layer, "kv_cache")}


def impls(llm) -> dict:
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ctx = runner.compilation_config.static_forward_context
    return {name: layer.impl for name, layer in ctx.items() if hasattr(layer, "impl")}


_INVARIANT: dict = {}  # dtype -> whether vLLM's own engine is batch-invariant in it on this machine


def vllm_is_batch_invariant(model: str, dtype: str, prompts: list[str]) -> bool:
    """Whether vLLM's own engine (no kvcompile) gives a request the same log probabilities, to the bit, with and
    without a cached prefix of ``prompts`` in ``dtype`` on this machine. It does on some CPUs; on others (seen on an
    Intel Xeon with AMX, bf16 and float32 alike) its matmuls round a row differently with the number of rows a step
    holds, so a request's keys and values differ in their last bits between a whole prefill and a cached one."""
    if dtype not in _INVARIANT:
        from vllm import SamplingParams
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
        own = engine(model, None, dtype=dtype)
        try:
            first = own.generate(prompts, sp, use_tqdm=False)
            again = own.generate(prompts[:3], sp, use_tqdm=False)
        finally:
            close(own)

        def lps(o):
            return [(t, d[t].logprob) for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        _INVARIANT[dtype] = all(lps(a) == lps(f) for a, f in zip(again, first))
    return _INVARIANT[dtype]


def assert_same_tokens(got, want, model: str, dtype: str, prompts: list[str], what: str) -> None:
    """``got == want`` (greedy tokens of the same requests computed two ways), unless vLLM's own engine is not
    batch-invariant here (``vllm_is_batch_invariant``): a quantized cache then rounds the keys whose last bits vLLM
    computed differently to different codes, and a token may change for reasons that are vLLM's. kvcompile's own
    part -- a token's attention over the pages is the same bits however the work is cut -- is tested without vLLM
    (tests/test_pages.py); this skip says what was seen, and only where the tokens differ."""
    if got == want:
        return
    if not vllm_is_batch_invariant(model, dtype, prompts):
        pytest.skip(f"{what}: the tokens differ, and so do vLLM's own {dtype} log probabilities with and without a "
                    f"cached prefix on this CPU (its matmuls are not batch-invariant here), so the difference cannot "
                    f"be kvcompile's to assert")
    assert got == want, what
