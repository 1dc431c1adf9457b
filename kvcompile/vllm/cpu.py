"""kvcompile's pages on the CPU: vLLM's CPU attention backend (``CPU_ATTN``) with ``KVCompileImpl`` mixed in, run by
kvcompile's generated C kernels (``kvcompile.ops``). ``kvcompile.vllm.register`` puts it in vLLM's registry in
place of vLLM's own class; with no policy named (or ``Policy.full()``) it is vLLM's own, every call."""
from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from .backend import kvcompile_backend

CPUBackend, CPUBackendImpl = kvcompile_backend(CPUAttentionBackend)
