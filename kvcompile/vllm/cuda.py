"""kvcompile's pages on CUDA: vLLM's Triton and FlashAttention backends with ``KVCompileImpl`` mixed in (the
backend vLLM's CUDA platform picks for a decoder model is one of them), run by kvcompile's Triton kernels
(``kvcompile.ops``). Written against vLLM 0.32.0's CUDA build and not yet run on a GPU: the same pages, store and
attention as the CPU backend, whose tests run the Triton kernels over page views in Triton's interpreter
(tests/test_pages.py). Imported by ``kvcompile.vllm.register`` on CUDA only.
"""
from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)
from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                     TritonAttentionMetadataBuilder)

from .backend import KVCompileBackend, KVCompileBuilder, KVCompileImpl


class FlashBackendImpl(KVCompileImpl, FlashAttentionImpl):
    """vLLM's FLASH_ATTN implementation over kvcompile's pages when a quantizing policy is named."""


class FlashBuilder(KVCompileBuilder, FlashAttentionMetadataBuilder):
    """vLLM's FLASH_ATTN metadata builder, declaring no CUDA graphs."""


class FlashBackend(KVCompileBackend, FlashAttentionBackend):
    """vLLM's FLASH_ATTN backend with kvcompile's pages."""

    builder = FlashBuilder

    @staticmethod
    def get_impl_cls():
        return FlashBackendImpl


class TritonBackendImpl(KVCompileImpl, TritonAttentionImpl):
    """vLLM's TRITON_ATTN implementation over kvcompile's pages when a quantizing policy is named."""


class TritonBuilder(KVCompileBuilder, TritonAttentionMetadataBuilder):
    """vLLM's TRITON_ATTN metadata builder, declaring no CUDA graphs."""


class TritonBackend(KVCompileBackend, TritonAttentionBackend):
    """vLLM's TRITON_ATTN backend with kvcompile's pages."""

    builder = TritonBuilder

    @staticmethod
    def get_impl_cls():
        return TritonBackendImpl
