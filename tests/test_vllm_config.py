"""The vLLM plugin's parts that need no vLLM (``kvcompile.vllm.config``): how a policy is named in vLLM's
``additional_config``, what a layer refuses and why, and that the plugin builds on the core alone. The plugin in
vLLM's engine is tested in ``tests_vllm/`` (an environment with vLLM's CPU build: ``.ci/run``)."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvcompile import Policy, Quant
from kvcompile import pages as P
from kvcompile.errors import KVCompileError, PolicyError, UnsupportedError
from kvcompile.vllm.config import Refused, layout_for, policy_of, sliding_unpacked

ROOT = Path(__file__).resolve().parents[1]


def test_nothing_named_is_no_policy():
    assert policy_of(None) is None and policy_of({}) is None and policy_of({"other_plugin": 1}) is None


@pytest.mark.parametrize("name,want", [
    ("int8", Policy.int8()),
    ("tok+rot:4", Policy(Quant("int4"), Quant("int4"), rotate=True)),
    ("fp8-r0", Policy.fp8(residual=0)),
    ("full", Policy.full()),
    ("kivi4", Policy.kivi(4)),  # named fine; whether pages can hold it is the layout's question
])
def test_a_preset_by_name(name, want):
    assert policy_of({"kvcompile": {"policy": name}}) == want


def test_a_policy_file_and_a_policy_object(tmp_path):
    pol = Policy(Quant("int2", "token", 32), Quant("int4"), rotate=True)
    path = pol.save(tmp_path / "policy.json")
    assert policy_of({"kvcompile": {"policy": str(path)}}) == pol
    assert policy_of({"kvcompile": {"policy": pol.to_dict()}}) == pol
    assert policy_of({"kvcompile": {"policy": pol}}) is pol  # the Policy itself, as a Python user passes it
    assert policy_of(json.loads(json.dumps({"kvcompile": {"policy": pol.to_dict()}}))) == pol  # as --additional-config


@pytest.mark.parametrize("entry,found", [
    ("int8", "expected an object with exactly the field 'policy'"),
    ({"policy": "int8", "budget": 3}, "exactly the field 'policy'"),
    ({"polcy": "int8"}, "exactly the field 'policy'"),
    ({"policy": 8}, "expected a policy name"),
    ({"policy": "kivi"}, "'kivi' needs a width"),
    ({"policy": "int9"}, "expected SCHEME:BITS"),
    ({"policy": "missing.json"}, "no such file"),
    ({"policy": {"key": {"format": "int8"}}}, "file format version"),
])
def test_a_bad_entry_says_what_was_found_and_what_is_accepted(entry, found):
    with pytest.raises(PolicyError, match="additional_config") as e:
        policy_of({"kvcompile": entry})
    assert found in str(e.value) and isinstance(e.value, KVCompileError)


def test_full_and_no_policy_are_vllms_own_pages():
    assert layout_for(None, 2, 64, torch.bfloat16, 128) is None
    assert layout_for(Policy.full(), 2, 64, torch.bfloat16, 128, kv_cache_dtype="fp8") is None


def test_a_sliding_window_layer_gets_packed_pages_unless_its_window_cache_cannot_serve_it():
    # its window in the policy's pages (read through the window: tests_vllm), KIVI's with a window cache
    lay = layout_for(Policy.int8(), 2, 64, torch.bfloat16, 128, sliding_window=4096)
    assert lay == P.PageLayout(Policy.int8(), 2, 64, "bfloat16", 128)
    kivi = layout_for(Policy.kivi(4), 2, 64, torch.bfloat16, 128, sliding_window=4096)
    assert kivi == P.PageLayout(Policy.kivi(4), 2, 64, "bfloat16", 128, window=True) and kivi.window_tokens == 159
    sinks = Policy.kivi(4, sink=4, rotate=True)  # in the first page, which vLLM frees once they left every window
    assert layout_for(sinks, 2, 64, torch.bfloat16, 128, sliding_window=4096).policy == sinks
    # vLLM's own cache: a window cache as long as the sliding window
    assert layout_for(Policy.kivi(4), 2, 64, torch.bfloat16, 128, sliding_window=159) is None
    assert "159 full-precision positions, not fewer than the 159" in sliding_unpacked(kivi, 159)
    assert sliding_unpacked(kivi, 160) is None and sliding_unpacked(lay, 16) is None
    with pytest.raises(Refused, match="kv_cache_dtype='fp8'"):  # vLLM's own quantization still refused
        layout_for(Policy.int8(), 2, 64, torch.bfloat16, 128, sliding_window=4096, kv_cache_dtype="fp8")
    with pytest.raises(Refused, match="soft-cap"):  # what the layer computes is still checked
        layout_for(Policy.int8(), 2, 64, torch.bfloat16, 128, sliding_window=4096, softcap=30.0)


def test_a_quantizing_policy_gets_its_pages():
    lay = layout_for(Policy.int8(), 2, 64, torch.bfloat16, 128)
    assert lay == P.PageLayout(Policy.int8(), 2, 64, "bfloat16", 128)


@pytest.mark.parametrize("kw,what", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
    (dict(alibi=True), "ALiBi"),
    (dict(softcap=30.0), "soft-cap"),
    (dict(sinks=True), "learned sinks"),
    (dict(kv_sharing=True), "shared with another layer"),
])
def test_what_a_layer_cannot_run_is_refused_with_the_reason(kw, what):
    with pytest.raises(Refused, match=what) as e:
        layout_for(Policy.int8(), 2, 64, torch.bfloat16, 128, **kw)
    assert isinstance(e.value, UnsupportedError) and "additional_config" in str(e.value)


@pytest.mark.parametrize("name,block,kind", [
    ("kivi+rot+sink:4", 256, P.Refusal.SINKS),  # its packed tokens would wait 252 tokens; its window is 128
    ("tok+rot+sink:4", 128, P.Refusal.SINKS),   # no window for them to wait in
])
def test_presets_pages_cannot_hold_are_refused(name, block, kind):
    with pytest.raises(P.PageError) as e:
        layout_for(policy_of({"kvcompile": {"policy": name}}), 2, 64, torch.bfloat16, block)
    assert e.value.kind is kind


@pytest.mark.parametrize("name", ["kivi:4", "kivi+rot:2", "kivi-g16:4", "fp8", "kivi+rot+sink:4", "kivi+sink:2",
                                  "fp8+rot+sink:8"])
def test_a_window_or_key_groups_get_a_window_cache(name):
    policy = policy_of({"kvcompile": {"policy": name}})
    lay = layout_for(policy, 2, 64, torch.bfloat16, 128)
    assert lay.window and lay.window_tokens == policy.residual + policy.flush - 1 > 0
    assert not layout_for(Policy.int8(), 2, 64, torch.bfloat16, 128).window  # per-token, no window: pages alone


def test_a_layout_is_one_layers():
    # a per-layer policy is resolved per layer by the plugin (KVCompileImpl.bind) before it asks for a layout
    with pytest.raises(KVCompileError, match="one layer's policy; resolve"):
        layout_for(Policy.int8().override({0: Policy(Quant("int4"), Quant("int4"))}), 2, 64, torch.float32, 128)


# --------------------------------------------------------------------------- the import graph
CORE = {"kvcompile", "kvcompile.errors", "kvcompile.policy", "kvcompile.presets", "kvcompile.pages", "kvcompile.store",
        "kvcompile.quant", "kvcompile.ops", "kvcompile.standin", "kvcompile.cachedir", "kvcompile.templates",
        "kvcompile.templates.cpu",
        "kvcompile.templates.cpu_store", "kvcompile.templates.common", "kvcompile.templates.launch",
        "kvcompile.templates.attention", "kvcompile.templates.decode", "kvcompile.templates.store",
        "kvcompile.templates.inductor", "kvcompile.templates.cpu_rotate", "kvcompile.templates.rotate",
        "kvcompile.templates.prefill", "kvcompile.templates.past"}


def _imports(path: Path, package: str) -> set[str]:
    """The kvcompile modules ``path`` imports, anywhere in it (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvcompile")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("kvcompile"):
                out.add(base)
                if _is_package(base):  # `from kvcompile import pages`: a module too
                    out |= {f"{base}.{a.name}" for a in node.names if importlib.util.find_spec(f"{base}.{a.name}")}
    return out


def _is_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def test_the_plugin_builds_on_the_core_alone():
    """The plugin imports only kvcompile's core (policy, presets, pages, store, quant, ops, kernels, errors), and
    the core modules it reaches import nothing else of kvcompile: never the transformers integration or serving
    (hf, hf_model, serving, serve, evaluate, cli)."""
    seen, todo = set(), []
    for f in sorted((ROOT / "kvcompile" / "vllm").glob("*.py")):
        todo += [m for m in _imports(f, "kvcompile.vllm") if not m.startswith("kvcompile.vllm")]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        assert mod in CORE, f"the vLLM plugin reaches {mod}, which is not part of kvcompile's core"
        spec = importlib.util.find_spec(mod)
        if mod != "kvcompile" and spec.origin and spec.origin.endswith(".py"):
            pkg = mod if _is_package(mod) else mod.rpartition(".")[0]
            todo += list(_imports(Path(spec.origin), pkg))
    assert {"kvcompile.pages", "kvcompile.presets", "kvcompile.ops"} <= seen


def test_a_policy_object_becomes_its_dict_for_vllms_json_hash():
    from kvcompile.vllm.config import as_json
    policy = Policy.kivi(4, sink=4, rotate=True)
    given = {"kvcompile": {"policy": policy}, "other": 1}
    got = as_json(given)
    assert json.loads(json.dumps(got, sort_keys=True)) == {"kvcompile": {"policy": policy.to_dict()}, "other": 1}
    assert policy_of(got) == policy and given["kvcompile"]["policy"] is policy  # the caller's dict as it was
    for same in (None, {}, {"other": 1}, {"kvcompile": {"policy": "int8"}}, {"kvcompile": "int8"}):
        assert as_json(same) is same
