"""The summary across models: per model the retention table, the rank agreement (Kendall τ), flips, a figure."""
from __future__ import annotations

import math
from typing import Any

from harness.experiments.accuracy.data import AccuracyData, csv_estimate
from harness.experiments.accuracy.sections import cells_seconds
from harness.experiments.model_transfer import transfer
from harness.experiments.model_transfer.transfer import ModelScores
from harness.reporting import plots
from harness.reporting.summary import cell_envs
from harness.reporting.uncertainty import NAN, Estimate
from harness.running.config import UserError
from harness.running.experiment import Run

Found = tuple[list[Any], list[str], list[dict], dict[str, list[dict]]]      # cells, labels, metrics, rows


def model_scores(data: AccuracyData, policies: list[str], reference: str) -> ModelScores:
    """The policies' and the reference's per-sample scores on the units where the reference is above chance."""
    import numpy as np

    units = []
    for unit in data.usable(reference):
        values, chance = data.vectors([*policies, reference], unit)
        if values and values[0]:
            units.append((np.asarray(values[:-1], dtype=float), np.asarray(values[-1], dtype=float),
                          np.asarray(chance, dtype=float)))
    return ModelScores(list(policies), units)


def _fmt(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "—"


def dense_vs_chance(data: AccuracyData, reference: str, margin: float) -> str:
    """Per unit the reference's score beside chance, and whether it is `margin` points above it."""
    parts = []
    for unit in data.units:
        score, chance = data.score(reference, unit), data.chance(reference, unit)
        if not data.n(reference, unit):
            continue
        well = math.isfinite(score.value) and score.value - chance >= margin
        parts.append(f"{unit} {score.fmt(1)} vs chance {chance:.1f}"
                     + ("" if well else f" — NOT {margin:g} points above chance: its retentions say little"))
    return "; ".join(parts) or "no samples"


def write(run: Run[Any], found: dict[str, Found]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    reference = p.reference
    if reference is None:
        raise UserError("model_transfer needs exp.params.reference, the system each retention divides by")
    datas = {m: AccuracyData(cells, labels, rows, p.min_reference_score) for m, (cells, labels, _, rows) in
             found.items()}
    models = list(datas)
    if len(models) < 2:
        raise UserError(f"model_transfer compares models, but only {models} have finished cells under {out_dir}: "
                        "run every model of exp.models first")
    missing = [m for m in models if reference not in datas[m].systems]
    if missing:
        raise UserError(f"no finished `{reference}` cells on {missing}: the reference runs on every model")
    first = datas[models[0]]
    policies = [s for s in first.systems if s != reference and all(s in d.systems for d in datas.values())]
    draws = {m: transfer.draw(model_scores(d, policies, reference)) for m, d in datas.items()}
    a, b = models[:2]
    tau = transfer.tau(draws[a], draws[b]) if len(policies) >= 2 else NAN
    flips = transfer.flips(policies, {a: draws[a], b: draws[b]}) if len(policies) >= 2 else []
    supported = [f for f in flips if f.supported]

    def est(m: str, i: int, what: str) -> Estimate:
        d = draws[m]
        point, values = ((d.retention[i], d.retention_draws[:, i]) if what == "retention" else
                         (d.score[i], d.score_draws[:, i]))
        return transfer.estimate(point, values, d.n)

    metrics = [x for f in found.values() for x in f[2]]
    summary = run.summary(envs=cell_envs(metrics))
    def ranked(m: str) -> list[int]:
        r = draws[m].retention
        return sorted(range(len(policies)), key=lambda i: -float(r[i]) if math.isfinite(r[i]) else math.inf)

    order = {m: ranked(m) for m in models}
    bullets = [f"{m}: `{reference}` scores {dense_vs_chance(datas[m], reference, p.well_above_chance)}; retention "
               "order " + " > ".join(f"{policies[i]} {_fmt(draws[m].retention[i])}" for i in order[m]) for m in models]
    bullets.append(f"flipped pairs (order on {a} reversed on {b}): {len(flips)} of "
                   f"{len(policies) * (len(policies) - 1) // 2}; with both models' paired 95 % intervals excluding 0: "
                   + (", ".join(f"{f.a} vs {f.b}" for f in supported) if supported else "none"))
    summary.glance(f"Kendall τ between the retention rankings of {len(policies)} policies on {a} and {b}: "
                   f"{tau.fmt(2, with_n=False)} (95 % bootstrap interval over each model's samples; 1 = the same "
                   "order, 0 = unrelated, −1 = reversed).", bullets)
    summary.reasons(p.size_reason, p.budget_reason, p.budget)
    for m in models:
        ref_score = transfer.estimate(draws[m].reference, draws[m].reference_draws, draws[m].n)
        summary.section(f"{m}: score and retention vs `{reference}` (95 % paired bootstrap intervals)").table(
            ["system", "score (0–100)", f"retention (÷ {reference})", "n"],
            [[reference, ref_score.fmt(1, with_n=False), "1", ref_score.n]]
            + [[s, est(m, i, "score").fmt(1, with_n=False), est(m, i, "retention").fmt(2, with_n=False),
                est(m, i, "retention").n] for i, s in enumerate(policies)])
        summary.csv([{"model": m, "system": s, **csv_estimate(est(m, i, "score"), "score"),
                      **csv_estimate(est(m, i, "retention"), "retention")} for i, s in enumerate(policies)],
                    "retention")
    summary.text("Retention = (policy − chance) ÷ (reference − chance) on the same samples, macro over the task units "
                 f"where `{reference}` is at least {p.min_reference_score:g} points above chance; each interval "
                 "resamples the model's samples within each unit, with the same draws for every system.")
    summary.section(f"Rank agreement: {a} vs {b}")
    summary.text(f"Kendall τ-b (scipy.stats.kendalltau) of the {len(policies)} policies' retentions: "
                 f"{tau.fmt(3, with_n=False)}. Each bootstrap draw resamples both models' samples (each model on its "
                 "own: their prompts differ) and recomputes every retention and τ.")
    summary.csv([{"model_a": a, "model_b": b, "policies": len(policies), **csv_estimate(tau, "tau")}], "tau")
    if flips:
        summary.table(["pair", f"retention difference on {a}", f"on {b}", "both intervals exclude 0"],
                      [[f"{f.a} vs {f.b}", f.difference[a].fmt(2, with_n=False), f.difference[b].fmt(2, with_n=False),
                        "yes" if f.supported else "no"] for f in flips])
        summary.csv([{"a": f.a, "b": f.b, **{k: v for m in (a, b) for k, v in
                                                 csv_estimate(f.difference[m], f"diff_{m}").items()},
                      "supported": f.supported} for f in flips], "flips")
    else:
        summary.text("No pair of policies is ordered one way on one model and the other way on the other.")
    n = f"n = {', '.join(f'{draws[m].n} ({m})' for m in models)} paired samples per bar"
    summary.image("png_transfer", plots.bar_plot(
        out_dir / "retention_by_model.png", policies,
        {m: [draws[m].retention[i] for i in range(len(policies))] for m in models},
        xlabel="policy", ylabel=f"retention (÷ {reference}, 95 % CI)", reference=1.0, reference_label=reference,
        errors={m: [(est(m, i, "retention").low, est(m, i, "retention").high) for i in range(len(policies))]
                for m in models},
        title=f"Retention per policy on each model (Kendall τ = {tau.fmt(2, with_n=False)})",
        note=summary.figure_note(n)), "retention per policy, one colour per model")
    summary.took(cells_seconds(metrics), "generation, every model's cells")
    return summary.write(out_dir)
