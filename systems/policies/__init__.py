"""KV policies, one module per method, each exposing POLICY (a Policy dataclass); find and load them by name.

A name resolves to `systems/policies/<name>.py` first, else to an installed package's entry point in the group
`kvharness.policies` (`name = "package.module:PolicyClass"`, or a module exposing POLICY): an out-of-tree policy is
one module and one entry point, without touching this tree.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path
from typing import Any

from systems.policies.base import Policy

ENTRY_POINTS = "kvharness.policies"


def _as_policy(obj: Any) -> type[Policy] | None:
    cls = getattr(obj, "POLICY", obj)
    return cls if isinstance(cls, type) and issubclass(cls, Policy) else None


def _entry_point(name: str) -> importlib.metadata.EntryPoint | None:
    return next((ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS) if ep.name == name), None)


def policy_class(name: str) -> type[Policy] | None:
    """The Policy class a name stands for (in-tree module, then installed entry point), or None when there is none."""
    if not name.isidentifier():
        return None
    try:
        module = importlib.import_module(f"systems.policies.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"systems.policies.{name}":
            raise
    else:
        return _as_policy(module)
    ep = _entry_point(name)
    return _as_policy(ep.load()) if ep is not None else None


def policy_names() -> list[str]:
    """Every policy: the modules of systems/policies exposing POLICY and the installed entry points."""
    here = [p.stem for p in Path(__file__).parent.glob("[a-z]*.py") if policy_class(p.stem) is not None]
    return sorted({*here, *(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINTS))})


def load_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    """Instantiate the named policy from its hyperparameters (one-line errors on bad input)."""
    if not name.isidentifier():
        raise ValueError(f"policy name '{name}' is not a module name; use e.g. 'dense'")
    cls = policy_class(name)
    if cls is None:
        raise ValueError(f"unknown policy '{name}': add systems/policies/{name}.py exposing POLICY, or install a "
                         f"package with a `{ENTRY_POINTS}` entry point named {name!r}")
    return cls.from_params(params)
