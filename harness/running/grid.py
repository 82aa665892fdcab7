"""The grid: the experiment's systems × tasks as cells keyed by what makes them, shared budgets, checks before work.

A cell's key is `<system>__<task>` plus every value that differs from the group files (so a cell's folder says what
made it). Budgets are mapped by each policy (Policy.with_budget); a policy that maps none and does not keep the full
cache is left as configured, and `left_out_of_budget` names it so the summary says so. Expansions (per-task params,
budget sweeps) return new cells, validated before any work: `validate_cells` parses each cell's policy once and
keeps it on the cell, for the checks and the system that runs it.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.integrations.assets import known_model_dir
from harness.running.config import CONF_DIR, UserError, load_group, plain
from harness.running.schema import SystemConfig, TaskConfig
from systems.policies import policy_class
from systems.policies.base import Policy
from systems.registry import backend_of, check_dims, check_system, policy_backend
from tasks.base import TaskError, load_task, task_class

ENGINE_SETTINGS = "engine"      # the SystemConfig field holding the engine settings (EngineConfig)


@dataclass
class GridCell:
    """One (system, task) pair of an experiment, with the fully resolved config that makes it."""

    system: DictConfig
    task: DictConfig
    key: str
    policy: Policy | None = field(default=None, compare=False)   # the system's policy, parsed by validate_cells
    tag: dict[str, Any] = field(default_factory=dict, compare=False)   # what a kind knows of it (an ablation point)

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
    for cur, base in ((system, sys_default), (task, task_default)):
        a, b = _flat(OmegaConf.to_container(cur)), _flat(OmegaConf.to_container(base))
        diffs += [f"{k.split('.')[-1]}={a[k]}" for k in sorted(a) if k != "name" and a[k] != b.get(k)]
    key = f"{system.name}__{task.name}"
    if diffs:
        key += "__" + ",".join(diffs)
    return "".join(c if c.isalnum() or c in "-_=.,+" else "-" for c in key)[:180]


def resolve_cells(cfg: DictConfig, system_defaults: Mapping[str, Any] | None = None) -> list[GridCell]:
    """The experiment's system × task grid. `system_defaults` (the experiment kind's) replace values still at the
    schema's default, on the settings each system's backend honours; exp.params.system_overrides come after them and
    can set anything."""
    hydra_choice = _hydra_choices()
    systems = ([(system_config(n), system_config(n)) for n in cfg.exp.systems] or
               [(cfg.system, _default_or_self("system", hydra_choice.get("system"), SystemConfig, cfg.system))])
    tasks = ([(task_config(n), task_config(n)) for n in cfg.exp.tasks] or
             [(cfg.task, _default_or_self("task", hydra_choice.get("task"), TaskConfig, cfg.task))])
    if system_defaults:
        for cur, _ in systems:
            apply_defaults(cur, system_defaults, honoured=backend_of(cur).engine_settings)
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


def system_config(name: str) -> DictConfig:
    """conf/system/<name>.yaml; without such a file, a policy of that name (an installed package's, through the
    `kvharness.policies` entry points) with its defaults, on the backend that runs policies."""
    if (CONF_DIR / "system" / f"{name}.yaml").is_file() or not name.isidentifier() or policy_class(name) is None:
        return load_group("system", name, SystemConfig)
    return _structured(SystemConfig, _policy_system(name))


def task_config(name: str) -> DictConfig:
    """conf/task/<name>.yaml; without such a file, a task family of that name (an installed package's, through the
    `kvharness.tasks` entry points) with its defaults."""
    if (CONF_DIR / "task" / f"{name}.yaml").is_file() or not name.isidentifier():
        return load_group("task", name, TaskConfig)
    try:
        task_class(name)
    except TaskError:
        return load_group("task", name, TaskConfig)          # the unknown-task error names the files
    return _structured(TaskConfig, {"name": name, "family": name})


def _policy_system(policy: str) -> dict[str, Any]:
    backend = policy_backend().name
    return {"name": f"{backend}-{policy}", "backend": backend, "policy": policy}


def _structured(schema: type, values: dict[str, Any]) -> DictConfig:
    node = OmegaConf.merge(OmegaConf.structured(schema), values)
    assert isinstance(node, DictConfig)
    return node


def apply_defaults(node: DictConfig, defaults: Mapping[str, Any], schema: Any = None,
                   honoured: Iterable[str] | None = None) -> None:
    """Set each key of `defaults` (nested) where `node` still holds its schema default; under `engine`, only the
    settings in `honoured` (what the system's backend reads: a setting it ignores must not change its cell key)."""
    schema = schema if schema is not None else OmegaConf.structured(SystemConfig)
    for key, value in defaults.items():
        if isinstance(value, dict):
            inner = honoured if key == ENGINE_SETTINGS else None
            sub = {k: v for k, v in value.items() if inner is None or k in set(inner)}
            apply_defaults(node[key], sub, schema[key])
        elif node[key] == schema[key]:
            node[key] = value


def hold_out(system: DictConfig, task_name: str) -> None:
    """The policy's rule for evaluating a task (FlexiCache: never with a profile made on that task)."""
    policy = policy_class(system.policy) if backend_of(system).runs_policies else None
    if policy is not None:
        system.params = policy.with_heldout_task(plain(system.params), task_name)


def apply_budget(system: DictConfig, budget: int) -> None:
    """A shared budget (tokens) for every policy that maps one onto its knobs (the policy maps it); the others keep
    their configuration (left_out_of_budget names them)."""
    policy = policy_class(system.policy) if backend_of(system).runs_policies else None
    if policy is not None and policy.has_budget():        # an unknown policy is reported by check_system
        system.params = policy.with_budget(plain(system.params), budget)


def left_out_of_budget(systems: Iterable[DictConfig]) -> list[str]:
    """`<system> (why)` for each system a shared budget leaves as configured although its policy could hold less
    (a policy that keeps the full cache by design is not left out: it is what the budget is compared with)."""
    out = []
    for system in {s.name: s for s in systems}.values():
        cls = policy_class(system.policy)
        why = cls.budget_left_out() if cls is not None else None
        if why:
            out.append(f"{system.name} ({why})")
    return out


def _default_or_self(group: str, choice: str | None, schema: type, current: DictConfig) -> DictConfig:
    """The pristine group file behind `current` (by Hydra's choice, else by matching name), for cell keys."""
    if choice and (CONF_DIR / group / f"{choice}.yaml").is_file():
        return load_group(group, choice, schema)
    return pristine(group, current.name, schema) or current


def _hydra_choices() -> dict:
    try:
        from hydra.core.hydra_config import HydraConfig
        return dict(HydraConfig.get().runtime.choices)
    except (ValueError, ImportError):
        return {}


def _name_in(path: Path) -> Any:
    """The `name` a conf group file declares."""
    node = OmegaConf.load(path)
    return node.get("name") if isinstance(node, DictConfig) else None


def pristine(group: str, name: str, schema: type) -> DictConfig | None:
    """The group file whose `name` is `name`, unmodified: the baseline a cell key lists its differences from (for a
    policy or task family named without a file, the config system_config / task_config make for it)."""
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        if _name_in(path) == name:
            return load_group(group, path.stem, schema)
    if group == "system":
        policy = name.split("-", 1)[-1]
        if policy.isidentifier() and policy_class(policy) is not None and _policy_system(policy)["name"] == name:
            return _structured(SystemConfig, _policy_system(policy))
    elif name.isidentifier():
        try:
            task_class(name)
        except TaskError:
            return None
        return _structured(TaskConfig, {"name": name, "family": name})
    return None


def check_budget(system: DictConfig, model: DictConfig) -> None:
    """Budget semantics every policy shares: positive and within the context (each policy checks the rest against
    the engine's page size when it is configured)."""
    cls = policy_class(system.policy)
    budget = cls.budget_of(plain(system.params)) if cls is not None else None
    if budget is None:
        return
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise UserError(f"system {system.name!r}: params.budget must be a positive integer (tokens), got {budget!r}")
    if budget > model.max_model_len:
        raise UserError(f"system {system.name!r}: params.budget={budget} exceeds the context "
                        f"(model.max_model_len={model.max_model_len}); lower the budget")


def check_one_system(cfg: DictConfig, system: DictConfig) -> Policy:
    """Every check of one system that needs no model weights; returns its policy, parsed once."""
    check_budget(system, cfg.model)
    policy = check_system(system)
    # dims without preparing: a missing model is checked later
    model_folder = known_model_dir(cfg.model.path, cfg.model.name)
    if model_folder is not None:
        check_dims(system, model_folder, cfg.model.max_model_len, policy, cfg.model.name)
    return policy


def validate_cells(cfg: DictConfig, cells: list[GridCell]) -> None:
    """Everything checkable without loading a model, so a typo costs a second, not an hour."""
    if not cells:
        raise UserError("the experiment has no cells: set exp.systems and exp.tasks")
    for cell in cells:
        cell.policy = check_one_system(cfg, cell.system)
        t = cell.task
        task = load_task(t.family, t.name, plain(t.params), seed=cfg.seed, limit=t.limit, fraction=t.fraction)
        new_tokens = getattr(task.params, "max_new_tokens", None)      # the engine refuses < 1, hours later
        if isinstance(new_tokens, (int, float)) and not isinstance(new_tokens, bool) and new_tokens < 1:
            raise UserError(f"task {t.name!r}: task.params.max_new_tokens={new_tokens} must be a positive integer "
                            "(tokens to generate per sample)")


# ---- expansions an experiment kind applies ------------------------------------------------------------------------
def variant(cell: GridCell, system_params: dict | None = None, task_params: dict | None = None,
            task_fields: dict | None = None) -> GridCell:
    """A copy of `cell` with some system / task params replaced; its key names every difference from the files."""
    system, task = copy.deepcopy(cell.system), copy.deepcopy(cell.task)
    if system_params:
        system.merge_with({"params": system_params})
    if task_params:
        task.merge_with({"params": task_params})
    if task_fields:
        task.merge_with(task_fields)
    sys_default = pristine("system", system.name, SystemConfig) or system
    task_default = pristine("task", task.name, TaskConfig) or task
    return GridCell(system, task, cell_key(system, task, sys_default, task_default))


def with_task_params(cfg: DictConfig, cells: list[GridCell], per_task: Mapping[str, Any]) -> list[GridCell]:
    """Apply {task name: {param: value}} to the cells of the named tasks and validate the result before any work."""
    name_of = {path.stem: _name_in(path) for path in (CONF_DIR / "task").glob("*.yaml")}
    unknown = sorted(set(per_task) - set(name_of.values()) - {c.task.name for c in cells})
    by_file = [f"{k!r} -> {name_of[k]!r}" for k in unknown if k in name_of]
    if by_file:
        raise UserError(f"exp.params.task_params is keyed by the task's `name`, not its conf/task file name: rename "
                        f"the key(s) {', '.join(by_file)}")
    if unknown:   # a task of the files that is not in this grid is fine: narrowing exp.tasks keeps the yaml's entries
        raise UserError(f"exp.params.task_params names unknown task(s) {unknown}; key it by a task's `name` (this "
                        f"grid's: {sorted({c.task.name for c in cells})})")
    if not set(per_task) & {c.task.name for c in cells}:
        return cells
    out = [variant(c, task_params=dict(per_task[c.task.name])) if c.task.name in per_task else c for c in cells]
    validate_cells(cfg, out)
    return out


def budget_params(system: DictConfig, budget: int) -> dict | str:
    """The system params a policy maps `budget` onto (those that change), or why the policy cannot run at it (an
    LServe budget must be a whole number of its 64-token pages, as in the official code)."""
    policy = policy_class(system.policy)
    assert policy is not None, "validated cells name known policies"
    params = plain(system.params)
    mapped = policy.with_budget(params, budget)
    try:
        policy.from_params(mapped)
    except ValueError as exc:
        return str(exc)
    return {k: v for k, v in mapped.items() if params.get(k, object()) != v}


def swept(system: DictConfig) -> bool:
    """Whether a budget sweep runs this system at each budget (its policy maps a shared budget)."""
    cls = policy_class(system.policy) if backend_of(system).runs_policies else None
    return cls is not None and cls.has_budget()


def by_budget(cfg: DictConfig, cells: list[GridCell], budgets: list | None, shared_budget: int | None
              ) -> tuple[list[GridCell], list[str]]:
    """Cells and their labels: with `budgets`, each cell of a policy that has a budget becomes one cell per budget
    (labelled `<system>@<budget>`, the budget mapped onto the policy's parameters by the policy); the other systems
    run once under their own name. A budget a policy cannot run at is left out of its curve (the summaries say so),
    not fudged onto a nearby one."""
    if budgets is None:
        return cells, [c.system.name for c in cells]
    if shared_budget is not None:
        raise UserError("set exp.params.budget or exp.params.budgets, not both")
    if not budgets or any(int(b) <= 0 for b in budgets):
        raise UserError(f"exp.params.budgets={budgets}: give a list of positive token budgets")
    out, labels = [], []
    for cell in cells:
        if not swept(cell.system):
            out.append(cell)
            labels.append(cell.system.name)
            continue
        points = {int(b): budget_params(cell.system, int(b)) for b in budgets}
        runnable = {b: changed for b, changed in points.items() if isinstance(changed, dict)}
        if not runnable:
            raise UserError(f"{cell.system.name} runs at none of exp.params.budgets={list(budgets)} "
                            f"({next(iter(points.values()))}): add a budget it accepts or drop it from exp.systems")
        for b, changed in runnable.items():
            out.append(variant(cell, system_params=changed))
            labels.append(f"{cell.system.name}@{b}")
    validate_cells(cfg, out)
    return out, labels


def budgets_left_out(cells: list[GridCell], labels: list[str], budgets: list) -> list[str]:
    """'<system> at <budget> (why)' for every budget a swept policy could not run at."""
    first = {label.split("@")[0]: cell for cell, label in zip(cells, labels) if "@" in label}
    return [f"{name} at {int(b)} ({why})" for name, cell in first.items() for b in budgets
            if isinstance(why := budget_params(cell.system, int(b)), str)]


def budget_label(system: DictConfig, budgets: list | None) -> str:
    """The label a cell read back from disk had in a budget sweep: `<system>@<budget>` for swept policies (the
    policy reads its budget back from its params)."""
    cls = policy_class(system.policy) if system.get("policy") else None
    budget = cls.budget_of(plain(system.get("params"))) if cls is not None else None
    return f"{system.name}@{int(budget)}" if budgets and budget is not None else system.name
