"""Grid expansions an experiment kind applies to the runner's system × task cells: per-task params, budget sweeps.

Each expansion returns new cells whose keys name every difference from the group files (so a cell's folder says
what made it) and validates them before any work.
"""
from __future__ import annotations

import copy

from omegaconf import DictConfig, OmegaConf

from harness.running.runner import CONF_DIR, GridCell, UserError, cell_key, load_group, validate
from harness.running.schema import SystemConfig, TaskConfig
from systems.registry import policy_class


def pristine(group: str, name: str, schema: type) -> DictConfig | None:
    """The group file whose `name` is `name`, unmodified: the baseline a cell key lists its differences from."""
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        if OmegaConf.load(path).get("name") == name:
            return load_group(group, path.stem, schema)
    return None


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


def with_task_params(cfg: DictConfig, cells: list[GridCell], per_task: dict) -> list[GridCell]:
    """Apply {task name: {param: value}} to the cells of the named tasks and validate the result before any work."""
    known = {OmegaConf.load(path).get("name") for path in (CONF_DIR / "task").glob("*.yaml")}
    unknown = sorted(set(per_task) - known - {c.task.name for c in cells})
    if unknown:   # a task of the files that is not in this grid is fine: narrowing exp.tasks keeps the yaml's entries
        raise UserError(f"exp.params.task_params names unknown task(s) {unknown}; use task names of conf/task")
    if not set(per_task) & {c.task.name for c in cells}:
        return cells
    out = [variant(c, task_params=dict(per_task[c.task.name])) if c.task.name in per_task else c for c in cells]
    validate(cfg, out)
    return out


def budget_params(system: DictConfig, budget: int) -> dict | str:
    """The system params a policy maps `budget` onto (those that change), or why the policy cannot run at it (an
    LServe budget must be a whole number of its 64-token pages, as in the official code)."""
    policy = policy_class(system.policy)
    params = OmegaConf.to_container(system.params, resolve=True)
    mapped = policy.with_budget(params, budget)
    try:
        policy.from_params(mapped)
    except ValueError as exc:
        return str(exc)
    return {k: v for k, v in mapped.items() if params.get(k, object()) != v}


def by_budget(cfg: DictConfig, cells: list[GridCell], budgets: list | None, shared_budget: int | None
              ) -> tuple[list[GridCell], list[str]]:
    """Cells and their labels: with `budgets`, each cell of a policy that has a budget becomes one cell per budget
    (labelled `<system>@<budget>`, the budget mapped onto the policy's parameters by the policy); budget-free systems
    (dense, vllm, hf) run once under their own name. A budget a policy cannot run at is left out of its curve (the
    summaries say so), not fudged onto a nearby one."""
    if budgets is None:
        return cells, [c.system.name for c in cells]
    if shared_budget is not None:
        raise UserError("set exp.params.budget or exp.params.budgets, not both")
    if not budgets or any(int(b) <= 0 for b in budgets):
        raise UserError(f"exp.params.budgets={budgets}: give a list of positive token budgets")
    out, labels = [], []
    for cell in cells:
        policy = policy_class(cell.system.policy) if cell.system.backend == "engine" else None
        if policy is None or not policy.has_budget():
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
    validate(cfg, out)
    return out, labels


def budgets_left_out(cells: list[GridCell], labels: list[str], budgets: list) -> list[str]:
    """'<system> at <budget> (why)' for every budget a swept policy could not run at."""
    first = {label.split("@")[0]: cell for cell, label in zip(cells, labels) if "@" in label}
    return [f"{name} at {int(b)} ({why})" for name, cell in first.items() for b in budgets
            if isinstance(why := budget_params(cell.system, int(b)), str)]


def budget_label(cell, budgets: list | None) -> str:
    """The label a cell read back from disk had in a budget sweep: `<system>@<budget>` for budgeted policies."""
    budget = (cell.system.get("params") or {}).get("budget")
    return f"{cell.system.name}@{int(budget)}" if budgets and budget is not None else cell.system.name
