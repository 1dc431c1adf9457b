"""Extension points: how an integration attaches to the core without the core importing it.

The core (policy, quant, store, kernels, the pass, ``apply``, the backend) imports nothing from its integrations
and installs nothing for them by name. An integration -- ``kvcompile.serving`` (transformers' continuous
batching, ``kvcompile serve``), a vLLM plugin -- imports the core and registers here:

- ``on_apply(hook)``: ``hook(model, applied)`` runs at the end of every ``kvcompile.apply`` on a transformers
  model (``applied`` is the model's ``api.Applied`` record: policy, layer names, the KV heads this rank caches).
  ``kvcompile.serving`` attaches ``model.init_continuous_batching`` this way.
- ``add_graph_rewrite(rewrite)``: ``rewrite(gm)`` runs on every graph the ``"kvcompile"`` backend compiles,
  before the core's pass; it rewrites what it owns and leaves the rest (``kvcompile.passes.paged``: a compiled
  continuous-batching forward's page pools).
- a cache that runs the forward itself (``ForwardOwner``): the applied forward, given such a cache, hands it the
  model's own forward instead of running the core's compiled one (``kvcompile.serving``'s paged cache, under
  transformers' continuous batching).

The package's top level (``kvcompile/__init__.py``) wires ``kvcompile.serving`` in, so every documented entry
point works after ``import kvcompile``; ``tests/test_imports.py`` checks that the core reaches nothing of it.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

_APPLY_HOOKS: list[Callable[[Any, Any], None]] = []
_GRAPH_REWRITES: list[Callable[[Any], Any]] = []


def on_apply(hook: Callable[[Any, Any], None]) -> None:
    """Run ``hook(model, applied)`` after every ``kvcompile.apply`` on a transformers model (once per hook)."""
    if hook not in _APPLY_HOOKS:
        _APPLY_HOOKS.append(hook)


def applied(model, record) -> None:
    """Called by ``kvcompile.apply`` once the model is applied: every ``on_apply`` hook, in registration order."""
    for hook in _APPLY_HOOKS:
        hook(model, record)


def add_graph_rewrite(rewrite: Callable[[Any], Any]) -> None:
    """Run ``rewrite(gm)`` on every graph the kvcompile backend compiles, before the core's pass (once per
    rewrite). It must leave a graph it does not own unchanged."""
    if rewrite not in _GRAPH_REWRITES:
        _GRAPH_REWRITES.append(rewrite)


def rewrite_graph(gm) -> None:
    """Called by the backend on its own copy of each graph: every registered rewrite, in registration order."""
    for rewrite in _GRAPH_REWRITES:
        rewrite(gm)


class ForwardOwner(Protocol):
    """A cache that runs an applied model's forward itself: the applied forward calls
    ``cache.kvcompile_forward(forward, *args, **kwargs)`` with the model's own (unapplied) forward. ``compiled``:
    whether that forward runs inside a graph compiled around it (torch's thread count is then held fixed, as for
    the core's compiled calls)."""

    compiled: bool

    def kvcompile_forward(self, forward, /, *args, **kwargs): ...
