"""Every tensor a Triton test hands a kernel is on the kernel's device (``DEV``).

On the first GPU run (2026-12-04) ``test_positions_past_a_narrow_mask_are_invisible`` passed CPU tensors to the
Triton launcher ("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"): on the CPU, where
``DEV`` is the CPU too, nothing can tell. So this reads the Triton tests' source: at every kernel call -- the
launchers (``launch.attention``, ``launch.store``, ``kattn.launch_attention``, ``kstore.launch_store``), a
``KVStore.append(..., kernel=launch.store)``, ``run(kernel, grid, {...})`` and ``kernel[grid](...)`` -- each
tensor argument must mention ``DEV`` (``x.to(DEV)``, ``device=DEV``, ``store.copy(DEV)``), or be a name that the
enclosing function (or the module) binds to such an expression. A call meant for host tensors says so with a
``# host: <why>`` comment on its line. The launchers also refuse tensors on mixed devices at run time
(``templates.launch.check_devices``), so the GPU run gets a clear error too.
"""
import ast
import pathlib

import pytest
import torch

from kvcompile import Policy
from kvcompile.store import LayerSpec
from kvcompile.templates import launch

HERE = pathlib.Path(__file__).parent
# the Triton tests (the C kernels' and Inductor's tests run on the CPU only)
FILES = sorted(p for p in HERE.glob("test_*.py")
               if not p.name.startswith(("test_cpu", "test_inductor", "test_kernel_devices")))
# launcher -> the names of its parameters that are not tensors (positional order as in its signature)
LAUNCHERS = {
    "launch.attention": ["q", "state", "spec", "mask", "scale"],
    "launch.store": ["state", "spec", "k", "v", "n_new"],
    "kattn.launch_attention": ["q", "state", "spec", "mask", "scale", "dot", "tiles", "chunk", "rope"],
    "kstore.launch_store": ["state", "spec", "k", "v", "n_new"],
}
NOT_TENSORS = {"spec", "scale", "dot", "tiles", "kernel", "nsplit", "invariant", "**",  # **: constexprs
               "groups"}  # host offsets of runs of rows (``launch.attention``: read on the host)


def _bindings(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """name -> the expressions ``scope`` binds it to (assignments, loop targets, with-items, comprehensions)."""
    out: dict[str, list[ast.AST]] = {}

    def bind(target, value):
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                out.setdefault(node.id, []).append(value)

    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                bind(t, node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            bind(node.target, node.value)
        elif isinstance(node, (ast.For, ast.comprehension)):
            bind(node.target, node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bind(node.optional_vars, node.context_expr)
        elif isinstance(node, ast.NamedExpr):
            bind(node.target, node.value)
    return out


def _placed(expr: ast.AST, scopes: list[dict], helpers: set, params: set, seen=()) -> bool:
    """Whether ``expr`` is on DEV: it mentions DEV, is a constant, indexes or reads an attribute of something
    on DEV, calls a module function that places on DEV (``to_dev(rope)``), or is a name bound to such an
    expression (in the function, an enclosing one, or the module). ``params``: names accepted as the
    enclosing function's parameters (scalars handed to a kernel, for generic launches only)."""
    if isinstance(expr, ast.Constant) or "DEV" in ast.unparse(expr):
        return True
    if isinstance(expr, (ast.Starred, ast.Subscript, ast.Attribute)):
        return _placed(expr.value, scopes, helpers, params, seen)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in helpers:
        return True
    if isinstance(expr, ast.Name) and expr.id not in seen:
        for scope in scopes:
            if expr.id in scope:
                return any(_placed(v, scopes, helpers, params, (*seen, expr.id)) for v in scope[expr.id])
        return expr.id in params
    return False


def _functions(node, enclosing=()):
    """(function, its enclosing functions innermost first) for every function in ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child, enclosing
            yield from _functions(child, (child, *enclosing))
        else:
            yield from _functions(child, enclosing)


def _own_calls(fn):
    """The calls in ``fn``'s body, not those of functions nested in it."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def kernel_calls(path: pathlib.Path):
    """(line, call text, [unplaced argument texts]) for each kernel call in ``path``."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    module_scope = _bindings(ast.Module(body=[n for n in tree.body if not isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], type_ignores=[]))
    helpers = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and "DEV" in ast.unparse(n)
               and len(n.body) == 1 and isinstance(n.body[0], ast.Return)}  # one-line placement helpers
    found = []
    for fn, enclosing in _functions(tree):
        scopes = [_bindings(f) for f in (fn, *enclosing)] + [module_scope]
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        for call in sorted(_own_calls(fn), key=lambda c: c.lineno):
            name = ast.unparse(call.func)
            args: list[tuple[str, ast.AST]] = []
            generic = False
            if name in LAUNCHERS:
                args = list(zip(LAUNCHERS[name], call.args)) + [(k.arg, k.value) for k in call.keywords]
            elif any(k.arg == "kernel" for k in call.keywords) and name.endswith(".append"):
                store = call.func.value  # KVStore.append(k, v, n_new, kernel=...): the store and the chunk
                args = [("store", store)] + [(f"arg{i}", a) for i, a in enumerate(call.args[:2])]
            elif name in ("run", "common.run") and len(call.args) >= 3 and isinstance(call.args[2], ast.Call):
                args, generic = [(k.arg or "**", k.value) for k in call.args[2].keywords], True
            elif isinstance(call.func, ast.Subscript):  # kernel[grid](...)
                args = [(f"arg{i}", a) for i, a in enumerate(call.args)] + \
                       [(k.arg or "**", k.value) for k in call.keywords]
                generic = True
            else:
                continue
            if "# host:" in "".join(lines[call.lineno - 1:call.end_lineno]):
                continue
            bad = [f"{arg}={ast.unparse(expr)}" for arg, expr in args
                   if arg not in NOT_TENSORS and not arg.isupper()  # constexprs
                   and not _placed(expr, scopes, helpers, params if generic else set())]
            found.append((call.lineno, name, bad))
    return found


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_kernel_arguments_are_on_the_kernels_device(path):
    calls = kernel_calls(path)
    bad = [f"{path.name}:{line} {name}: {', '.join(args)}" for line, name, args in calls if args]
    assert not bad, "tensors handed to a Triton kernel without .to(DEV):\n" + "\n".join(bad)


def test_the_check_finds_the_first_gpu_runs_mistake(tmp_path):
    """The call that failed on the H200, as it was, is reported; moved to DEV, it is not."""
    src = tmp_path / "test_example.py"
    src.write_text(
        "DEV = 'cuda'\n"
        "def test_a():\n"
        "    spec, state = filled(MIXED, [30, 60], 1, 32)\n"
        "    q = torch.randn(2, 2, 1, 32)\n"
        "    full = launch.attention(q, state, spec)\n"
        "    dq, dstate = q.to(DEV), type(state)(*[t.to(DEV) for t in state])\n"
        "    ok = launch.attention(dq, dstate, spec, mask=torch.zeros(1, 1, 1, 37, device=DEV))\n"
        "    got.append(k.to(DEV), v.to(DEV), kernel=launch.store)\n"
        "    kstore.launch_store(state, spec, k, v, n)  # host: on purpose\n")
    calls = kernel_calls(src)
    assert [(line, bad) for line, _, bad in calls] == [
        (5, ["q=q", "state=state"]), (7, []), (8, ["store=got"]), ]


def test_the_launchers_refuse_tensors_on_mixed_devices():
    """At run time: a tensor on another device than the store's is refused before any kernel runs, naming it."""
    spec = LayerSpec(Policy.kivi(4, group=16, residual=4), 1, 16, block_tokens=16)
    state = spec.allocate(1, 32)
    meta = torch.zeros(1, 1, 2, 16, device="meta")
    with pytest.raises(ValueError, match=r"k is on meta, the store on cpu"):
        launch.store(state, spec, meta, torch.zeros(1, 1, 2, 16))
    with pytest.raises(ValueError, match=r"q is on meta, the store on cpu"):
        launch.attention(torch.zeros(1, 2, 1, 16, device="meta"), state, spec)
    with pytest.raises(ValueError, match=r"mask is on meta, the store on cpu"):
        launch.attention(torch.zeros(1, 2, 1, 16), state, spec, mask=torch.ones(1, 1, 1, 4, device="meta"))
    with pytest.raises(ValueError, match=r"state\.table is on meta, the store on cpu"):
        launch.attention(torch.zeros(1, 2, 1, 16), state._replace(table=state.table.to("meta")), spec)
