"""Accuracy retention: per-task scores of every system and their ratio to the dense reference, averaged as papers do.

Two averages per system, because the two papers differ: FlexiCache reports the macro mean of per-task ratios
(policy ÷ dense on each task, then the mean), CAKE the ratio of the mean scores. A task whose reference score is
below `min_reference_score` (0–100) makes its ratio meaningless (0.5 ÷ 0.2 = 2.5×); it is flagged and left out of
the macro mean, but kept in the tables. Multi-part tasks count one unit per part their benchmark reports (LongBench
and L-Eval per dataset, RULER per length: the mean over its tasks).

exp.params: budget (shared token budget, applied by the runner) or budgets (a list: every policy with a budget runs
at each, labelled `<system>@<budget>`, beside one run of each budget-free system), reference (system name; default
engine-dense),
min_reference_score (default 5.0), task_params ({task name: {param: value}}: per-task overrides that
system_overrides / task_overrides cannot express, e.g. shorter NeedleBench lengths at CPU scale).
"""
from __future__ import annotations

from typing import Any

from harness.experiments.accuracy import AccuracyExperiment, ratio
from harness.experiments.accuracy.data import AccuracyData, same_budget
from harness.experiments.accuracy.params import AccuracyParams
from harness.experiments.accuracy.sections import CHAIN_KEY, cells_seconds, standard_sections
from harness.reporting.summary import cell_envs, generation_work
from harness.running.cells import StoredCell
from harness.running.config import UserError
from harness.running.experiment import Run
from harness.running.grid import budget_label, budgets_left_out

# per-request policy statistics averaged into the summary when a policy reports them (Completion.kv_stats)
POLICY_STATS = {"promoted_share_of_topk": "promoted share of top-K / rerank"}


def policy_stats(cells: list[Any], rows_by_cell: dict[str, list[dict]], labels: list[str]) -> dict[str, dict]:
    """label -> {stat: mean over the label's requests} for the POLICY_STATS a policy reports."""
    values: dict[str, dict[str, list[float]]] = {}
    for cell, label in zip(cells, labels):
        for row in rows_by_cell.get(cell.key, []):
            for stat in POLICY_STATS:
                v = (row.get("kv_stats") or {}).get(stat)
                if isinstance(v, (int, float)):
                    values.setdefault(label, {}).setdefault(stat, []).append(float(v))
    return {label: {k: sum(v) / len(v) for k, v in per.items()} for label, per in values.items()}


class AccuracyRetention(AccuracyExperiment[AccuracyParams]):
    def label_of(self, stored: StoredCell) -> str:
        """A finished cell's label in its own run (`system@budget` in a budget sweep)."""
        return budget_label(stored.system, ((stored.config.get("exp") or {}).get("params") or {}).get("budgets"))

    def write_summary(self, run: Run[AccuracyParams], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        return write_summary(run, cells, labels, metrics, rows_by_cell)


def write_summary(run: Run[AccuracyParams], cells: list[Any], labels: list[str], metrics: list[dict],
                  rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    reference = p.reference or labels[0]
    if reference not in labels:
        raise UserError(f"reference system {reference!r} is not in the grid {sorted(set(labels))}: add it to "
                        f"exp.systems or set exp.params.reference")
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
    use = data.usable(reference)
    at = ratio.phrase(p.compression_ratio, p.budget, p.budgets)
    summary = run.summary(envs=cell_envs(metrics))
    n_ref = sum(data.n(reference, u) for u in use)
    groups = same_budget(data.systems) if p.budgets else None
    bullets = [f"macro retention vs `{reference}`{at}, over {len(use)} of {len(data.units)} task units "
               f"({n_ref} samples)" + (": " + data.ranking(reference, units=use) if groups is None else "")]
    bullets += [f"at {title}: {data.ranking(reference, group, use)}" for title, group in (groups or {}).items()]
    if data.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement with `{reference}`: "
                       f"{data.fidelity_ranking('fid_top1', reference)}")
        bullets.append(f"KL({reference} ‖ policy), nats per token: {data.fidelity_ranking('fid_kl', reference)}")
    summary.glance(CHAIN_KEY, bullets)
    summary.reasons(p.size_reason, p.budget_reason, p.budget)
    left_out = budgets_left_out(cells, labels, p.budgets) if p.budgets else []
    if left_out:
        summary.text("Not run, the policy cannot run at that budget: " + "; ".join(left_out) + ".")
    standard_sections(summary, data, reference, out_dir, pairwise_groups=groups)
    stats = policy_stats(cells, rows_by_cell, labels)
    shown = [k for k in POLICY_STATS if any(k in per for per in stats.values())]
    if shown:
        summary.section("Policy statistics").table(
            ["system", *[POLICY_STATS[k] for k in shown]],
            [[s, *[stats.get(s, {}).get(k) for k in shown]] for s in data.systems if s in stats], 3)
        summary.csv([{"system": s, **v} for s, v in stats.items()], "policy_stats")
    summary.text("Macro retention = mean over task units of each unit's retention (FlexiCache's average); ratio of "
                 "means = mean score ÷ mean reference score (CAKE's). Same samples, prompts and greedy decoding for "
                 "every system; engine systems decode batch-invariantly.")
    summary.took(cells_seconds(metrics),
                 generation_work(p))
    return summary.write(out_dir)


EXPERIMENT = AccuracyRetention()
