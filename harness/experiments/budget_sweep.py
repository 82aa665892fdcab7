"""Score and fidelity vs KV budget: every budgeted policy at every budget, one curve per policy, dense as a band.

The figure KV-compression papers lead with (CAKE F5; the kvpress leaderboard): each policy with a `budget` runs at
every budget of exp.params.budgets (labelled `<system>@<budget>`), the budget-free reference once, all on the same
samples. Plotted against the budget: the mean score over task units with its 95 % interval (error bars), the
reference's score as a horizontal band with its interval, and the teacher-forced top-1 agreement and KL with the
reference. Budgets mean what each policy's own paper means (eviction: tokens kept per layer and KV head;
retrieval: tokens read per step and KV head; LServe: per retrieval head, its streaming heads keep sink + local).

exp.params: budgets (list of token budgets), reference (default engine-dense), min_reference_score, fidelity,
task_params (as accuracy_retention), contexts ({task name: context tokens}, to state budgets as a share of the
context), size_reason.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from harness import accuracy_report, plots
from harness import uncertainty as unc
from harness.accuracy_report import AccuracyData
from harness.experiments import accuracy
from harness.experiments.accuracy_retention import by_budget, with_task_params
from harness.runner import Cell, UserError
from harness.store import Cell as StoreCell
from harness.summary import Summary, print_paths
from harness.uncertainty import Estimate

SYSTEM_DEFAULTS = accuracy.SYSTEM_DEFAULTS


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    budgets = cfg.exp.params.get("budgets")
    if not budgets:
        raise UserError("budget_sweep needs exp.params.budgets, a list of token budgets (e.g. [128,512,1024])")
    cells = with_task_params(cfg, cells)
    cells, labels = by_budget(cfg, cells, list(budgets))
    reference = accuracy_report.reference_label(cfg, labels) or labels[0]
    if reference not in labels:
        raise UserError(f"reference {reference!r} is not in the grid: add it to exp.systems or set exp.params.reference")
    metrics = accuracy.run_cells(cfg, cells, out_dir, labels, reference)
    rows_by_cell = {c.key: StoreCell(out_dir / c.key).rows() for c in cells}
    print_paths(write_summary(cfg, cells, labels, metrics, rows_by_cell, out_dir))
    return metrics


def mean_score(data: AccuracyData, label: str, units: list[str]) -> Estimate:
    """The unweighted mean over units of the label's mean score, with a stratified interval."""
    vectors = [data.vectors([label], u)[0][0] for u in units if data.n(label, u)]
    if len(vectors) < len(units):
        return unc.NAN
    point, low, high = unc.stratified([(v,) for v in vectors], lambda us: np.mean([u[0].mean(-1) for u in us], 0))
    return Estimate(point, low, high, sum(len(v) for v in vectors))


def write_summary(cfg, cells: list[Cell], labels: list[str], metrics: list[dict], rows_by_cell: dict,
                  out_dir: Path) -> dict[str, str]:
    params = OmegaConf.to_container(cfg.exp.params, resolve=True)
    reference = params.get("reference") or accuracy_report.reference_label(cfg, labels) or labels[0]
    data = AccuracyData(cells, labels, rows_by_cell, float(params.get("min_reference_score", 5.0)))
    units = data.usable(reference) or data.units
    budgets = sorted({int(b) for b in params["budgets"]})
    policies = list(dict.fromkeys(label.split("@")[0] for label in labels if "@" in label))
    at = {p: {b: f"{p}@{b}" for b in budgets if f"{p}@{b}" in data.systems} for p in policies}
    score = {label: mean_score(data, label, units) for label in data.systems}
    top1 = {label: data.fidelity(label, "fid_top1", units) for label in data.systems}
    kl = {label: data.fidelity(label, "fid_kl", units) for label in data.systems}
    ref = score[reference]
    summary = Summary(cfg)
    bullets = []
    for p in policies:
        reach = next((b for b, label in at[p].items() if np.isfinite(score[label].value) and (
            score[label].value >= ref.value or not data.macro_difference(label, reference, reference, units)
            .excludes(0.0))), None)
        bullets.append(f"{p}: " + ", ".join(f"{b} → {score[label].fmt(1, with_n=False)}" for b, label in at[p].items())
                       + (f"; within the noise of {reference} from {reach} tokens" if reach else
                          f"; below {reference} at every budget"))
    summary.glance(f"mean score (0–100, 95 % CI) over {', '.join(units)} vs budget; `{reference}` scores "
                   f"{ref.fmt(1)}:", bullets)
    if params.get("size_reason"):
        summary.text(f"**Why this size:** {params['size_reason']}")
    grid_tasks = {c.task.name for c in cells}
    contexts = {t: n for t, n in (params.get("contexts") or {}).items() if t in grid_tasks}
    if contexts:
        summary.text("Budgets as a share of the context: " + "; ".join(
            f"{t} ({n} tokens): " + ", ".join(f"{b} = {100 * b / n:.0f} %" for b in budgets)
            for t, n in contexts.items()) + ".")
    series = {p: [(b, score[label].value) for b, label in at[p].items()] for p in policies}
    errors = {p: [(b, score[label].low, score[label].high) for b, label in at[p].items()] for p in policies}
    panels = [dict(series=series, errors=errors, band=(reference, ref.value, ref.low, ref.high), logx=True,
                   ylabel="mean score (0–100, 95 % CI)", title="Task score vs budget")]
    if data.has("fid_top1"):
        panels.append(dict(series={p: [(b, top1[label].value) for b, label in at[p].items()] for p in policies},
                           errors={p: [(b, top1[label].low, top1[label].high) for b, label in at[p].items()]
                                   for p in policies}, logx=True, hline=1.0,
                           ylabel=f"top-1 agreement with {reference} (95 % CI)",
                           title="Teacher-forced fidelity vs budget"))
    summary.image("png_budget", plots.line_panels(
        out_dir / "score_vs_budget.png", panels, "KV budget (tokens per layer and KV head, log scale)",
        f"{cfg.exp.name}: n = {ref.n} samples per point"), "score and fidelity vs budget")
    summary.section("Score, retention and fidelity per policy and budget").table(
        ["policy", *[f"budget {b}" for b in budgets]],
        [[p, *[f"{score[at[p][b]].fmt(1, with_n=False)} · ret {data.macro_retention(at[p][b], reference, units).fmt(2, with_n=False)} · "
               f"top-1 {top1[at[p][b]].fmt(2, with_n=False)} · KL {kl[at[p][b]].fmt(3, with_n=False)}"
               if b in at[p] else "—" for b in budgets]] for p in policies])
    summary.text("Each entry: mean score [95 % CI] · macro retention vs the reference [CI] · top-1 agreement [CI] · "
                 "KL(reference ‖ policy) [CI].")
    summary.csv([{"system": p, "budget": b, "task": "MEAN", **score[label].as_dict("score_"),
                  **data.macro_retention(label, reference, units).as_dict("retention_"),
                  **top1[label].as_dict("top1_"), **kl[label].as_dict("kl_")}
                 for p in policies for b, label in at[p].items()]
                + [{"system": reference, "budget": None, "task": "MEAN", **ref.as_dict("score_")}])
    accuracy_report.standard_sections(summary, data, reference, out_dir, per_unit=False)
    summary.took(sum(m.get("generation_seconds", 0) + m.get("fidelity_seconds", 0) for m in metrics),
                 "generation + fidelity, every cell")
    return summary.write(out_dir)
