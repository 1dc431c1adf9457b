"""kvcompile as vLLM's KV cache: a vLLM plugin (``pip install "kvcompile[vllm]"`` registers it).

    LLM(model=..., additional_config={"kvcompile": {"policy": "int8"}})
    vllm serve MODEL --additional-config '{"kvcompile": {"policy": "tok+rot:4"}}'

vLLM then keeps each layer's cache as kvcompile's packed pages inside its own block tensors, written and read by
kvcompile's kernels (``backend.py``; the policy: ``config.py``; what a page holds: ``kvcompile.pages``). With no
``"kvcompile"`` entry in ``additional_config`` vLLM runs as it does without kvcompile. docs/vllm.md has the rest:
what is refused and why.
"""
from __future__ import annotations

BACKEND_CPU = "kvcompile.vllm.backend.CPUBackend"


def register() -> None:
    """vLLM's entry point (group ``vllm.general_plugins``, name ``kvcompile``), run in every vLLM process: make
    vLLM's CPU attention backend kvcompile's (``backend.CPUBackend``, which is vLLM's own unless a policy is
    named). Idempotent."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CPU)
