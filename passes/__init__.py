"""kvcompile's graph passes (installed as ``kvcompile.passes``). See ``kv_cache`` for the stage and the why."""
from kvcompile.errors import KVCompileError

from .kv_cache import (Analysis, Site, Skipped, analyze, check_fused, counters, find_reads,
                       find_writes, layer_name, rewrite)

__all__ = ["Analysis", "KVCompileError", "Site", "Skipped", "analyze", "check_fused", "counters", "find_reads",
           "find_writes", "layer_name", "rewrite"]
