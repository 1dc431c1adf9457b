"""Every exception kvcompile raises, under one root.

``except kvcompile.KVCompileError`` catches all of them; each class also derives from the standard type it
means (a bad value is a ``ValueError``, a model or call kvcompile cannot run correctly a ``RuntimeError``), so
code written against the standard types keeps working. Messages say what was found, what was expected and what
to do. The module imports nothing, so every part of the library (the pass, the kernels, serving) can raise
these without an import cycle.
"""
from __future__ import annotations


class KVCompileError(Exception):
    """The root of every kvcompile error."""


class UnsupportedError(KVCompileError, RuntimeError):
    """A model, graph, cache or call that kvcompile cannot run correctly (the pass met a graph it cannot rewrite
    safely, a cache used in a way it cannot follow, ...); the message says why and what to do instead."""


class ArgumentError(KVCompileError, ValueError):
    """An argument whose value is not valid."""


class ArgumentTypeError(KVCompileError, TypeError):
    """An argument of the wrong type."""


class IndexOutOfRange(KVCompileError, IndexError):
    """An index outside what it indexes: a sequence of the batch, a block of the pool."""


class KeyNotFound(KVCompileError, KeyError):
    """A lookup of something kvcompile holds no record of: a store layout by name, a request's log
    probabilities."""


class Unimplemented(KVCompileError, NotImplementedError):
    """A case kvcompile's kernels or integrations do not implement (yet): a head size, an output format."""


class PolicyError(KVCompileError, ValueError):
    """A policy that cannot be built or applied."""


class BudgetError(PolicyError):
    """A budget no choice of candidates fits; ``minimum`` is the cheapest choice's cost (same unit)."""

    def __init__(self, message: str, minimum=None):
        super().__init__(message)
        self.minimum = minimum


class CapacityError(KVCompileError, RuntimeError):
    """An append that does not fit in the cache (its token limit, or its block budget)."""


class RopeError(KVCompileError, RuntimeError):
    """Pre-RoPE keys cannot be stored exactly for this model or call."""


class PlanError(KVCompileError, ValueError):
    """A plan that cannot be made from what was given."""


class WeightsUnknown(PlanError):
    """The weights' size is needed and could not be read from the model folder."""


class ModelNotFound(KVCompileError, FileNotFoundError):
    """The requested model is neither the embedded default nor a local Hugging Face directory."""


class CompilerError(KVCompileError, RuntimeError):
    """No C compiler, or a kernel failed to build."""


class CacheDirError(KVCompileError, RuntimeError):
    """The kernel cache directory cannot be created, written, or trusted."""


class RankError(UnsupportedError):
    """Another rank of the tensor-parallel group failed; this rank stops too rather than wait for it.
    ``rank`` is the failing rank (global), ``error`` its error as ``"Type: message"``."""

    def __init__(self, message: str, rank: int, error: str):
        super().__init__(message)
        self.rank, self.error = rank, error


class KVCompileWarning(UserWarning):
    """kvcompile runs, but does less than a user would assume; the message says what and why."""
