"""The import graph of the package: the core reaches nothing of serving, and no module imports itself back.

Every module's imports are read from its source (``ast``), function-level ones included, and resolved to the
package's modules. Serving stands on the core and attaches through the core's extension points
(``kvcompile.extension``); the package's top level wires it in (docs/design.md, "The core and its
integrations"). Importing a submodule runs its parent packages' ``__init__`` too: those implicit edges are not
the module's own imports and are not counted (the top level is where serving is wired in).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import kvcompile
import kvcompile.passes
import kvcompile.templates

# serving: transformers' continuous batching over kvcompile's store, and the OpenAI-compatible server on it
SERVING = {"kvcompile.serving", "kvcompile.pool", "kvcompile.engine", "kvcompile.scheduler", "kvcompile.window",
           "kvcompile.sampling", "kvcompile.paged_ops", "kvcompile.passes.paged", "kvcompile.serve",
           "kvcompile.openai_server", "kvcompile.json_mode"}
# the vLLM plugin: vLLM's attention backend over the core's pages (kvcompile.pages); vLLM loads it by entry point
VLLM = {"kvcompile.vllm", "kvcompile.vllm.backend", "kvcompile.vllm.config", "kvcompile.vllm.cpu",
        "kvcompile.vllm.cuda", "kvcompile.vllm.window"}
INTEGRATIONS = SERVING | VLLM
# above both: the package's top level (it wires serving in), the command line, and the planner (which sizes
# serving pools with serving's own functions)
ABOVE = {"kvcompile", "kvcompile.__main__", "kvcompile.cli", "kvcompile.plan"}


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of the package (its three import packages), by dotted name."""
    out = {}
    for pkg in (kvcompile, kvcompile.passes, kvcompile.templates):
        for f in pathlib.Path(pkg.__path__[0]).glob("*.py"):
            out[pkg.__name__ if f.stem == "__init__" else f"{pkg.__name__}.{f.stem}"] = f
    for f in (pathlib.Path(kvcompile.__path__[0]) / "vllm").glob("*.py"):  # (a package; vLLM need not be here)
        out["kvcompile.vllm" if f.stem == "__init__" else f"kvcompile.vllm.{f.stem}"] = f
    return out


def imports_of(name: str, source: str, is_package: bool, modules) -> dict[str, int]:
    """The package's modules that ``source`` (the module ``name``) imports, each with the line of its first
    import, wherever the import statement is (module level, a function, a class, a branch)."""
    package = name if is_package else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in modules:  # kvcompile.store.KVStore -> kvcompile.store
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, node.lineno)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    modules = package_modules()
    return {m: imports_of(m, f.read_text(), f.stem == "__init__", modules) for m, f in modules.items()}


def test_the_reader_finds_imports_at_every_level():
    """The reader resolves relative, absolute and function-level imports (so the checks below read real edges)."""
    modules = {"kvcompile", "kvcompile.a", "kvcompile.serving", "kvcompile.passes", "kvcompile.passes.paged"}
    src = ("from .. import a\nimport kvcompile.passes.paged\n"
           "def f():\n    from ..serving import configure\n"
           "class C:\n    def g(self):\n        from . import paged\n        from .kv_cache import Site\n")
    assert imports_of("kvcompile.passes.x", src, False, modules) == {
        "kvcompile.a": 1, "kvcompile.passes.paged": 2, "kvcompile.serving": 4, "kvcompile.passes": 8}
    assert imports_of("kvcompile.x", "from .passes.paged import rewrite_paged\nfrom kvcompile import a\n", False,
                      modules) == {"kvcompile.passes.paged": 1, "kvcompile.a": 2}


def test_the_sets_name_real_modules(graph):
    assert INTEGRATIONS | ABOVE <= set(graph)
    assert len(set(graph) - INTEGRATIONS - ABOVE) >= 25  # the core: policy, quant, store, kernels, pass, apply, backend
    assert "kvcompile.serving" in graph["kvcompile"]  # the top level wires serving in


def _path(graph, start: str, targets: set[str]) -> list[str] | None:
    """The first import path (breadth first) from ``start`` to a module in ``targets``, or None."""
    seen, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in graph.get(m, {}):
                if t not in seen:
                    seen[t] = seen[m] + [t]
                    if t in targets:
                        return seen[t]
                    nxt.append(t)
        frontier = nxt
    return None


def test_the_core_reaches_nothing_of_serving(graph):
    """No core module imports serving or the vLLM plugin, directly or through another module, at any level."""
    reached = {m: p for m in sorted(set(graph) - INTEGRATIONS - ABOVE) if (p := _path(graph, m, INTEGRATIONS))}
    assert not reached, "the core imports an integration: " + "; ".join(" -> ".join(p) for p in reached.values())


def test_the_vllm_plugin_stands_on_the_core_alone(graph):
    """The plugin builds on the core's small interface, not on kvcompile's own serving engine."""
    reached = {m: p for m in sorted(VLLM) if (p := _path(graph, m, SERVING))}
    assert not reached, "the vLLM plugin imports serving: " + "; ".join(" -> ".join(p) for p in reached.values())


def test_the_import_graph_has_no_cycle(graph):
    """No module reaches itself again through imports -- function-level ones included, so none of them is
    there to break a cycle."""
    cycles = [p for m in sorted(graph) if (p := _path(graph, m, {m}))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(p) for p in cycles)


def test_the_core_alone_installs_nothing_for_serving(monkeypatch):
    """``apply`` with no integration registered (the core on its own) leaves transformers' continuous batching
    as it is: serving attaches only through ``extension.on_apply``."""
    import torch
    import transformers

    from kvcompile import Policy, extension

    monkeypatch.setattr(extension, "_APPLY_HOOKS", [])
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    bare = kvcompile.apply(transformers.LlamaForCausalLM(cfg).eval(), Policy.int8())
    assert "init_continuous_batching" not in vars(bare) and not hasattr(bare, "_kvcompile_serving")
    monkeypatch.undo()
    wired = kvcompile.apply(transformers.LlamaForCausalLM(cfg).eval(), Policy.int8())
    assert "init_continuous_batching" in vars(wired) and wired._kvcompile_serving.kv_heads == 1


# --------------------------------------------------------------------------- classes
# Classes built inside a function, as "module: function.Class" -> why it must be so. None: every class is an
# ordinary module-level class (it pickles, its name says where it lives, and what it closes over is visible in
# its constructor). An entry here names the reason a class must close over a function's local state.
NESTED_CLASSES: dict[str, str] = {}


def classes_in_functions(source: str) -> list[str]:
    """The classes ``source`` builds inside a function, at any depth: each ``class`` statement and each
    three-argument ``type(name, bases, namespace)`` call in a function's body, by qualified name
    (``Outer.method.Class``; a ``type`` call as ``function.type()``) with its line."""
    found = []

    def visit(node, qualname: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.ClassDef):
                found.append(f"{qualname}.{child.name}:{child.lineno}")
            elif (in_function and isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                  and child.func.id == "type" and len(child.args) == 3):
                found.append(f"{qualname}.type():{child.lineno}")
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                is_function = not isinstance(child, ast.ClassDef)
                visit(child, f"{qualname}.{child.name}".lstrip("."), in_function or is_function)
            else:
                visit(child, qualname, in_function)

    visit(ast.parse(source), "", False)
    return found


def test_the_reader_finds_classes_built_in_functions():
    src = ("class Top:\n    class Inner:\n        pass\n    def m(self):\n        class InMethod: pass\n"
           "def f():\n    if True:\n        class InBranch(int): pass\n    def g():\n        class Deeper: pass\n"
           "    return type('Made', (object,), {})\n"
           "async def h():\n    class InAsync: pass\n"
           "x = type(3)\n")
    assert classes_in_functions(src) == ["Top.m.InMethod:5", "f.InBranch:8", "f.g.Deeper:10", "f.type():11",
                                         "h.InAsync:13"]


def test_no_class_is_built_inside_a_function():
    """Every class of the package (kvcompile, its passes and templates, the vLLM plugin) is a module-level class
    (a class nested in a class is module-level too); ``NESTED_CLASSES`` names any exception and its reason."""
    nested = {f"{name}: {c.rsplit(':', 1)[0]}": c.rsplit(":", 1)[1] for name, f in package_modules().items()
              for c in classes_in_functions(f.read_text())}
    unexplained = {k: line for k, line in nested.items() if k not in NESTED_CLASSES}
    assert not unexplained, "classes built inside functions (line): " + ", ".join(
        f"{k} ({line})" for k, line in unexplained.items())
    assert set(NESTED_CLASSES) <= set(nested), "NESTED_CLASSES names classes that are not built in functions"
