"""kvcompile's pages on CUDA: vLLM's Triton and FlashAttention backends with ``KVCompileImpl`` mixed in (the
backend vLLM's CUDA platform picks for a decoder model is one of them), run by kvcompile's Triton kernels
(``kvcompile.ops``). Written against vLLM 0.32.0's CUDA build and not yet run on a GPU: the same pages, store and
attention as the CPU backend, whose tests run the Triton kernels over page views in Triton's interpreter
(tests/test_pages.py). Imported by ``kvcompile.vllm.register`` on CUDA only.
"""
from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

from .backend import kvcompile_backend

FlashBackend, FlashBackendImpl = kvcompile_backend(FlashAttentionBackend)
TritonBackend, TritonBackendImpl = kvcompile_backend(TritonAttentionBackend)
