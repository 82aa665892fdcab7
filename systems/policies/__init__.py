"""KV policies, one module per method, each exposing POLICY (a Policy dataclass); load them with `load_policy`."""
from __future__ import annotations

import importlib
from typing import Any

from systems.policies.base import Policy


def load_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    """Instantiate systems.policies.<name>.POLICY from its hyperparameters (one-line errors on bad input)."""
    if not name.isidentifier():
        raise ValueError(f"policy name '{name}' is not a module name; use e.g. 'dense'")
    try:
        module = importlib.import_module(f"systems.policies.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"systems.policies.{name}":
            raise
        raise ValueError(f"unknown policy '{name}': add systems/policies/{name}.py exposing POLICY") from None
    cls = getattr(module, "POLICY", None)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"systems/policies/{name}.py must expose POLICY, a subclass of systems.policies.base.Policy")
    return cls.from_params(params)
