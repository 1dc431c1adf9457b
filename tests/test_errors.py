"""One error root: every exception class the library defines derives from ``kvcompile.KVCompileError`` and from
the standard type it means."""
import importlib
import inspect
import pkgutil

import pytest

import kvcompile
from kvcompile import errors

# Exceptions that carry control flow inside one function's reach and never leave the library.
INTERNAL = {"kvcompile.backend.Analyzed", "kvcompile.passes.kv_cache._Reject"}


def _modules():
    for pkg in (kvcompile, importlib.import_module("kvcompile.passes"), importlib.import_module("kvcompile.templates")):
        yield pkg
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            yield importlib.import_module(info.name)


def _defined_exceptions():
    seen = {}
    for mod in _modules():
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                seen[f"{mod.__name__}.{name}"] = obj
    return seen


def test_every_exception_the_library_defines_has_the_one_root():
    found = _defined_exceptions()
    assert "kvcompile.errors.UnsupportedError" in found and "kvcompile.store.KVStore" not in found
    stray = sorted(n for n, c in found.items()
                   if n not in INTERNAL and not issubclass(c, (errors.KVCompileError, Warning)))
    assert stray == [], f"exception classes outside kvcompile.errors' root: {stray}"
    assert all(n in found for n in INTERNAL), "an internal exception was renamed: update INTERNAL"


@pytest.mark.parametrize("cls, standard", [
    (errors.UnsupportedError, RuntimeError), (errors.ArgumentError, ValueError),
    (errors.ArgumentTypeError, TypeError), (errors.PolicyError, ValueError), (errors.BudgetError, ValueError),
    (errors.CapacityError, RuntimeError), (errors.RopeError, RuntimeError), (errors.PlanError, ValueError),
    (errors.ModelNotFound, FileNotFoundError), (errors.CompilerError, RuntimeError),
    (errors.CacheDirError, RuntimeError), (errors.RankError, RuntimeError)])
def test_each_error_is_also_the_standard_type_it_means(cls, standard):
    assert issubclass(cls, errors.KVCompileError) and issubclass(cls, standard)


def test_the_public_names_are_the_errors_module_classes():
    assert kvcompile.KVCompileError is errors.KVCompileError
    assert kvcompile.PolicyError is errors.PolicyError and kvcompile.CapacityError is errors.CapacityError
    from kvcompile.passes import KVCompileError
    assert KVCompileError is errors.KVCompileError


def test_a_bad_policy_is_caught_by_the_root():
    with pytest.raises(kvcompile.KVCompileError) as e:
        kvcompile.Quant(format="int5")
    assert type(e.value) is errors.PolicyError and "Quant.format" in str(e.value)
