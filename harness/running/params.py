"""Typed exp.params: each experiment kind declares a dataclass, so a misspelled or mistyped knob fails in one line.

Every kind's Params extends GridParams (the runner's knobs: a shared budget, overrides of the grid's systems and
tasks); accuracy kinds extend harness.experiments.accuracy.params.AccuracyParams. `parse` merges cfg.exp.params onto
the dataclass: unknown keys are rejected with the valid ones listed, values are type-checked, and the result is a
plain dataclass instance.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ParamsError(ValueError):
    """A bad exp.params value; the message names the key to fix."""


@dataclass
class GridParams:
    budget: Optional[int] = None                               # shared token budget of every budgeted policy
    system_overrides: dict[str, Any] = field(default_factory=dict)   # merged into every system of the grid
    task_overrides: dict[str, Any] = field(default_factory=dict)     # merged into every task of the grid


T = TypeVar("T")


def parse(cfg: DictConfig, schema: type[T]) -> T:
    """cfg.exp.params as an instance of `schema` (a dataclass); ParamsError names the bad key."""
    raw = OmegaConf.to_container(cfg.exp.params, resolve=True) if cfg.exp.get("params") is not None else {}
    valid = sorted(f.name for f in dataclasses.fields(schema))       # type: ignore[arg-type]  # a dataclass type
    unknown = sorted(set(raw or {}) - set(valid))
    if unknown:
        raise ParamsError(f"exp.params: unknown key(s) {unknown} for exp.kind={cfg.exp.kind}; valid: {valid}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        out = OmegaConf.to_object(merged)
        assert isinstance(out, schema)
        return out
    except OmegaConfBaseException as exc:
        first = str(exc).strip().splitlines()[0]
        raise ParamsError(f"exp.params: {first}") from None
