"""kvcompile's pages on the CPU: vLLM's CPU attention backend (``CPU_ATTN``) with ``KVCompileImpl`` mixed in, run by
kvcompile's generated C kernels (``kvcompile.ops``). ``kvcompile.vllm.register`` puts it in vLLM's registry in
place of vLLM's own class; with no policy named (or ``Policy.full()``) it is vLLM's own, every call."""
from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                  CPUAttentionMetadataBuilder)

from .backend import KVCompileBackend, KVCompileBuilder, KVCompileImpl


class CPUBackendImpl(KVCompileImpl, CPUAttentionBackendImpl):
    """vLLM's CPU_ATTN implementation over kvcompile's pages when a quantizing policy is named."""


class CPUBuilder(KVCompileBuilder, CPUAttentionMetadataBuilder):
    """vLLM's CPU_ATTN metadata builder, declaring no CUDA graphs (as vLLM's CPU build captures none: the same
    builder on every platform)."""


class CPUBackend(KVCompileBackend, CPUAttentionBackend):
    """vLLM's CPU_ATTN backend with kvcompile's pages."""

    builder = CPUBuilder

    @staticmethod
    def get_impl_cls():
        return CPUBackendImpl
