"""How a user names a kvcompile policy to vLLM (its ``additional_config``), and whether a layer can run it.

    LLM(model=..., additional_config={"kvcompile": {"policy": "int8"}})
    vllm serve MODEL --additional-config '{"kvcompile": {"policy": "policy.json"}}'

``policy`` is a name ``kvcompile.presets.named`` reads (a preset such as ``int8``, ``fp8-r0``, ``tok+rot:4``,
``full``; ``SCHEME:BITS``; a policy file ``*.json`` written by ``Policy.save`` or ``kvcompile calibrate``, read
relative to the directory vLLM was started in) or a policy object in the form ``Policy.to_dict`` writes.
``additional_config`` is part of vLLM's config hash, so two engines with different policies never share compiled
graphs. Nothing named (no ``"kvcompile"`` entry): vLLM runs as it does without kvcompile.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from kvcompile import pages
from kvcompile.errors import ArgumentError, PolicyError, UnsupportedError
from kvcompile.policy import Policy
from kvcompile.presets import named

KEY = "kvcompile"      # the entry of vLLM's additional_config
FIELDS = ("policy",)   # what it may hold
WHERE = 'additional_config["kvcompile"]'


def policy_of(additional_config: Mapping[str, Any] | None) -> Policy | None:
    """The policy named in vLLM's ``additional_config`` (None when there is no ``"kvcompile"`` entry); a
    ``PolicyError`` that says what was found and what is accepted for anything else."""
    if not additional_config or KEY not in additional_config:
        return None
    entry = additional_config[KEY]
    if not isinstance(entry, Mapping) or set(entry) - set(FIELDS) or "policy" not in entry:
        raise PolicyError(f"{WHERE}: found {entry!r}; expected an object with exactly the field 'policy', e.g. "
                          f'{{"kvcompile": {{"policy": "int8"}}}}')
    value = entry["policy"]
    where = f"{WHERE}['policy']"
    if isinstance(value, Policy):  # LLM(..., additional_config={"kvcompile": {"policy": Policy.kivi(4)}})
        return value
    if isinstance(value, Mapping):
        return Policy.from_dict(dict(value), where)
    if not isinstance(value, str):
        raise PolicyError(f"{where}: found {type(value).__name__} {value!r}; expected a policy name (a preset such as "
                          f"'int8', 'tok+rot:4', 'full'), a policy file *.json, a Policy, or its Policy.to_dict()")
    try:
        return named(value)
    except PolicyError as e:
        raise PolicyError(f"{where} = {value!r}: {e}") from None


def as_json(additional_config):
    """vLLM's ``additional_config`` with a ``Policy`` object named in it replaced by its ``Policy.to_dict()`` (the
    same policy, ``policy_of`` reads both): vLLM hashes the config as JSON (``VllmConfig.compute_hash``, when it
    compiles the model), which a Policy object would fail. A new mapping; the caller's is left as it was."""
    entry = additional_config.get(KEY) if isinstance(additional_config, Mapping) else None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("policy"), Policy):
        return additional_config
    return {**additional_config, KEY: {**entry, "policy": entry["policy"].to_dict()}}


def check_engine(vllm_config) -> None:
    """What can be checked before vLLM starts its engine, in the process where the engine's arguments were given:
    the policy named (a ``PolicyError`` for a name that is none) and ``kv_cache_dtype`` (refused beside a
    quantizing policy) -- so ``LLM(...)`` raises the reason itself, where vLLM's engine process would fail with
    "Engine core initialization failed" and the reason in its log. The rest (what each layer computes) is checked
    when the model is built (``layout_for``)."""
    policy = policy_of(vllm_config.additional_config)
    if policy is None or policy == Policy.full():
        return
    check_cache_dtype(vllm_config.cache_config.cache_dtype)
    stages = vllm_config.parallel_config.pipeline_parallel_size
    if stages > 1 and policy.overrides and any(pages.needs_window(p) for p in policy.choices()):
        refuse(f"a per-layer policy whose layers keep window caches (a recent window or KIVI's key groups: {policy}) "
               f"under pipeline_parallel_size={stages}: each stage would size its window pages from its own layers, "
               "and vLLM 0.32 cannot lay out a stage that lacks a kind of window cache another stage has",
               "use one policy for every layer, a per-layer policy without windows (per-token formats), or tensor "
               "parallelism instead of pipeline stages")


def check_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype != "auto":
        refuse(f"kv_cache_dtype={kv_cache_dtype!r} asks vLLM to quantize the cache itself as well",
                "leave kv_cache_dtype at 'auto' with a kvcompile policy (or drop the policy to use vLLM's own)")


def check_cuda_graphs(compilation) -> None:
    """Refuse CUDA graphs that would capture kvcompile's cache write or attention (``compilation``: vLLM's
    ``CompilationConfig`` as the engine runs it). Both read each step's batch on the host, so they run between
    vLLM's piecewise graphs, which its default splits at them; full graphs fall back to piecewise ones where
    vLLM may (``backend.KVCompileBackend.get_builder_cls``), and are refused where vLLM would capture every step
    whole."""
    from vllm.config import CUDAGraphMode

    mode = compilation.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    eager = "or start vLLM with enforce_eager=True (--enforce-eager)"
    if mode.mixed_mode() == CUDAGraphMode.FULL:
        refuse(f"cudagraph_mode={mode.name} captures every step whole in a CUDA graph, and kvcompile's cache write "
               "and attention read each step's batch on the host", f"use vLLM's default or PIECEWISE, {eager}")
    ops = compilation.splitting_ops or ()
    attention, write = "vllm::unified_attention_with_output" in ops, "vllm::unified_kv_cache_update" in ops
    if (attention and not write) or (mode.requires_piecewise_compilation() and not attention):
        refuse(f"vLLM's piecewise CUDA graphs would capture kvcompile's {'cache write' if attention else 'attention'}"
               f" (splitting_ops={compilation.splitting_ops}), which reads each step's batch on the host",
               f"leave splitting_ops and use_inductor_graph_partition at vLLM's defaults, {eager}")


class Refused(UnsupportedError):
    """A named policy vLLM's engine cannot run as asked (raised when the model is built, before serving)."""


def refuse(what: str, fix: str) -> None:
    raise Refused(f"kvcompile ({WHERE}): {what}; {fix}.")


def layout_for(policy: Policy | None, heads: int, head_dim: int, dtype: torch.dtype, block: int,
               *, kv_cache_dtype: str = "auto", sliding_window=None, alibi=False, softcap=0.0, sinks=False,
               kv_sharing=False) -> pages.PageLayout | None:
    """The page layout of one layer for ``policy``, or None for vLLM's own pages and kernels (no policy,
    ``Policy.full()``, or a sliding-window layer ``sliding_unpacked`` says why: ``backend.layer_spec`` sizes its
    pages to the packed ones). Any other sliding-window layer holds its window in the policy's pages. Anything that
    would make the layer compute something other than the policy's attention is refused (``Refused``, or
    ``kvcompile.pages.PageError``), with the reason and what to do instead."""
    if policy is None or policy == Policy.full():
        return None
    if policy.overrides:  # the plugin resolves a per-layer policy first (KVCompileImpl.bind)
        raise ArgumentError(f"layout_for takes one layer's policy; resolve {policy} per layer first")
    check_cache_dtype(kv_cache_dtype)
    for present, what in ((alibi, "ALiBi slopes"), (bool(softcap), "a logit soft-cap"), (sinks, "learned sinks"),
                          (kv_sharing, "a KV cache shared with another layer")):
        if present:
            refuse(f"the model's attention has {what}, which kvcompile's attention does not compute",
                    "use no kvcompile policy for this model")
    # a window or per-channel key groups: their full-precision positions in a window cache (window.py)
    lay = pages.PageLayout(policy, heads, head_dim, dtype, block, window=pages.needs_window(policy))
    if sliding_window not in (None, -1) and sliding_unpacked(lay, sliding_window):
        return None
    return lay


def sliding_unpacked(layout: pages.PageLayout, sliding_window: int) -> str | None:
    """Why a sliding-window layer keeps vLLM's own cache under ``layout``'s policy, or None when it holds its window
    in the policy's pages (``pages.attention_ragged`` / ``attention_windowed``'s ``window``): a window cache that
    keeps as many full-precision positions as the sliding window holds (it would pack positions the window has
    left, into pages vLLM frees)."""
    if pages.packs_sliding_window(layout.policy, sliding_window):
        return None
    return (f"a window cache of {layout.window_tokens} full-precision positions, not fewer than the "
            f"{sliding_window} of the sliding window")
