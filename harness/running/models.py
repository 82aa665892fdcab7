"""The models axis: one experiment's grid run on each model of exp.models, then one report across them.

`exp.models` lists models as conf/model names (`[smollm2, gemma3_270m]`: that file, with the run's model.dtype) or
as mappings (the run's model with those fields replaced, e.g. `{name: tiny, path: /models/tiny}`). Each model is an
ordinary run of the experiment in its own folder, `<results>/<exp>/<model name>/` (its cells, and its own summary),
driven by the one driver loop (harness.running.driver.run_models); the experiment's `report_models` then writes
the summary across models into `<results>/<exp>/`. A system whose policy has no profile made on a model
(Policy.missing_profile) is left out on that model, and every summary says so with the command that makes the
profile: the other systems still run, and a comparison across models covers the systems every model ran.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.running.config import UserError, load_group, plain
from harness.running.grid import system_config
from harness.running.schema import ModelConfig
from systems.policies import policy_class
from systems.registry import backend_of


@dataclass
class ModelRun:
    """One model of the axis: its config, and the systems left out on it for lack of a profile (why)."""

    cfg: DictConfig
    left_out: dict[str, str]

    @property
    def name(self) -> str:
        return str(self.cfg.model.name)


def has_models(cfg: DictConfig) -> bool:
    return bool(cfg.exp.get("models"))


def model_config(cfg: DictConfig, entry: Any) -> DictConfig:
    """The run's model replaced by one entry of exp.models (see the module docstring)."""
    if isinstance(entry, str):
        model = load_group("model", entry, ModelConfig)
        model.dtype = cfg.model.dtype                    # a run setting: every model of the axis runs in it
        return model
    if isinstance(entry, (dict, DictConfig)):
        node = OmegaConf.merge(cfg.model, entry)        # schema-typed: a misspelled field fails here
        assert isinstance(node, DictConfig)
        return node
    raise UserError(f"exp.models entry {entry!r}: give a conf/model name or a mapping of model fields")


def folder_name(model_name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "-" for c in model_name)


def model_runs(cfg: DictConfig) -> list[ModelRun]:
    """One config per model of exp.models: that model, results in `<exp>/<model name>`, its unprofiled systems
    dropped from exp.systems (an explicit system list only: the default system is kept and fails in one line)."""
    entries = list(cfg.exp.models)
    out: list[ModelRun] = []
    for entry in entries:
        sub = copy.deepcopy(cfg)
        sub.model = model_config(cfg, entry)
        name = str(sub.model.name)
        sub.exp.name = f"{cfg.exp.name}/{folder_name(name)}"
        left_out = {s: why for s in sub.exp.systems if (why := missing_profile(s, name))}
        sub.exp.systems = [s for s in sub.exp.systems if s not in left_out]
        out.append(ModelRun(sub, left_out))
    names = [r.name for r in out]
    if len(set(map(folder_name, names))) < len(names):
        raise UserError(f"exp.models names the same model twice ({names}); give each model once")
    return out


def missing_profile(system_name: str, model: str) -> str | None:
    """Why a system cannot run on `model` for lack of a profile (its policy answers), or None."""
    system = system_config(system_name)
    cls = policy_class(system.policy) if backend_of(system).runs_policies else None
    return cls.missing_profile(plain(system.params), model) if cls is not None else None


def left_out_note(runs: list[ModelRun]) -> str | None:
    """The sentence every summary of the axis carries about systems left out on a model."""
    parts = [f"{s} on {r.name} ({why})" for r in runs for s, why in r.left_out.items()]
    return ("Left out for lack of a profile made on that model (a profile is never borrowed from another model): "
            + "; ".join(parts) + ".") if parts else None
