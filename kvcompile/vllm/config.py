"""How a user names a kvcompile policy to vLLM: its ``additional_config``.

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

from kvcompile.errors import PolicyError
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
    if isinstance(value, Mapping):
        return Policy.from_dict(dict(value), where)
    if not isinstance(value, str):
        raise PolicyError(f"{where}: found {type(value).__name__} {value!r}; expected a policy name (a preset such as "
                          f"'int8', 'tok+rot:4', 'full'), a policy file *.json, or a policy object (Policy.to_dict)")
    try:
        return named(value)
    except PolicyError as e:
        raise PolicyError(f"{where} = {value!r}: {e}") from None
