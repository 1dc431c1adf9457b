"""kvcompile: quantized KV caches for unmodified PyTorch decoders, as a torch.compile pass."""
from .policy import Policy, PolicyError, Quant
from .store import CapacityError, QuantizedKV
from .accounting import bytes_per_token, cache_bytes
from .passes import KVCompileError
from .api import apply, explain  # also registers the torch.compile backend "kvcompile"
from . import hf as _hf  # noqa: F401,E402  (transformers' sliding-window rings are registered as the model's own)

__all__ = ["apply", "explain", "KVCompileError", "Quant", "Policy", "PolicyError", "CapacityError", "QuantizedKV", "bytes_per_token", "cache_bytes"]
__version__ = "0.1.0"
