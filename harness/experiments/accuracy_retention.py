"""Accuracy retention: per-task scores of every system and their ratio to the dense reference, averaged as papers do.

Two averages per system, because the seeds differ: FlexiCache reports the macro mean of per-task ratios
(policy ÷ dense on each task, then the mean), CAKE the ratio of the mean scores. A task whose reference score is
below `min_reference_score` (0–100) makes its ratio meaningless (0.5 ÷ 0.2 = 2.5×); it is flagged and left out of
the macro mean, but kept in the tables. Multi-dataset tasks (LongBench, L-Eval) count one unit per dataset.

exp.params: budget (shared token budget, applied by the runner) or budgets (a list: every policy with a budget runs
at each, labelled `<system>@<budget>`, beside one run of each budget-free system), reference (system name; default
engine-dense),
min_reference_score (default 5.0), task_params ({task name: {param: value}}: per-task overrides that
system_overrides / task_overrides cannot express, e.g. shorter NeedleBench lengths at CPU scale).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import accuracy_report
from harness.accuracy_report import AccuracyData
from harness.experiments import accuracy
from harness.summary import Summary, print_paths
from harness.runner import CONF_DIR, Cell, UserError, cell_key, load_group, validate
from harness.schema import SystemConfig, TaskConfig
from harness.store import Cell as StoreCell

DEFAULTS = {"reference": None, "min_reference_score": 5.0, "task_params": {}, "budgets": None}
SYSTEM_DEFAULTS = accuracy.SYSTEM_DEFAULTS
# per-request policy statistics averaged into the summary when a policy reports them (Completion.kv_stats)
POLICY_STATS = {"promoted_share_of_topk": "promoted share of top-K / rerank"}


# ---- cells derived from the runner's grid (shared with needlebench and cake_ablation) ----------------------------
def pristine(group: str, name: str, schema: type) -> DictConfig | None:
    """The group file whose `name` is `name`, unmodified: the baseline a cell key lists its differences from."""
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        if OmegaConf.load(path).get("name") == name:
            return load_group(group, path.stem, schema)
    return None


def variant(cell: Cell, system_params: dict | None = None, task_params: dict | None = None,
            task_fields: dict | None = None) -> Cell:
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
    return Cell(system, task, cell_key(system, task, sys_default, task_default))


def with_task_params(cfg: DictConfig, cells: list[Cell]) -> list[Cell]:
    """Apply exp.params.task_params to the cells of the named tasks and validate the result before any work."""
    per_task = dict(cfg.exp.params.get("task_params") or {})
    known = {OmegaConf.load(path).get("name") for path in (CONF_DIR / "task").glob("*.yaml")}
    unknown = sorted(set(per_task) - known - {c.task.name for c in cells})
    if unknown:   # a task of the files that is not in this grid is fine: narrowing exp.tasks keeps the yaml's entries
        raise UserError(f"exp.params.task_params names unknown task(s) {unknown}; use task names of conf/task")
    if not set(per_task) & {c.task.name for c in cells}:
        return cells
    out = [variant(c, task_params=OmegaConf.to_container(per_task[c.task.name], resolve=True))
           if c.task.name in per_task else c for c in cells]
    validate(cfg, out)
    return out


def by_budget(cfg: DictConfig, cells: list[Cell], budgets: list | None) -> tuple[list[Cell], list[str]]:
    """Cells and their labels: with `budgets`, each cell of a policy that has a budget becomes one cell per budget
    (labelled `<system>@<budget>`); budget-free systems (dense, vllm, hf) run once under their own name."""
    if budgets is None:
        return cells, [c.system.name for c in cells]
    if cfg.exp.params.get("budget") is not None:
        raise UserError("set exp.params.budget or exp.params.budgets, not both")
    if not budgets or any(int(b) <= 0 for b in budgets):
        raise UserError(f"exp.params.budgets={budgets}: give a list of positive token budgets")
    out, labels = [], []
    for cell in cells:
        fields = set()
        if cell.system.backend == "engine":
            policy = importlib.import_module(f"systems.policies.{cell.system.policy}").POLICY
            fields = {f.name for f in dataclasses.fields(policy)}
        if "budget" not in fields:
            out.append(cell)
            labels.append(cell.system.name)
            continue
        for b in budgets:
            extra = {"budget": int(b), **({"recent_size": None} if "recent_size" in fields else {})}
            out.append(variant(cell, system_params=extra))
            labels.append(f"{cell.system.name}@{int(b)}")
    validate(cfg, out)
    return out, labels


# ---- run and summary -------------------------------------------------------------------------------------------
def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    cells = with_task_params(cfg, cells)
    cells, labels = by_budget(cfg, cells, cfg.exp.params.get("budgets"))
    reference = accuracy_report.reference_label(cfg, labels) or labels[0]
    metrics = accuracy.run_cells(cfg, cells, out_dir, labels, reference)
    rows_by_cell = {c.key: StoreCell(out_dir / c.key).rows() for c in cells}
    paths = write_summary(cfg, cells, metrics, rows_by_cell, out_dir, labels)
    print_paths(paths)
    return metrics


def policy_stats(cells: list[Cell], rows_by_cell: dict[str, list[dict]], labels: list[str]) -> dict[str, dict]:
    """label -> {stat: mean over the label's requests} for the POLICY_STATS a policy reports."""
    values: dict[str, dict[str, list[float]]] = {}
    for cell, label in zip(cells, labels):
        for row in rows_by_cell.get(cell.key, []):
            for stat in POLICY_STATS:
                v = (row.get("kv_stats") or {}).get(stat)
                if isinstance(v, (int, float)):
                    values.setdefault(label, {}).setdefault(stat, []).append(float(v))
    return {label: {k: sum(v) / len(v) for k, v in per.items()} for label, per in values.items()}


def write_summary(cfg, cells, metrics, rows_by_cell, out_dir: Path, labels: list[str] | None = None
                  ) -> dict[str, str]:
    params = {**DEFAULTS, **OmegaConf.to_container(cfg.exp.params, resolve=True)}
    labels = labels or [c.system.name for c in cells]
    reference = params["reference"] or accuracy_report.reference_label(cfg, labels) or labels[0]
    if reference not in labels:
        raise UserError(f"reference system {reference!r} is not in the grid {sorted(set(labels))}: add it to "
                        f"exp.systems or set exp.params.reference")
    data = AccuracyData(cells, labels, rows_by_cell, float(params["min_reference_score"]))
    use = data.usable(reference)
    budget = params.get("budget")
    at = (f" at a budget of {budget} tokens" if budget is not None else
          f" at budgets of {', '.join(str(b) for b in params['budgets'])} tokens (`system@budget`)"
          if params.get("budgets") else "")
    summary = Summary(cfg)
    n_ref = sum(data.n(reference, u) for u in use)
    bullets = [f"macro retention vs `{reference}`{at}, over {len(use)} of {len(data.units)} task units "
               f"({n_ref} samples): {data.ranking(reference, units=use)}"]
    if data.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement with `{reference}`: "
                       f"{data.fidelity_ranking('fid_top1', reference)}")
        bullets.append(f"KL({reference} ‖ policy), nats per token: {data.fidelity_ranking('fid_kl', reference)}")
    summary.glance("`>` only where the paired 95 % interval of the difference excludes 0; `≈`: indistinguishable "
                   "at this n.", bullets)
    accuracy_report.standard_sections(summary, data, reference, out_dir)
    stats = policy_stats(cells, rows_by_cell, labels)
    shown = [k for k in POLICY_STATS if any(k in per for per in stats.values())]
    if shown:
        summary.section("Policy statistics").table(
            ["system", *[POLICY_STATS[k] for k in shown]],
            [[s, *[stats.get(s, {}).get(k) for k in shown]] for s in data.systems if s in stats], 3)
        summary.csv([{"system": s, "task": "POLICY_STATS", **v} for s, v in stats.items()])
    summary.text("Macro retention = mean over task units of each unit's retention (FlexiCache's average); ratio of "
                 "means = mean score ÷ mean reference score (CAKE's). Same samples, prompts and greedy decoding for "
                 "every system; engine systems decode batch-invariantly.")
    summary.took(sum(m.get("generation_seconds", 0) + m.get("fidelity_seconds", 0) for m in metrics),
                 "generation + fidelity, every cell")
    return summary.write(out_dir)
