"""RULER: every system on RULER's tasks and lengths; RULER's table per system and retention vs the reference.

Cells are ordinary accuracy cells (one per system × RULER task config), run by the accuracy kinds' driver with
teacher-forced fidelity. The summary reports what RULER's README table reports — the per-task score at each length,
the per-length average over tasks, and the average over lengths — with 95 % bootstrap intervals, plus each policy's
retention vs the reference per length (ratio of the length averages, paired over samples) and the macro retention
over lengths with its supported ranking, and a line saying what its average covers (tasks, lengths, prompt format)
and that it is not RULER's published 13-task number. Every score and retention interval, ranking and pairwise
difference uses RULER's own unit, one length (the mean over its tasks), resampling samples within it: a task ×
length cell holds a handful of samples, and retentions of such cells are noise. (Fidelity pools every sample,
whatever its length.)

exp.params: budget (shared token budget, applied by the runner), reference (default engine-dense),
min_reference_score, fidelity, task_params (as accuracy_retention), size_reason (why the grid is this size).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.experiments.accuracy import AccuracyExperiment
from harness.experiments.accuracy.data import AccuracyData, csv_estimate
from harness.experiments.accuracy.params import AccuracyParams
from harness.experiments.accuracy.ratio import phrase as budget_phrase
from harness.experiments.accuracy.sections import CHAIN_KEY, cells_seconds, ruler_coverage, standard_sections
from harness.reporting import plots
from harness.reporting import uncertainty as unc
from harness.reporting.summary import cell_envs, generation_work
from harness.reporting.uncertainty import Estimate
from harness.running.config import UserError
from harness.running.experiment import Run
from harness.running.grid import GridCell


def task_length(task: str, row: dict) -> str:
    """RULER's unit: one task at one length."""
    return f"{row['meta']['ruler_task']}@{row['meta']['length']}"


def _grid(data: AccuracyData) -> tuple[list[str], list[int]]:
    pairs = [u.split("@") for u in data.units]
    return list(dict.fromkeys(t for t, _ in pairs)), sorted({int(L) for _, L in pairs})


def length_unit(task: str, row: dict) -> str:
    """RULER's reporting unit: every RULER task at one length (the average RULER's table shows)."""
    return f"ruler/{row['meta']['length']}"


def over_lengths(data: AccuracyData, system: str, units: Sequence[str]) -> Estimate:
    """Unweighted mean over lengths of each length's mean score, resampling samples within each length."""
    vectors = [data.vectors([system], u)[0][0] for u in units if data.n(system, u)]
    if not vectors or len(vectors) < len(units):
        return unc.NAN
    point, low, high = unc.stratified([(v,) for v in vectors], lambda us: np.mean([u[0].mean(-1) for u in us], 0))
    return Estimate(point, low, high, sum(len(v) for v in vectors))


def balanced(data: AccuracyData, tasks: Sequence[str], lengths: Sequence[int]) -> bool:
    """Whether every system ran as many samples of each task at a length (then a length's mean over its samples
    is RULER's mean over tasks)."""
    return all(len({data.n(s, f"{t}@{L}") for t in tasks}) == 1 for s in data.systems for L in lengths)


def write_summary(run: Run[AccuracyParams], cells: list[Any], labels: list[str], metrics: list[dict],
                  rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    reference = p.reference or labels[0]
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score, unit_of=task_length)
    by_length = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score, unit_of=length_unit)
    tasks, lengths = _grid(data)
    unit = {L: f"ruler/{L}" for L in lengths}
    # every figure per length comes from by_length, so a number has one interval wherever it appears (tables, CSV,
    # and the > / ≈ verdicts, which resample samples within a length)
    avg = {s: {**{L: by_length.score(s, unit[L]) for L in lengths},
               "all": over_lengths(by_length, s, list(unit.values()))} for s in data.systems}
    others = [s for s in data.systems if s != reference]
    flagged = set(by_length.flagged(reference)) if reference in data.systems else set()
    ratio = {s: {**{L: by_length.retention(s, unit[L], reference) for L in lengths},
                 "all": by_length.macro_retention(s, reference)} for s in others}
    budget = p.budget
    summary = run.summary(envs=cell_envs(metrics))
    bullets = [f"RULER average ({len(tasks)} tasks × {len(lengths)} lengths, 0–100): "
               + ", ".join(f"{s} {avg[s]['all'].fmt(1, with_n=False)}" for s in data.systems)]
    coverage = ruler_coverage(cells, rows_by_cell)
    if coverage:
        bullets.append(coverage)
    if others:
        bullets.append(f"macro retention vs `{reference}` over lengths"
                       + budget_phrase(p.compression_ratio, budget, None) + f": {by_length.ranking(reference)}")
    if others and by_length.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement: {by_length.fidelity_ranking('fid_top1', reference)}")
    summary.glance(CHAIN_KEY, bullets)
    summary.reasons(p.size_reason, p.budget_reason, p.budget)
    summary.section("RULER average per length (mean over its samples, 0–100, 95 % CI)").table(
        ["system", *[f"{L}" for L in lengths], "average", "n"],
        [[s, *[avg[s][L].fmt(1, with_n=False) for L in lengths], avg[s]["all"].fmt(1, with_n=False),
          avg[s]["all"].n] for s in data.systems])
    summary.text("Every task has the same number of samples at each length, so a length's mean over its samples is "
                 "RULER's mean over tasks." if balanced(data, tasks, lengths) else
                 "Tasks have unequal sample counts at some length: a length's mean over its samples weights tasks by "
                 "their counts, unlike RULER's mean over tasks.")
    if others:
        summary.section(f"Retention per length: average ÷ `{reference}`'s on the same samples (95 % CI)").table(
            ["system", *[f"{L} †" if unit[L] in flagged else f"{L}" for L in lengths], "macro over lengths"],
            [[s, *[ratio[s][L].fmt(2, with_n=False) for L in lengths], ratio[s]["all"].fmt(2)] for s in others])
    summary.csv([{"system": s, **csv_estimate(avg[s]["all"], "score")} for s in data.systems], "ruler_average")
    panels = []
    for s in data.systems:
        values = [[data.score(s, f"{t}@{L}").value if data.n(s, f"{t}@{L}") else math.nan for L in lengths]
                  for t in tasks]
        summary.section(f"{s}: RULER table (score per task and length, 0–100)").table(
            ["task", *[f"{L}" for L in lengths], "mean"],
            [[t, *row, float(np.nanmean(row)) if any(math.isfinite(v) for v in row) else math.nan]
             for t, row in zip(tasks, values)]
            + [["average", *[avg[s][L].value for L in lengths], avg[s]["all"].value]], 1)
        panels.append((s, values, tasks, [plots.tick_label(L) for L in lengths]))
        summary.csv([{"system": s, "task": t, "length": L, "score": v, "n": data.n(s, f"{t}@{L}")}
                     for t, row in zip(tasks, values) for L, v in zip(lengths, row)], "ruler_table")
    per_cell = sorted({data.n(s, u) for s in data.systems for u in data.units if data.n(s, u)})
    n_cell = f"n = {per_cell[0]}" if len(per_cell) == 1 else f"n = {per_cell[0]}–{per_cell[-1]}"
    summary.image("png_heatmap", plots.heatmap_grid(
        out_dir / "ruler_heatmap.png", panels, xlabel="length (tokens)", ylabel="RULER task",
        colorbar="score (0–100)", title=f"RULER score per task × length ({n_cell} samples per cell)", ncols=3,
        note=summary.figure_note(f"{n_cell} samples per task × length cell")), "RULER heatmap")
    if others:
        n_len = sorted({ratio[s][L].n for s in others for L in lengths if ratio[s][L].n})
        n_text = f"n = {n_len[0]}" if len(n_len) == 1 else f"n = {n_len[0]}–{n_len[-1]}" if n_len else "n = 0"
        summary.image("png_retention_length", plots.line_plot(
            out_dir / "retention_vs_length.png", {s: [(L, ratio[s][L].value) for L in lengths] for s in others},
            "context length (tokens; points nudged apart)", f"RULER average ÷ {reference} (95 % CI)",
            f"Retention vs context length ({n_text} paired samples per point)",
            errors={s: [(L, ratio[s][L].low, ratio[s][L].high) for L in lengths] for s in others}, logx=True,
            hline=1.0, dodge=True, note=summary.figure_note(f"{n_text} paired samples per point")),
            "retention vs length")
    standard_sections(summary, by_length, reference, out_dir, per_unit=False)
    summary.took(cells_seconds(metrics),
                 generation_work(p))
    return summary.write(out_dir)


class Ruler(AccuracyExperiment[AccuracyParams]):
    def grid(self, run: Run[AccuracyParams]) -> tuple[list[GridCell], list[str]]:
        bad = sorted({c.task.name for c in run.grid if c.task.family != "ruler"})
        if bad:
            raise UserError(f"the ruler experiment takes RULER tasks only; remove {bad} from exp.tasks")
        return super().grid(run)

    def write_summary(self, run: Run[AccuracyParams], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        return write_summary(run, cells, labels, metrics, rows_by_cell)


EXPERIMENT = Ruler()
