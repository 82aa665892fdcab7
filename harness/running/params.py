"""Typed exp.params: each experiment kind declares a dataclass, so a misspelled or mistyped knob fails in one line.

Every kind's Params extends GridParams (the runner's knobs: a shared budget, overrides of the grid's systems and
tasks); accuracy kinds extend AccuracyParams. `parse` merges cfg.exp.params onto the dataclass: unknown keys are
rejected with the valid ones listed, values are type-checked, and the result is a plain dataclass instance.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ParamsError(ValueError):
    """A bad exp.params value; the message names the key to fix."""


@dataclass
class GridParams:
    budget: Optional[int] = None                               # shared token budget of every budgeted policy
    system_overrides: dict[str, Any] = field(default_factory=dict)   # merged into every system of the grid
    task_overrides: dict[str, Any] = field(default_factory=dict)     # merged into every task of the grid


@dataclass
class AccuracyParams(GridParams):
    reference: Optional[str] = None            # system label retention and fidelity compare with (engine-dense)
    min_reference_score: float = 5.0           # units whose reference is less above chance are left out of averages
    fidelity: Any = True                       # false | true | {steps, gold}: teacher-forced fidelity settings
    task_params: dict[str, Any] = field(default_factory=dict)   # {task name: {param: value}} per-task overrides
    budgets: Optional[list[int]] = None        # run every budgeted policy at each budget (`system@budget`)
    size_reason: str = ""                      # why the committed grid is this size (printed in the summary)
    budget_reason: str = ""


def parse(cfg: DictConfig, schema: type) -> Any:
    """cfg.exp.params as an instance of `schema` (a dataclass); ParamsError names the bad key."""
    raw = OmegaConf.to_container(cfg.exp.params, resolve=True) if cfg.exp.get("params") is not None else {}
    valid = sorted(f.name for f in dataclasses.fields(schema))
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ParamsError(f"exp.params: unknown key(s) {unknown} for exp.kind={cfg.exp.kind}; valid: {valid}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        first = str(exc).strip().splitlines()[0]
        raise ParamsError(f"exp.params: {first}") from None


def schema_of(module) -> type:
    """The kind's Params dataclass (GridParams when it declares none)."""
    return getattr(module, "Params", GridParams)
