"""Resolve an experiment into its grid of cells, validate every cell cheaply, then hand it to its experiment kind."""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.assets import AssetError
from harness.schema import SystemConfig, TaskConfig
from systems.registry import SystemConfigError, check_system
from tasks.base import TaskError, load_task

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class UserError(Exception):
    """Anything the user can fix by changing the command line or the config."""


USER_ERRORS = (TaskError, SystemConfigError, AssetError, OmegaConfBaseException, UserError)


def load_group(group: str, name: str, schema: type) -> DictConfig:
    """conf/<group>/<name>.yaml merged onto its schema (typos and wrong types fail here)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise UserError(f"unknown {group} {name!r}; choose one of {choices} (files in conf/{group}/)")
    return OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path))


@dataclass
class Cell:
    """One (system, task) pair of an experiment, with the fully resolved config that makes it."""

    system: DictConfig
    task: DictConfig
    key: str

    def resolved(self, cfg: DictConfig) -> DictConfig:
        return OmegaConf.create({"model": cfg.model, "system": self.system, "task": self.task, "exp": cfg.exp,
                                 "seed": cfg.seed})


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def cell_key(system: DictConfig, task: DictConfig, sys_default: DictConfig, task_default: DictConfig) -> str:
    """`<system>__<task>` plus the values that differ from the group files' defaults."""
    diffs = []
    for cur, base, tag in ((system, sys_default, "sys"), (task, task_default, "task")):
        a, b = _flat(OmegaConf.to_container(cur)), _flat(OmegaConf.to_container(base))
        diffs += [f"{k.split('.')[-1]}={a[k]}" for k in sorted(a) if k != "name" and a[k] != b.get(k)]
    key = f"{system.name}__{task.name}"
    if diffs:
        key += "__" + ",".join(diffs)
    return "".join(c if c.isalnum() or c in "-_=.,+" else "-" for c in key)[:180]


def kind_defaults(kind: str) -> dict | None:
    """An experiment kind's SYSTEM_DEFAULTS (e.g. batch-invariant decoding for accuracy kinds), if it has any."""
    if importlib.util.find_spec(f"harness.experiments.{kind}") is None:
        return None
    return getattr(importlib.import_module(f"harness.experiments.{kind}"), "SYSTEM_DEFAULTS", None)


def resolve_cells(cfg: DictConfig) -> list[Cell]:
    """The experiment's system × task grid. The kind's SYSTEM_DEFAULTS replace values still at the schema's default
    on every engine system; exp.params.system_overrides come after them and can set anything."""
    system_defaults = kind_defaults(cfg.exp.kind)
    hydra_choice = _hydra_choices()
    systems = ([(load_group("system", n, SystemConfig), load_group("system", n, SystemConfig))
                for n in cfg.exp.systems] or
               [(cfg.system, _default_or_self("system", hydra_choice.get("system"), SystemConfig, cfg.system))])
    tasks = ([(load_group("task", n, TaskConfig), load_group("task", n, TaskConfig)) for n in cfg.exp.tasks] or
             [(cfg.task, _default_or_self("task", hydra_choice.get("task"), TaskConfig, cfg.task))])
    if system_defaults:
        for cur, _ in systems:
            if cur.backend == "engine":
                apply_defaults(cur, system_defaults)
    for overrides_key, items in (("system_overrides", systems), ("task_overrides", tasks)):
        extra = cfg.exp.params.get(overrides_key)
        if extra:
            for cur, _ in items:
                cur.merge_with(extra)  # schema-typed: a bad key fails here
    budget = cfg.exp.params.get("budget")
    if budget is not None:
        for cur, _ in systems:
            apply_budget(cur, budget)
    cells = []
    for s, sd in systems:
        for t, td in tasks:
            system = copy.deepcopy(s)
            key = cell_key(system, t, sd, td)  # the held-out task is the cell's own task: already in the key
            hold_out(system, t.name)
            cells.append(Cell(system, t, key))
    return cells


def apply_defaults(node: DictConfig, defaults: dict, schema: Any = None) -> None:
    """Set each key of `defaults` (nested) where `node` still holds its schema default."""
    schema = schema if schema is not None else OmegaConf.structured(SystemConfig)
    for key, value in defaults.items():
        if isinstance(value, dict):
            apply_defaults(node[key], value, schema[key])
        elif node[key] == schema[key]:
            node[key] = value


def hold_out(system: DictConfig, task_name: str) -> None:
    """Leave-one-out for profiled policies: a task is never evaluated with a profile made on itself."""
    if system.backend != "engine":
        return
    try:
        policy = importlib.import_module(f"systems.policies.{system.policy}").POLICY
    except (ModuleNotFoundError, AttributeError):
        return
    if "heldout_task" in {f.name for f in dataclasses.fields(policy)} and system.params.get("heldout_task") is None:
        system.params["heldout_task"] = task_name


def apply_budget(system: DictConfig, budget: int) -> None:
    """A shared budget (tokens) for every engine policy that has one; dense systems are left as they are."""
    if system.backend != "engine":
        return
    try:
        policy = importlib.import_module(f"systems.policies.{system.policy}").POLICY
    except (ModuleNotFoundError, AttributeError):
        return  # check_system reports the unknown policy
    fields = {f.name for f in dataclasses.fields(policy)}
    if "budget" in fields:
        system.params["budget"] = budget
        if "recent_size" in fields:
            system.params["recent_size"] = None  # H2O: heavy and recent halves of the shared budget


def _default_or_self(group: str, choice: str | None, schema: type, current: DictConfig) -> DictConfig:
    """The pristine group file behind `current` (by Hydra's choice, else by matching name), for cell keys."""
    if choice and (CONF_DIR / group / f"{choice}.yaml").is_file():
        return load_group(group, choice, schema)
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        if OmegaConf.load(path).get("name") == current.name:
            return load_group(group, path.stem, schema)
    return current


def _hydra_choices() -> dict:
    try:
        from hydra.core.hydra_config import HydraConfig
        return dict(HydraConfig.get().runtime.choices)
    except (ValueError, ImportError):
        return {}


def check_no_extra_keys(node: Any, path: str = "") -> None:
    """`+key=value` slips past Hydra's struct mode; a key no schema declares is still a typo."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        fields = {f.name for f in dataclasses.fields(schema)}
        extra = sorted(set(node.keys()) - fields)
        if extra:
            raise UserError(f"unknown key(s) {[f'{path}{k}' for k in extra]}; valid under "
                            f"{path.rstrip('.') or 'the root'}: {sorted(fields)}")
        for k in fields:
            if k in node and k != "params" and not path.endswith("hydra."):
                check_no_extra_keys(node._get_node(k), f"{path}{k}.")


def check_budget(system: DictConfig, model: DictConfig) -> None:
    """Budget semantics every policy shares: positive, within the context, whole pages where pages are the unit."""
    params = system.params
    if "budget" not in params or params["budget"] is None:
        return
    budget = params["budget"]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise UserError(f"system {system.name!r}: params.budget must be a positive integer (tokens), got {budget!r}")
    if budget > model.max_model_len:
        raise UserError(f"system {system.name!r}: params.budget={budget} exceeds the context "
                        f"(model.max_model_len={model.max_model_len}); lower the budget")
    page = params.get("page_size")
    if page is not None:
        if page != system.engine.page_size:
            raise UserError(f"system {system.name!r}: params.page_size={page} but engine.page_size="
                            f"{system.engine.page_size}; set them equal")
        if budget % page:
            raise UserError(f"system {system.name!r}: page_size={page} does not divide budget={budget}; use a budget "
                            f"that is a multiple of {page} (e.g. {budget - budget % page or page})")


def validate(cfg: DictConfig, cells: list[Cell]) -> None:
    """Everything checkable without loading a model, so a typo costs a second, not an hour."""
    check_no_extra_keys(cfg)
    if importlib.util.find_spec(f"harness.experiments.{cfg.exp.kind}") is None:
        kinds = sorted(p.stem for p in (Path(__file__).parent / "experiments").glob("[a-z]*.py"))
        raise UserError(f"unknown exp.kind {cfg.exp.kind!r}; choose one of {kinds} (harness/experiments/)")
    if not cells:
        raise UserError("the experiment has no cells: set exp.systems and exp.tasks")
    for cell in cells:
        check_budget(cell.system, cfg.model)
        check_system(cell.system)
        t = cell.task
        load_task(t.family, t.name, OmegaConf.to_container(t.params), seed=cfg.seed, limit=t.limit,
                  fraction=t.fraction)
    if cfg.model.max_input_tokens <= 0 or cfg.model.max_input_tokens >= cfg.model.max_model_len:
        raise UserError(f"model.max_input_tokens={cfg.model.max_input_tokens} must be in (0, model.max_model_len="
                        f"{cfg.model.max_model_len})")


def pin_dtype(cfg: DictConfig) -> None:
    """`auto` never reaches a result: it becomes the dtype it means on this machine before any cell is keyed."""
    from systems.hardware import DTYPE_CHOICES, dtype_name

    if cfg.model.dtype not in DTYPE_CHOICES and cfg.model.dtype not in ("bf16", "fp16", "fp32"):
        raise UserError(f"model.dtype={cfg.model.dtype!r} is not supported; use one of {list(DTYPE_CHOICES)}")
    cfg.model.dtype = dtype_name(cfg.model.dtype)


def run(cfg: DictConfig) -> Any:
    try:
        pin_dtype(cfg)
        if importlib.util.find_spec(f"harness.experiments.{cfg.exp.kind}") is None:
            kinds = sorted(p.stem for p in (Path(__file__).parent / "experiments").glob("[a-z]*.py"))
            raise UserError(f"unknown exp.kind {cfg.exp.kind!r}; choose one of {kinds} (harness/experiments/)")
        experiment = importlib.import_module(f"harness.experiments.{cfg.exp.kind}")
        cells = resolve_cells(cfg)
        validate(cfg, cells)
        out_dir = Path(cfg.results_dir) / cfg.exp.name
        return experiment.run(cfg, cells, out_dir)
    except USER_ERRORS as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) from exc


def dump_yaml(node: DictConfig) -> str:
    return OmegaConf.to_yaml(node, resolve=True)


def jsonable(node: DictConfig) -> Any:
    return json.loads(json.dumps(OmegaConf.to_container(node, resolve=True), default=str))
