"""Score and fidelity vs KV budget: every budgeted policy at every budget, one curve per policy, dense as a band.

The figure KV-compression papers lead with (CAKE F5; the kvpress leaderboard): each policy with a `budget` runs at
every budget of exp.params.budgets (labelled `<system>@<budget>`), the budget-free reference once, all on the same
samples. Plotted against the budget: the mean score over task units with its 95 % interval (error bars), the
reference's score as a horizontal band with its interval, beside it the share of samples whose gold answer the
heads still read at the first decode step (tasks that mark their answer in the context; accuracy.survival), and the
teacher-forced top-1 agreement and KL with the reference. A RULER grid says what its average covers
(tasks.ruler.coverage_of_rows): not RULER's published 13-task number. Budgets mean what each policy's own paper
means (eviction: tokens kept per layer and KV head; retrieval: tokens read per step and KV head; LServe: per
retrieval head, its streaming heads keep sink + local).

exp.params: budgets (list of token budgets), reference (default engine-dense), min_reference_score, fidelity,
task_params (as accuracy_retention), contexts ({task name: context tokens}, to state budgets as a share of the
context), size_reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.experiments.accuracy import AccuracyExperiment, survival
from harness.experiments.accuracy.data import AccuracyData, csv_estimate, same_budget
from harness.experiments.accuracy.params import REPORT_PARAMS, AccuracyParams
from harness.experiments.accuracy.sections import CHAIN_KEY, cells_seconds, ruler_coverage, standard_sections
from harness.reporting import plots
from harness.reporting import uncertainty as unc
from harness.reporting.summary import cell_envs, generation_work
from harness.reporting.uncertainty import Estimate
from harness.running.cells import StoredCell
from harness.running.config import UserError
from harness.running.experiment import Run
from harness.running.grid import GridCell, budget_label, budgets_left_out


@dataclass
class Params(AccuracyParams):
    contexts: dict[str, int] = field(default_factory=dict)   # {task name: context tokens}: budgets as a share


class BudgetSweep(AccuracyExperiment[Params]):
    params_type = Params
    report_params = REPORT_PARAMS | {"contexts"}

    def grid(self, run: Run[Params]) -> tuple[list[GridCell], list[str]]:
        if not run.params.budgets:
            raise UserError("budget_sweep needs exp.params.budgets, a list of token budgets (e.g. [128,512,1024])")
        if run.params.reference is None:
            raise UserError("budget_sweep needs exp.params.reference, the system every curve is compared with")
        return super().grid(run)

    def label_of(self, stored: StoredCell) -> str:
        return budget_label(stored.system, [1])

    def write_summary(self, run: Run[Params], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        return write_summary(run, cells, labels, metrics, rows_by_cell)


def mean_score(data: AccuracyData, label: str, units: list[str]) -> Estimate:
    """The unweighted mean over units of the label's mean score, with a stratified interval."""
    vectors = [data.vectors([label], u)[0][0] for u in units if data.n(label, u)]
    if len(vectors) < len(units):
        return unc.NAN
    point, low, high = unc.stratified([(v,) for v in vectors], lambda us: np.mean([u[0].mean(-1) for u in us], 0))
    return Estimate(point, low, high, sum(len(v) for v in vectors))


def write_summary(run: Run[Params], cells: list[Any], labels: list[str], metrics: list[dict],
                  rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
    cfg, p, out_dir = run.cfg, run.params, run.out_dir
    reference = p.reference or labels[0]
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
    units = data.usable(reference) or data.units
    budgets = sorted({int(b) for b in p.budgets or []})
    policies = list(dict.fromkeys(label.split("@")[0] for label in labels if "@" in label))
    at = {pol: {b: f"{pol}@{b}" for b in budgets if f"{pol}@{b}" in data.systems} for pol in policies}
    score = {label: mean_score(data, label, units) for label in data.systems}
    # fidelity does not depend on the reference's score: every unit counts, as in the averages table and fidelity.png
    top1 = {label: data.fidelity(label, "fid_top1") for label in data.systems}
    kl = {label: data.fidelity(label, "fid_kl") for label in data.systems}
    ref = score[reference]
    summary = run.summary(envs=cell_envs(metrics))
    bullets = []
    for pol in policies:
        reach = next((b for b, label in at[pol].items() if np.isfinite(score[label].value) and (
            score[label].value >= ref.value or not data.macro_difference(label, reference, reference, units)
            .excludes(0.0))), None)
        bullets.append(f"{pol}: "
                       + ", ".join(f"{b} → {score[label].fmt(1, with_n=False)}" for b, label in at[pol].items())
                       + (f"; within the noise of {reference} from {reach} tokens" if reach else
                          f"; below {reference} at every budget"))
    at_one_budget = same_budget(data.systems)
    for title, group in at_one_budget.items():
        chain = data.ranking(reference, group, units)
        if chain:
            bullets.append(f"macro retention at {title}: {chain}")
    kept = {label: survival.answer_kept(data, label, units) for label in data.systems}
    has_kept = survival.has_answer_survival(data)
    if has_kept:
        bullets.append("answer kept (samples whose whole gold answer half of the heads read at decode step 1, "
                       "0–100): " + "; ".join(f"{pol} " + ", ".join(f"{b} → {kept[label].fmt(0, with_n=False)}"
                                                                for b, label in at[pol].items()) for pol in policies)
                       + f"; {reference} {kept[reference].fmt(0)}")
    coverage = ruler_coverage(cells, rows_by_cell)
    if coverage:
        bullets.append(coverage)
    summary.glance(f"mean score (0–100, 95 % CI) over {', '.join(units)} vs budget; `{reference}` scores "
                   f"{ref.fmt(1)}. In the rankings at one budget, {CHAIN_KEY}", bullets)
    summary.reasons(p.size_reason, p.budget_reason, p.budget)
    grid_tasks = {c.task.name for c in cells}
    contexts = {t: n for t, n in p.contexts.items() if t in grid_tasks}
    if contexts:
        summary.text("Budgets as a share of the context: " + "; ".join(
            f"{t} ({n} tokens): " + ", ".join(f"{b} = {100 * b / n:.0f} %" for b in budgets)
            for t, n in contexts.items()) + ".")
    left_out = budgets_left_out(cells, labels, budgets)
    if left_out:
        summary.text("Not run, the policy cannot run at that budget: " + "; ".join(left_out) + ".")
    series = {pol: [(b, score[label].value) for b, label in at[pol].items()] for pol in policies}
    errors = {pol: [(b, score[label].low, score[label].high) for b, label in at[pol].items()] for pol in policies}
    missing = ("not run (the policy cannot run at that budget): " + "; ".join(x.split(" (")[0] for x in left_out)
               if left_out else None)
    panels = [dict(series=series, errors=errors, band=(reference, ref.value, ref.low, ref.high), logx=True,
                   dodge=True, footnote=missing, ylabel="mean score (0–100, 95 % CI)", title="Task score vs budget")]
    if has_kept:
        k_ref = kept[reference]
        panels.append(dict(series={pol: [(b, kept[label].value) for b, label in at[pol].items()] for pol in policies},
                           errors={pol: [(b, kept[label].low, kept[label].high) for b, label in at[pol].items()]
                                   for pol in policies}, band=(reference, k_ref.value, k_ref.low, k_ref.high),
                           logx=True, dodge=True, ylabel="answer kept: % of samples (95 % CI)",
                           title="Whole answer read by ≥ half the heads at decode step 1"))
    if data.has("fid_top1"):
        panels.append(dict(series={pol: [(b, top1[label].value) for b, label in at[pol].items()] for pol in policies},
                           errors={pol: [(b, top1[label].low, top1[label].high) for b, label in at[pol].items()]
                                   for pol in policies}, logx=True, hline=1.0, dodge=True,
                           ylabel=f"top-1 agreement with {reference} (95 % CI)",
                           title="Teacher-forced fidelity vs budget"))
    n = f"n = {ref.n} samples per point"
    summary.image("png_budget", plots.line_panels(
        out_dir / "score_vs_budget.png", panels, "KV budget (tokens per layer and KV head, log scale; points nudged "
        "apart)", f"{cfg.exp.name}: {n}", note=summary.figure_note(n)),
        "score, answer kept and fidelity vs budget" if has_kept else "score and fidelity vs budget")
    summary.section("Score, retention and fidelity per policy and budget").table(
        ["policy", *[f"budget {b}" for b in budgets]],
        [[pol, *[f"{score[at[pol][b]].fmt(1, with_n=False)} · "
               f"ret {data.macro_retention(at[pol][b], reference, units).fmt(2, with_n=False)} · "
               f"top-1 {top1[at[pol][b]].fmt(2, with_n=False)} · KL {kl[at[pol][b]].fmt(3, with_n=False)}"
               + (f" · kept {kept[at[pol][b]].fmt(0, with_n=False)}" if has_kept else "")
               if b in at[pol] else "—" for b in budgets]] for pol in policies])
    summary.text("Each entry: mean score [95 % CI] · macro retention vs the reference [CI] · top-1 agreement [CI] · "
                 "KL(reference ‖ policy) [CI]" + (" · answer kept (% of samples) [CI]." if has_kept else "."))
    csv = csv_estimate
    summary.csv([{"system": pol, "budget": b, **csv(score[label], "score"),
                  **csv(data.macro_retention(label, reference, units), "retention"),
                  **csv(top1[label], "fid_top1"), **csv(kl[label], "fid_kl"),
                  **(csv(kept[label], "answer_kept") if has_kept else {})}
                 for pol in policies for b, label in at[pol].items()]
                + [{"system": reference, "budget": None, **csv(ref, "score"),
                    **(csv(kept[reference], "answer_kept") if has_kept else {})}], "budget_curve")
    # policies are compared at equal budget: a pair across budgets says nothing about either policy
    standard_sections(summary, data, reference, out_dir, per_unit=False, pairwise_groups=at_one_budget)
    summary.took(cells_seconds(metrics),
                 generation_work(p))
    return summary.write(out_dir)


EXPERIMENT = BudgetSweep()
