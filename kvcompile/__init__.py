"""kvcompile: quantized KV caches for unmodified PyTorch decoders, as a torch.compile pass."""
from .policy import Policy, PolicyError, Quant
from .store import CapacityError, QuantizedKV
from .accounting import bytes_per_token, cache_bytes

__all__ = ["Quant", "Policy", "PolicyError", "CapacityError", "QuantizedKV", "bytes_per_token", "cache_bytes"]
__version__ = "0.1.0"
