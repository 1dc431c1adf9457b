"""One error root: every exception class the library defines derives from ``kvcompile.KVCompileError`` and from
the standard type it means, and every ``raise`` in the library raises one of them (or an explicit exception
listed here, with why)."""
import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

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


# Where the library raises a class outside the root on purpose: (file, class) -> why.
OUTSIDE_THE_ROOT = {
    ("kvcompile/cli.py", "argparse.ArgumentTypeError"): "argparse's protocol for a bad option value: argparse turns "
                                                        "it into the one-line usage error (exit status 2)",
    ("kvcompile/backend.py", "Analyzed"): "explain's analysis-only backend stops Dynamo with its report (INTERNAL)",
    ("passes/kv_cache.py", "_Reject"): "a site the pass skips, caught within the pass (INTERNAL)",
    ("kvcompile/serving.py", "AttributeError"): "a module's __getattr__ says a name is not there by Python's "
                                                "protocol (hasattr, getattr with a default)",
}
ROOT = Path(kvcompile.__file__).resolve().parent.parent
SOURCES = {"kvcompile": "kvcompile", "passes": "kvcompile.passes", "templates": "kvcompile.templates"}


def _imported_names(tree, module: str) -> dict:
    """Every name the file imports, anywhere in it (function-local imports too): name -> (module, attribute)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.rpartition(".")[0]) \
                if node.level else node.module
            for a in node.names:
                names[a.asname or a.name] = (base, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = (a.name.split(".")[0], None)
    return names


def _resolve(expr: str, module, imported: dict):
    """The object the raised expression names (``ValueError``, ``errors.PolicyError``, ``argparse.X``), or None
    for a value (``raise e``, ``raise error.with_traceback(tb)``: a re-raise of something caught)."""
    head, _, rest = expr.partition(".")
    if hasattr(module, head):
        obj = getattr(module, head)
    elif head in imported:
        mod, attr = imported[head]
        obj = importlib.import_module(mod)
        obj = getattr(obj, attr) if attr else obj
    elif hasattr(builtins, head):
        obj = getattr(builtins, head)
    else:
        return None
    for part in rest.split(".") if rest else []:
        obj = getattr(obj, part, None)
    return obj


def _raises():
    """(file, line, expression, class) of every ``raise`` of a class in the library's source."""
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            module_name = ".".join([package, *parts])
            if rel.name == "__main__":
                continue
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # an integration whose framework is not installed: its names resolve by import
                module = None
            tree = ast.parse(path.read_text())
            imported = _imported_names(tree, module_name if rel.name != "__init__" else module_name + ".__init__")
            for node in ast.walk(tree):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                    expr = ast.unparse(target)
                    obj = _resolve(expr, module, imported)
                    if isinstance(obj, type) and issubclass(obj, BaseException):
                        yield f"{folder}/{path.relative_to(ROOT / folder)}", node.lineno, expr, obj


def test_the_library_raises_only_the_roots_classes():
    """Every raise in kvcompile's source names a class of the root (or AssertionError, an invariant of the code's
    own), except the few in OUTSIDE_THE_ROOT; a bare ValueError or RuntimeError at a user-facing call is what
    this catches."""
    found = list(_raises())
    assert len(found) > 300  # the walk reaches the library (it raises about 400 times)
    stray = [f"{f}:{line} raise {expr}" for f, line, expr, cls in found
             if not issubclass(cls, (errors.KVCompileError, AssertionError)) and (f, expr) not in OUTSIDE_THE_ROOT]
    assert stray == [], "raises outside kvcompile.errors' root:\n" + "\n".join(stray)
    used = {(f, expr) for f, _, expr, _ in found}
    assert set(OUTSIDE_THE_ROOT) <= used, f"listed but no longer raised: {sorted(set(OUTSIDE_THE_ROOT) - used)}"


@pytest.mark.parametrize("cls, standard", [
    (errors.UnsupportedError, RuntimeError), (errors.ArgumentError, ValueError),
    (errors.ArgumentTypeError, TypeError), (errors.PolicyError, ValueError), (errors.BudgetError, ValueError),
    (errors.CapacityError, RuntimeError), (errors.RopeError, RuntimeError), (errors.PlanError, ValueError),
    (errors.ModelNotFound, FileNotFoundError), (errors.CompilerError, RuntimeError),
    (errors.CacheDirError, RuntimeError), (errors.RankError, RuntimeError), (errors.IndexOutOfRange, IndexError),
    (errors.KeyNotFound, KeyError), (errors.Unimplemented, NotImplementedError)])
def test_each_error_is_also_the_standard_type_it_means(cls, standard):
    assert issubclass(cls, errors.KVCompileError) and issubclass(cls, standard)


def test_the_public_names_are_the_errors_module_classes():
    assert kvcompile.KVCompileError is errors.KVCompileError
    assert kvcompile.PolicyError is errors.PolicyError and kvcompile.CapacityError is errors.CapacityError
    from kvcompile.passes import KVCompileError
    assert KVCompileError is errors.KVCompileError


def test_an_error_dynamo_wrapped_while_tracing_is_raised_as_itself():
    """What fails while Dynamo traces reaches kvcompile's entry points wrapped (here an operator's fake
    implementation, which Dynamo wraps in TorchRuntimeError); ``backend.unwrapped`` raises the kvcompile error
    itself, with Dynamo's exception as its cause. Anything else passes through as Dynamo raised it."""
    import torch

    from kvcompile.backend import unwrapped

    @torch.library.custom_op("kvcompile_test::refuses", mutates_args=())
    def refuses(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @refuses.register_fake
    def _(x):
        raise errors.RopeError("refused while tracing")

    compiled = torch.compile(lambda x: refuses(x) + 1, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError):  # what Dynamo raises on its own
        compiled(torch.ones(3))
    with pytest.raises(errors.RopeError, match="refused while tracing") as e, unwrapped():
        compiled(torch.ones(3))
    assert type(e.value) is errors.RopeError and isinstance(e.value.__cause__, torch._dynamo.exc.TorchDynamoException)
    with pytest.raises(torch._dynamo.exc.Unsupported), unwrapped():  # no kvcompile error inside: left alone
        torch.compile(lambda x: print(x) or x, backend="eager", fullgraph=True)(torch.ones(3))


def test_a_bad_policy_is_caught_by_the_root():
    with pytest.raises(kvcompile.KVCompileError) as e:
        kvcompile.Quant(format="int5")
    assert type(e.value) is errors.PolicyError and "Quant.format" in str(e.value)
