"""kvcompile: quantized KV caches for unmodified PyTorch decoders, as a torch.compile pass."""
from .errors import CapacityError, KVCompileError, KVCompileWarning, PolicyError, UnsupportedError
from .policy import Policy, Quant
from .store import QuantizedKV
from .accounting import bytes_per_token, cache_bytes
from .api import apply, nbytes
from .backend import kvcompile_backend  # noqa: F401  (registers the torch.compile backend "kvcompile")
from .explain import explain
from .calibrate import calibrate
from . import hf  # noqa: F401  (registers transformers' sliding-window rings as the model's own)
from . import extension, serving
from .passes import paged

# Serving stands on the core, which never imports it: it attaches through the core's extension points
# (docs/design.md, "The core and its integrations")
extension.on_apply(serving.attach)  # model.generate_batch / init_continuous_batching, kvcompile serve
extension.add_graph_rewrite(paged.rewrite_paged)  # a compiled continuous-batching forward's page pools

__all__ = ["apply", "calibrate", "explain", "nbytes", "KVCompileError", "KVCompileWarning", "UnsupportedError", "Quant", "Policy", "PolicyError", "CapacityError", "QuantizedKV", "bytes_per_token", "cache_bytes"]
__version__ = "0.1.0"
