"""CAKE ablations on NeedleBench: budget allocation (T2, F8), eviction indicator (T3) and the tau1 / tau2 sweep (F13).

The CAKE system of exp.systems is the template; every ablation point is that system with `allocation`, `indicator`,
`tau1`, `tau2` and `budget` replaced (fields of systems/policies/cake.py), run as an ordinary, resumable accuracy
cell next to the reference (dense) cells. Points:
- allocation study: every entry of `allocations` with the base indicator (CAKE T2; with indicator `sum` = SnapKV's
  or `h2o` in `indicators` and full_grid, the allocation × indicator grid is CAKE F8);
- indicator study: every entry of `indicators` with the base allocation (CAKE T3);
- full_grid: true runs the whole allocation × indicator product instead of the two one-factor studies;
- tau sweep: tau1s × tau2s with the base allocation and indicator (CAKE F13; taus only act on `preference`).
Every study runs at every budget of `budgets` (tokens per layer, window included, as CAKE's cache_size);
`template_params` are CAKE params set on every point (e.g. tau_model, so the base point uses CAKE's tau table).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig

from harness.experiments.accuracy import AccuracyExperiment
from harness.experiments.accuracy.data import AccuracyData
from harness.experiments.accuracy.sections import CHAIN_KEY, cells_seconds, standard_sections
from harness.experiments.cake_ablation.params import Params
from harness.experiments.cake_ablation.report import AblationReport, matches, retention_columns
from harness.reporting import uncertainty as unc
from harness.reporting.summary import cell_envs, generation_work
from harness.running.config import UserError, plain
from harness.running.experiment import Run
from harness.running.grid import GridCell, validate_cells, variant, with_task_params
from systems.policies import load_policy, policy_class

ABLATED = {"budget", "allocation", "indicator", "tau1", "tau2"}     # the template policy's knobs the points set
_matches = matches              # tests read it from this module


def points(p: Params) -> list[dict]:
    """Ablation points (dicts of cake params plus the study they belong to), without duplicates."""
    base = p.base
    out: list[dict] = []
    for budget in p.budgets:
        combos: list[tuple[str, str, str, float | None, float | None]] = []
        if p.full_grid:
            combos += [("grid", a, i, None, None) for a in p.allocations for i in p.indicators]
        else:
            combos += [("allocation", a, base.indicator, None, None) for a in p.allocations]
            combos += [("indicator", base.allocation, i, None, None) for i in p.indicators]
        combos += [("tau", base.allocation, base.indicator, float(t1), float(t2))
                   for t1 in p.tau1s for t2 in p.tau2s]
        for study, a, i, t1, t2 in combos:
            out.append({"study": study, "budget": int(budget), "allocation": a, "indicator": i, "tau1": t1,
                        "tau2": t2})
    return out


def _default_taus(cell: GridCell, point: dict) -> tuple[float, float]:
    """The taus the template resolves to at this point (its own, or CAKE's table): a tau point equal to them is the
    base point, run once."""
    params = {**plain(cell.system.params), **point}
    tau1, tau2 = load_policy(cell.system.policy, params).taus      # type: ignore[attr-defined]  # CAKE's taus
    return float(tau1), float(tau2)


def is_template(cell: GridCell) -> bool:
    """A system whose policy has every knob the ablation turns (CAKE's) is a template of the ablation points."""
    cls = policy_class(cell.system.policy)
    return cls is not None and ABLATED <= {f.name for f in dataclasses.fields(cls)}


def expand(cfg: DictConfig, cells: list[GridCell], p: Params) -> list[GridCell]:
    """Reference cells as they are, plus one cell per (template cell, ablation point), each tagged with its point;
    validated."""
    templates = [c for c in cells if is_template(c)]
    if not templates:
        raise UserError(f"cake_ablation needs a system whose policy has the knobs {sorted(ABLATED)} (e.g. cake) in "
                        "exp.systems, as the template")
    out_cells: list[GridCell] = []
    tags: list[dict[str, Any]] = []
    for c in cells:
        if not is_template(c):
            out_cells.append(c)
            tags.append({"study": "reference", "budget": None})
    seen = set()
    for c in templates:
        for pt in points(p):
            params = {**p.template_params, **{k: pt[k] for k in ("budget", "allocation", "indicator")}}
            if pt["tau1"] is not None and (pt["tau1"], pt["tau2"]) != _default_taus(c, params):
                params.update(tau1=pt["tau1"], tau2=pt["tau2"])
            v = variant(c, system_params=params)
            tag = {**pt, "template": c.system.name, "task": c.task.name}
            if v.key in seen:                      # the CAKE default sits in both one-factor studies
                first = tags[[x.key for x in out_cells].index(v.key)]
                first.setdefault("also", []).append(pt["study"])
                if pt["tau1"] is not None:
                    first.setdefault("tau_alias", []).append([pt["tau1"], pt["tau2"]])
                continue
            seen.add(v.key)
            out_cells.append(v)
            tags.append(tag)
    validate_cells(cfg, out_cells)
    for cell, tag in zip(out_cells, tags):
        cell.tag = tag
    return out_cells


def label(tag: dict, system: str) -> str:
    """A distinct system label per ablation point (reference cells keep their system name)."""
    if tag["study"] == "reference":
        return system
    taus = f" τ={tag['tau1']:g}/{tag['tau2']:g}" if tag.get("tau1") is not None else ""
    return f"{system}@{tag['budget']} {tag['allocation']}+{tag['indicator']}{taus}"


class CakeAblation(AccuracyExperiment[Params]):
    params_type = Params

    def grid(self, run: Run[Params]) -> tuple[list[GridCell], list[str]]:
        p = run.params
        if not p.budgets:
            raise UserError("exp.params.budgets must list at least one CAKE budget (tokens per layer)")
        cells = expand(run.cfg, with_task_params(run.cfg, run.grid, p.task_params), p)
        return cells, [label(c.tag, c.system.name) for c in cells]

    def write_summary(self, run: Run[Params], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        return write_summary(run, cells, labels, metrics, rows_by_cell)


def write_summary(run: Run[Params], cells: list[Any], labels: list[str], metrics: list[dict],
                  rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    reference = p.reference or labels[0]
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
    unit = data.units[0] if len(data.units) == 1 else None
    tags = [getattr(c, "tag", None) or {"study": "other"} for c in cells]    # other: a multirun job's cell
    points = [{**t, "label": lab} for t, lab in zip(tags, labels) if t["study"] not in ("reference", "other")]
    budgets = [int(b) for b in p.budgets]
    ref_score = data.score(reference, unit) if unit else unc.NAN
    summary = run.summary(envs=cell_envs(metrics))
    # points are compared at equal budget: a pair across budgets says nothing about allocation or indicator
    at_budget = {f"budget {b}": [pt["label"] for pt in points if int(pt["budget"]) == b] for b in budgets}
    at_budget = {t: g for t, g in at_budget.items() if g}
    same_budget = {t: g for t, g in at_budget.items() if len(g) > 1}
    bullets = [f"retention of each CAKE point vs `{reference}` ({ref_score.fmt(1)})"
               + (f" at {t}" if len(at_budget) > 1 else "") + f": {data.ranking(reference, g)}"
               for t, g in at_budget.items()]
    if data.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement: "
                       f"{data.fidelity_ranking('fid_top1', reference, [pt['label'] for pt in points])}")
    summary.glance(CHAIN_KEY, bullets)
    summary.reasons(p.size_reason, p.budget_reason)
    report = AblationReport(p, data, reference, points, summary, out_dir)
    if p.full_grid:
        for b in budgets:
            report.grid(b)
    else:
        report.study("allocation", budgets)
        report.study("indicator", budgets)
    if p.tau1s and p.tau2s:
        for b in budgets:
            report.taus(b)
    standard_sections(summary, data, reference, out_dir, plot_name="retention_all.png",
                                      pairwise_groups=same_budget if len(same_budget) > 1 else None)
    summary.text("Budgets are CAKE's cache_size: average tokens per layer and KV head, window included.")
    summary.csv([{**{k: pt.get(k) for k in ("study", "budget", "allocation", "indicator", "tau1", "tau2")},
                  "system": pt["label"], **retention_columns(report.retention(pt["label"]))}
                 for pt in points], "points")
    summary.took(cells_seconds(metrics),
                 generation_work(p))
    return summary.write(out_dir)


EXPERIMENT = CakeAblation()
