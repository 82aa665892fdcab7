"""NeedleBench grid: S-RT / M-RT / M-RS per system, v1 / v2 overall, and length × depth heatmaps per system (CAKE F6).

Cells are ordinary accuracy cells (resumable, one per system × NeedleBench task), run by the accuracy kinds' driver;
this module only arranges what they stored. The per-(length, depth) score is the mean over the samples at that
cell (for M-RT, the hit rate of the needle placed at that depth). Overall scores follow NeedleBench, each under its
own version's scoring (tasks.needlebench): v1 = 0.4 S-RT + 0.3 M-RT + 0.3 M-RS of the `score_v1` values, v2 = the
plain mean of the `score` values; a mode missing from the grid leaves both blank.

exp.params: harness.running.params.AccuracyParams (budget, reference, fidelity, task_params, ...).
"""
from __future__ import annotations

import math
from typing import Any

from harness.experiments.accuracy import AccuracyExperiment, ratio
from harness.experiments.accuracy.data import AccuracyData, csv_estimate
from harness.experiments.accuracy.params import AccuracyParams
from harness.experiments.accuracy.sections import CHAIN_KEY, cells_seconds, standard_sections
from harness.reporting import plots
from harness.reporting import uncertainty as unc
from harness.reporting.summary import cell_envs, generation_work
from harness.reporting.uncertainty import Estimate
from harness.running.config import UserError
from harness.running.experiment import Run
from harness.running.grid import GridCell

MODES = ("srt", "mrt", "mrs")
LABELS = {"srt": "S-RT", "mrt": "M-RT", "mrs": "M-RS"}
V1_WEIGHTS = {"srt": 0.4, "mrt": 0.3, "mrs": 0.3}


def length_depth(rows: list[dict]) -> tuple[list[int], list[float], dict[tuple[int, float], float],
                                            dict[tuple[int, float], int]]:
    """(lengths, depths, mean score per (length, depth), samples per cell) from NeedleBench rows; an M-RT sample
    counts at the depth of each of its needles with that needle's hit."""
    values = cell_scores(rows)
    grid = {k: sum(v) / len(v) for k, v in values.items()}
    counts = {k: len(v) for k, v in values.items()}
    return sorted({k[0] for k in grid}), sorted({k[1] for k in grid}), grid, counts


def cell_scores(rows: list[dict]) -> dict[tuple[int, float], list[float]]:
    """The scores behind each (length, depth) cell (see length_depth)."""
    values: dict[tuple[int, float], list[float]] = {}
    for row in rows:
        meta = row["meta"]
        if meta["mode"] == "mrt":
            for needle in meta["needles"]:
                key = (int(meta["length"]), float(needle["depth"]))
                values.setdefault(key, []).append(row[f"hit_depth{_fmt_depth(needle['depth'])}"])
        else:
            values.setdefault((int(meta["length"]), float(meta["depth"])), []).append(row["score"])
    return values


def n_phrase(counts: list[int]) -> str:
    """`n = 5` when every cell has 5 samples, `n = 4–6` otherwise."""
    return f"n = {min(counts)}" if min(counts) == max(counts) else f"n = {min(counts)}–{max(counts)}"


def _fmt_depth(d: float) -> str:
    return f"{d:g}"


def overall(data: AccuracyData, system: str, units: dict[str, str], weights: dict[str, float],
            key: str = "score") -> Estimate:
    """A weighted mean of the modes' mean `key` scores, with a stratified bootstrap interval (NaN unless all ran)."""
    if any(not data.n(system, units.get(m, "")) for m in weights):
        return unc.NAN
    vectors = [data.vectors([system], units[m], key)[0][0] for m in weights]
    point, low, high = unc.stratified([(v,) for v in vectors],
                                      lambda us: sum(w * u[0].mean(-1) for w, u in zip(weights.values(), us)))
    return Estimate(point, low, high, sum(len(v) for v in vectors))


def write_summary(run: Run[AccuracyParams], cells: list[Any], labels: list[str], metrics: list[dict],
                  rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    reference = p.reference or labels[0]
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
    units = {c.task.params.mode: c.task.name for c in cells}
    modes = [m for m in MODES if m in units]
    v1 = {s: overall(data, s, units, V1_WEIGHTS, "score_v1") for s in data.systems}
    v2 = {s: overall(data, s, units, {m: 1 / 3 for m in MODES}) for s in data.systems}
    budget = p.budget
    summary = run.summary(envs=cell_envs(metrics))
    bullets = []
    use = set(data.usable(reference)) if reference in data.systems else set()
    if len(data.systems) > 1 and not use:
        bullets.append(f"no mode where `{reference}` scores {data.min_reference:g} above chance: no retention")
    elif len(data.systems) > 1:
        left_out = [LABELS[m] for m in modes if units[m] not in use]
        bullets.append(f"macro retention over {', '.join(LABELS[m] for m in modes if units[m] in use)} vs "
                       f"`{reference}`" + ratio.phrase(p.compression_ratio, budget, None)
                       + (f" ({', '.join(left_out)} left out: `{reference}` scores less than "
                          f"{data.min_reference:g} above chance there, see †)" if left_out else "")
                       + f": {data.ranking(reference)}")
    if len(data.systems) > 1 and data.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement: {data.fidelity_ranking('fid_top1', reference)}")
    bullets.append("v2 overall (0–100): " + ", ".join(f"{s} {v2[s].fmt(1, with_n=False)}" for s in data.systems))
    summary.glance(CHAIN_KEY, bullets)
    summary.reasons(p.size_reason, p.budget_reason, budget)
    summary.section("Overall (score 0–100, 95 % CI)").table(
        ["system", *[LABELS[m] for m in MODES], "v2 overall", "v1 overall"],
        [[s, *[data.score(s, units[m]).fmt(1) if m in units and data.n(s, units[m]) else "—" for m in MODES],
          v2[s].fmt(1), v1[s].fmt(1, with_n=False)] for s in data.systems])
    summary.text("Task columns and v2 overall use NeedleBench v2's scoring (S-RT keyword found, M-RT 100/N per "
                 "needle, M-RS exact match of the boxed answer); v2 overall is their mean. v1 overall = 0.4 S-RT + "
                 "0.3 M-RT + 0.3 M-RS under v1's scoring (S-RT Levenshtein partial credit when the keyword is "
                 "missed, M-RS the share of the answer's words). Blank unless all three modes ran.")
    summary.csv([{"system": s, **csv_estimate(v2[s], "v2_overall"), **csv_estimate(v1[s], "v1_overall")}
                 for s in data.systems], "overall")
    standard_sections(summary, data, reference, out_dir)
    for mode in modes:
        panels = []
        for s in data.systems:
            rows = list(data.rows.get((s, units[mode]), {}).values())
            if not rows:
                continue
            lengths, depths, grid, counts = length_depth(rows)
            values = [[grid.get((L, d), math.nan) for d in depths] for L in lengths]
            scores = cell_scores(rows)
            cis = {k: unc.mean(v) for k, v in scores.items()}
            notes = [[f"[{cis[(L, d)].low:.0f}, {cis[(L, d)].high:.0f}]" if (L, d) in cis else "" for d in depths]
                     for L in lengths]
            panels.append((s, values, [plots.tick_label(L) for L in lengths], [_fmt_depth(d) for d in depths],
                           notes))
            summary.section(f"{s} × {LABELS[mode]}: score by context length (tokens) × needle depth (%), "
                            f"{n_phrase(list(counts.values()))} per cell")
            summary.table(["length \\ depth %", *[_fmt_depth(d) for d in depths]],
                          [[L, *row] for L, row in zip(lengths, values)], 0)
            summary.csv([{"system": s, "task": units[mode], "mode": LABELS[mode], "length": L, "depth": d,
                          "score": grid.get((L, d)), "n": counts.get((L, d))} for L in lengths for d in depths],
                        "length_depth")
        if panels:
            n = f"{n_phrase(list(counts.values()))} samples per cell"
            summary.image(f"png_{mode}", plots.heatmap_grid(
                out_dir / f"heatmap_{mode}.png", panels, xlabel="needle depth (%)",
                ylabel="context length (tokens)", colorbar="score (0–100)",
                title=f"NeedleBench {LABELS[mode]} by length × depth ({n}; mean and 95 % CI per cell)",
                note=summary.figure_note(n)), f"heatmap {mode}")
    summary.took(cells_seconds(metrics),
                 generation_work(p))
    return summary.write(out_dir)


class NeedleBench(AccuracyExperiment[AccuracyParams]):
    def grid(self, run: Run[AccuracyParams]) -> tuple[list[GridCell], list[str]]:
        bad = [c.task.name for c in run.grid if c.task.family != "needlebench"]
        if bad:
            raise UserError(f"the needlebench experiment takes NeedleBench tasks only; remove {sorted(set(bad))} from "
                            f"exp.tasks (use +exp=accuracy_retention for other tasks)")
        return super().grid(run)

    def write_summary(self, run: Run[AccuracyParams], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        return write_summary(run, cells, labels, metrics, rows_by_cell)


EXPERIMENT = NeedleBench()
