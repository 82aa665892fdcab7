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
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import plots, report
from harness.experiments import accuracy
from harness.runner import CONF_DIR, Cell, UserError, cell_key, load_group, validate
from harness.schema import SystemConfig, TaskConfig
from harness.store import Cell as StoreCell

DEFAULTS = {"reference": None, "min_reference_score": 5.0, "task_params": {}, "budgets": None}
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


# ---- scores ----------------------------------------------------------------------------------------------------
def unit_scores(metrics: dict, rows: list[dict]) -> dict[str, float]:
    """Score per task unit: one per dataset of a multi-dataset task (its summary holds each), else the task's."""
    summary = metrics.get("summary") or {}
    for key in ("dataset", "task"):
        names = sorted({(r.get("meta") or {}).get(key) for r in rows} - {None})
        if len(names) > 1 and all(isinstance(summary.get(n), (int, float)) for n in names):
            return {f"{metrics['task']}/{n}": float(summary[n]) for n in names}
    score = summary.get("score")
    return {metrics["task"]: float(score) if score is not None else math.nan}


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def retention_table(scores: dict[str, dict[str, float]], reference: str, min_ref: float) -> dict[str, Any]:
    """scores: system -> unit -> score. Returns per-(system, unit) ratios, flagged units and per-system averages."""
    ref = scores.get(reference, {})
    units = list(dict.fromkeys(u for s in scores.values() for u in s))
    flagged = sorted(u for u in units if not (ref.get(u, math.nan) >= min_ref))
    ratios: dict[str, dict[str, float]] = {}
    averages: dict[str, dict[str, float]] = {}
    for name, per_unit in scores.items():
        ratios[name] = {u: (per_unit[u] / ref[u] if ref.get(u) and not math.isnan(ref[u]) and u in per_unit
                            else math.nan) for u in units}
        usable = [u for u in units if u not in flagged and u in per_unit]
        mean_sys = _mean([per_unit[u] for u in usable])
        mean_ref = _mean([ref[u] for u in usable])
        averages[name] = {
            "mean_score": _mean([per_unit.get(u, math.nan) for u in units]),
            "macro_retention": _mean([ratios[name][u] for u in usable]),
            "ratio_of_means": mean_sys / mean_ref if mean_ref and not math.isnan(mean_ref) else math.nan,
            "units_used": len(usable)}
    return {"units": units, "flagged": flagged, "ratios": ratios, "averages": averages}


# ---- run and summary -------------------------------------------------------------------------------------------
def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    cells = with_task_params(cfg, cells)
    cells, labels = by_budget(cfg, cells, cfg.exp.params.get("budgets"))
    metrics = accuracy.run_cells(cfg, cells, out_dir)
    rows_by_cell = {c.key: StoreCell(out_dir / c.key).rows() for c in cells}
    paths = write_summary(cfg, cells, metrics, rows_by_cell, out_dir, labels)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return metrics


def collect(cells: list[Cell], metrics: list[dict], rows_by_cell: dict[str, list[dict]],
            labels: list[str] | None = None) -> dict[str, dict]:
    scores: dict[str, dict[str, float]] = {}
    for i, (cell, m) in enumerate(zip(cells, metrics)):
        name = labels[i] if labels else m["system"]
        scores.setdefault(name, {}).update(unit_scores(m, rows_by_cell.get(cell.key, [])))
    return scores


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
    reference = params["reference"] or report.reference_system(cfg, cells)
    labels = labels or [m["system"] for m in metrics]
    scores = collect(cells, metrics, rows_by_cell, labels)
    stats = policy_stats(cells, rows_by_cell, labels)
    shown_stats = [k for k in POLICY_STATS if any(k in per for per in stats.values())]
    if reference not in scores:
        raise UserError(f"reference system {reference!r} is not in the grid {sorted(scores)}: add it to exp.systems "
                        f"or set exp.params.reference")
    tab = retention_table(scores, reference, float(params["min_reference_score"]))
    systems, units, flagged = list(scores), tab["units"], set(tab["flagged"])
    others = [s for s in systems if s != reference]
    avg = tab["averages"]
    mark = lambda u: f"{u} †" if u in flagged else u  # noqa: E731
    ranked = sorted(others, key=lambda s: (math.isnan(avg[s]["macro_retention"]), -avg[s]["macro_retention"]))
    budget = params.get("budget")
    at = (f" at a budget of {budget} tokens" if budget is not None else
          f" at budgets of {', '.join(str(b) for b in params['budgets'])} tokens (`system@budget`)"
          if params.get("budgets") else "")
    glance = ("**At a glance:** macro-mean retention vs `" + reference + "`" + at + ": "
              + ", ".join(f"{s} {report.fmt(avg[s]['macro_retention'], 3)}" for s in ranked)
              + f" (over {len(units) - len(flagged)} of {len(units)} task units).") if others else "No policies."
    parts = [f"# {cfg.exp.name}", "", glance, "",
             "## Scores (0–100)", "",
             report.md_table(["task", *systems], [[mark(u), *[scores[s].get(u) for s in systems]] for u in units], 1),
             "", f"## Retention (score ÷ `{reference}` on the same task)", "",
             report.md_table(["task", *others], [[mark(u), *[tab["ratios"][s][u] for s in others]] for u in units], 3),
             "", "## Averages", "",
             report.md_table(["system", "mean score", "macro mean of ratios", "ratio of means", "units used",
                              *[POLICY_STATS[k] for k in shown_stats]],
                             [[s, avg[s]["mean_score"], avg[s]["macro_retention"], avg[s]["ratio_of_means"],
                               avg[s]["units_used"], *[stats.get(s, {}).get(k) for k in shown_stats]]
                              for s in systems], 3), ""]
    if flagged:
        parts += [f"† reference score below {params['min_reference_score']} (of 100): the ratio is shown but left "
                  "out of both averages.", ""]
    parts += ["Macro mean of ratios = mean over task units of score ÷ reference (FlexiCache's average); ratio of "
              "means = mean score ÷ mean reference score (CAKE's). Same samples, prompts and greedy decoding for "
              "every system.", "", f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    csv_rows = [{"system": s, "task": u, "score": scores[s].get(u), "reference": reference,
                 "reference_score": scores[reference].get(u), "retention": tab["ratios"][s][u],
                 "flagged_small_reference": u in flagged} for s in systems for u in units]
    csv_rows += [{"system": s, "task": "AVERAGE", "score": avg[s]["mean_score"], "reference": reference,
                  "retention": avg[s]["macro_retention"], "ratio_of_means": avg[s]["ratio_of_means"],
                  **stats.get(s, {})} for s in systems]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv(csv_rows))
    paths = {"md": str(md), "csv": str(csv_path)}
    if others:
        paths["png"] = plots.heatmap(
            out_dir / "retention.png", [[tab["ratios"][s][u] for u in units] for s in others], others,
            [mark(u) for u in units], xlabel="task", ylabel="system", colorbar=f"score ÷ {reference}",
            title=f"Accuracy retention vs {reference}", vmin=0.0, vmax=1.2, digits=2)
    return paths
