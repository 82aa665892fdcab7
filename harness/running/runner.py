"""Resolve an experiment into its grid of cells, validate every cell cheaply, then hand it to its experiment kind."""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.integrations.assets import AssetError
from harness.running.schema import SystemConfig, TaskConfig
from systems.registry import SystemConfigError, check_dims, check_system, policy_class
from tasks.base import TaskError, load_task

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


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
class GridCell:
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
    for cur, base, _tag in ((system, sys_default, "sys"), (task, task_default, "task")):
        a, b = _flat(OmegaConf.to_container(cur)), _flat(OmegaConf.to_container(base))
        diffs += [f"{k.split('.')[-1]}={a[k]}" for k in sorted(a) if k != "name" and a[k] != b.get(k)]
    key = f"{system.name}__{task.name}"
    if diffs:
        key += "__" + ",".join(diffs)
    return "".join(c if c.isalnum() or c in "-_=.,+" else "-" for c in key)[:180]


def kind_defaults(kind: str) -> dict | None:
    """An experiment kind's SYSTEM_DEFAULTS (e.g. batch-invariant decoding for accuracy kinds), if it has any."""
    if not kind.isidentifier() or importlib.util.find_spec(f"harness.experiments.{kind}") is None:
        return None
    return getattr(importlib.import_module(f"harness.experiments.{kind}"), "SYSTEM_DEFAULTS", None)


def resolve_cells(cfg: DictConfig) -> list[GridCell]:
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
            cells.append(GridCell(system, t, key))
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
    """The policy's rule for evaluating a task (FlexiCache: never with a profile made on that task)."""
    policy = policy_class(system.policy) if system.backend == "engine" else None
    if policy is not None:
        params = OmegaConf.to_container(system.params, resolve=True)
        system.params = policy.with_heldout_task(params, task_name)


def apply_budget(system: DictConfig, budget: int) -> None:
    """A shared budget (tokens) for every engine policy that has one, mapped by the policy; dense systems are left as
    they are."""
    policy = policy_class(system.policy) if system.backend == "engine" else None
    if policy is not None and policy.has_budget():        # an unknown policy is reported by check_system
        system.params = policy.with_budget(OmegaConf.to_container(system.params, resolve=True), budget)


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
    """Budget semantics every policy shares: positive and within the context (each policy checks the rest against
    the engine's page size when it is configured)."""
    params = system.params
    if "budget" not in params or params["budget"] is None:
        return
    budget = params["budget"]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise UserError(f"system {system.name!r}: params.budget must be a positive integer (tokens), got {budget!r}")
    if budget > model.max_model_len:
        raise UserError(f"system {system.name!r}: params.budget={budget} exceeds the context "
                        f"(model.max_model_len={model.max_model_len}); lower the budget")



def experiment_module(kind: str):
    """harness.experiments.<kind>, or a one-line error listing the kinds."""
    if not kind.isidentifier() or importlib.util.find_spec(f"harness.experiments.{kind}") is None:
        kinds = sorted(p.stem for p in (Path(__file__).parents[1] / "experiments").glob("[a-z]*.py"))
        raise UserError(f"unknown exp.kind {kind!r}; choose one of {kinds} (harness/experiments/)")
    return importlib.import_module(f"harness.experiments.{kind}")


def validate(cfg: DictConfig, cells: list[GridCell]) -> None:
    """Everything checkable without loading a model, so a typo costs a second, not an hour."""
    from harness.running import params

    check_no_extra_keys(cfg)
    check_dtype(cfg)
    try:
        params.parse(cfg, params.schema_of(experiment_module(cfg.exp.kind)))
    except params.ParamsError as exc:
        raise UserError(str(exc)) from None
    if not cells:
        raise UserError("the experiment has no cells: set exp.systems and exp.tasks")
    from harness.integrations.assets import known_model_dir

    model_folder = known_model_dir(cfg.model.path)      # dims without preparing: a missing model is checked later
    for cell in cells:
        check_budget(cell.system, cfg.model)
        check_system(cell.system)
        if model_folder is not None:
            check_dims(cell.system, model_folder, cfg.model.max_model_len)
        t = cell.task
        load_task(t.family, t.name, OmegaConf.to_container(t.params), seed=cfg.seed, limit=t.limit,
                  fraction=t.fraction)
    if cfg.model.max_input_tokens <= 0 or cfg.model.max_input_tokens >= cfg.model.max_model_len:
        raise UserError(f"model.max_input_tokens={cfg.model.max_input_tokens} must be in (0, model.max_model_len="
                        f"{cfg.model.max_model_len})")


def check_dtype(cfg: DictConfig) -> None:
    from systems.hardware import DTYPE_CHOICES

    if cfg.model.dtype not in DTYPE_CHOICES and cfg.model.dtype not in ("bf16", "fp16", "fp32"):
        raise UserError(f"model.dtype={cfg.model.dtype!r} is not supported; use one of {list(DTYPE_CHOICES)}")


def pin_dtype(cfg: DictConfig) -> None:
    """`auto` never reaches a result: it becomes the dtype it means on this machine before any cell is keyed."""
    from systems.hardware import dtype_name

    check_dtype(cfg)
    cfg.model.dtype = dtype_name(cfg.model.dtype)


def check_writable(out_dir: Path) -> None:
    """The results folder can be written, checked before any model loads (a probe file, removed at once)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"results_dir={out_dir.parent} is not writable ({exc.strerror or exc}); set results_dir to "
                        "a folder you can write") from None


LEVELS = ("debug", "info", "warning", "error")


def quiet_libraries(level: str) -> None:
    """Libraries log at `level` and above (vLLM reads its level from the environment, also in the processes it
    spawns); a value the user already exported wins."""
    import logging

    if level.lower() not in LEVELS:
        raise UserError(f"library_log_level={level!r}: use one of {list(LEVELS)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level.upper())
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", {"debug": "INFO", "info": "INFO"}.get(level.lower(),
                                                                                           level.upper()))
    for name in ("transformers", "vllm", "datasets", "huggingface_hub", "urllib3"):
        logging.getLogger(name).setLevel(level.upper())
    import transformers

    transformers.logging.set_verbosity({"debug": 10, "info": 20, "warning": 30, "error": 40}[level.lower()])


def run(cfg: DictConfig) -> Any:
    try:
        quiet_libraries(cfg.get("library_log_level", "error"))
        pin_dtype(cfg)
        experiment = experiment_module(cfg.exp.kind)
        cells = resolve_cells(cfg)
        validate(cfg, cells)
        out_dir = Path(cfg.results_dir) / cfg.exp.name
        check_writable(out_dir)
        return experiment.run(cfg, cells, out_dir)
    except USER_ERRORS as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) from exc


def dump_yaml(node: DictConfig) -> str:
    return OmegaConf.to_yaml(node, resolve=True)


def jsonable(node: DictConfig) -> Any:
    return json.loads(json.dumps(OmegaConf.to_container(node, resolve=True), default=str))
