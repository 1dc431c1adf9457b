"""kvcompile's cache folder, named by one environment variable.

``KVCOMPILE_CACHE_DIR`` names it; unset, it is ``$XDG_CACHE_HOME/kvcompile``, else ``~/.cache/kvcompile``. It holds
the embedded model's converted copy (``kvcompile.models``) and the compiled CPU kernels (its ``cpu`` folder,
``kvcompile.templates.cpu``). ``KVCOMPILE_CACHE``, which named the converted models' folder by itself before, is
still honoured when ``KVCOMPILE_CACHE_DIR`` is not set, with a ``FutureWarning`` (a setting its user, not a
programmer, has to change).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

ENV = "KVCOMPILE_CACHE_DIR"
DEPRECATED_ENV = "KVCOMPILE_CACHE"


def root() -> Path:
    """The cache folder (not created here: its users create what they need, each with its own permissions)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    if os.environ.get(DEPRECATED_ENV):
        warnings.warn(f"{DEPRECATED_ENV} is deprecated: set {ENV}={os.environ[DEPRECATED_ENV]} instead (one folder "
                      f"for the converted model and the compiled kernels)", FutureWarning, stacklevel=3)
        return Path(os.environ[DEPRECATED_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcompile"


def named() -> str:
    """How ``root()`` was chosen, for messages that tell the user where to point it instead."""
    for var in (ENV, DEPRECATED_ENV):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return f"the default: {ENV} is not set"
