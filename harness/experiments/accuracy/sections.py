"""The sections every accuracy summary shows: averages, the per-unit table, pairwise comparisons, the figures."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.experiments.accuracy import survival
from harness.experiments.accuracy.data import AccuracyData
from harness.reporting import plots, results_file
from harness.reporting.summary import Summary

CHAIN_KEY = ("`>` only where the paired 95 % interval of two neighbours' difference excludes 0; `≈`: this n cannot "
             "order them. `≈` is not transitive (A ≈ B ≈ C can hold with A > C): the pairwise table orders every "
             "pair by retention (and, with fidelity, pairwise.csv's `fid_top1` rows by top-1 agreement).")

DEFINITIONS = (
    "Scores are means of per-sample scores (0–100) with a 95 % bootstrap interval; retention is (policy − chance) ÷ "
    "(reference − chance) on the samples both systems ran, its interval from a paired bootstrap (samples resampled "
    "jointly for both systems; 10,000 resamples, seed 0); the macro retention averages task units and resamples "
    "within each. `>` in a ranking means the paired interval of the two systems' difference excludes 0, `≈` that "
    "this n cannot order them. Fidelity is teacher-forced on the reference's greedy output: top-1 agreement is, per "
    "sample, the share of positions where the policy's own next token equals the reference's, KL is KL(reference ‖ "
    "policy) over the full vocabulary in nats per position, both averaged over samples; Δ gold log-lik is log "
    "p(gold answer | prompt) under the policy minus under the reference (nats, tasks with one gold answer). Device "
    "KV is what a policy keeps on the device at the end of a request (resident pages × page size, tokens per layer "
    "and KV head); retrieval policies keep the whole cache and spend their budget on the pages each step reads.")


def standard_sections(summary: Summary, data: AccuracyData, reference: str | None, out_dir: Path, *,
                      units: Sequence[str] | None = None, plot_name: str = "retention.png",
                      per_unit: bool = True, pairwise_groups: Mapping[str, Sequence[str]] | None = None) -> None:
    """Averages, the per-unit table (in the CSV only when not `per_unit`), the pairwise comparisons and the
    retention / fidelity figures. `pairwise_groups` ({title: systems}) compares systems only within each group
    (e.g. policies at the same budget) instead of every pair."""
    units = list(units or data.units)
    if reference is not None and reference in data.systems:
        md, csv = data.average_table(reference, units)
        header, md, csv = survival.with_answer_kept(data, AccuracyData.AVERAGE_HEADER, md, csv, lambda c: units)
        summary.section(f"Averages over task units (reference `{reference}`)").table(header, md)
        summary.csv([{k: v for k, v in r.items() if k != "task"} for r in csv], "averages")
    md, csv = data.unit_table(reference if reference in data.systems else None, units)
    header, md, csv = survival.with_answer_kept(data, AccuracyData.UNIT_HEADER, md, csv, lambda c: [c["task"]])
    if per_unit:
        summary.section("Per task unit").table(header, md)
    summary.csv(csv, "scores")
    summary.results(results_file.unit_records(csv))
    flagged = data.flagged(reference) if reference in data.systems else []
    if flagged:
        summary.text(f"† reference less than {data.min_reference:g} points above chance: the ratio is shown but left "
                     "out of every average.")
    groups = pairwise_groups if pairwise_groups is not None else {"": [s for s in data.systems if s != reference]}
    ref = reference if reference is not None and reference in data.systems else None
    for title, systems in groups.items() if ref is not None else ():
        assert ref is not None
        md, csv = data.pairwise_table(ref, units, systems)
        if md:
            summary.section("Pairwise: difference in macro retention" + (f" ({title})" if title else "")).table(
                AccuracyData.PAIRWISE_HEADER, md)
        summary.csv([pairwise_row(r, "macro_retention", title) for r in csv], "pairwise")
        if data.has("fid_top1"):
            summary.csv([pairwise_row(r, "fid_top1", title)
                         for r in data.fidelity_pairwise("fid_top1", ref, systems, units)], "pairwise")
    summary.text(DEFINITIONS)
    if survival.has_answer_survival(data):
        summary.text(survival.DEFINITION)
    others = [s for s in data.systems if s != reference]
    if reference in data.systems and others and per_unit:
        use = [u for u in units if u not in flagged] or units
        series = {u: [data.retention(s, u, reference).value for s in others] for u in use}
        errors = {u: [(e.low, e.high) for e in (data.retention(s, u, reference) for s in others)] for u in use}
        sizes = sorted({data.n(reference, u) for u in use})
        n = f"n = {sizes[0]} samples per task unit" if len(sizes) == 1 else \
            f"n = {sizes[0]}–{sizes[-1]} samples per task unit"
        summary.image("png_retention", plots.bar_plot(
            out_dir / plot_name, others, series, errors=errors, colour_by="group", reference=1.0,
            reference_label=f"{reference} (= 1)",
            xlabel="system" + (" (bars: task units, hatched as in the legend)" if len(use) > 1 else ""),
            ylabel=f"retention vs {reference} (95 % CI)", title=f"Accuracy retention per task unit ({n})",
            note=summary.figure_note(n)), "retention")
    if reference in data.systems and others and data.has("fid_top1"):
        top1 = [data.fidelity(s, "fid_top1", units) for s in others]
        kl = [data.fidelity(s, "fid_kl", units) for s in others]
        counts = sorted({e.n for e in top1})
        n = f"n = {counts[0]} samples per system" if len(counts) == 1 else \
            f"n = {counts[0]}–{counts[-1]} samples per system"
        summary.image("png_fidelity", plots.bar_panels(
            out_dir / plot_name.replace("retention", "fidelity"), others, [
                dict(series={"top-1 agreement": [e.value for e in top1]},
                     errors={"top-1 agreement": [(e.low, e.high) for e in top1]},
                     notes={"top-1 agreement": [f"n={e.n}" for e in top1]}, reference=1.0,
                     reference_label="perfect agreement (= 1)", ylabel="top-1 agreement (share, 95 % CI)",
                     title="Top-1 agreement (higher is closer)"),
                dict(series={"KL (nats)": [e.value for e in kl]},
                     errors={"KL (nats)": [(e.low, e.high) for e in kl]},
                     ylabel=f"KL({reference} ‖ policy), nats per token (95 % CI)",
                     title="KL divergence (lower is closer; 0 = identical)")],
            xlabel="system", title=f"Teacher-forced fidelity to {reference} ({n})", note=summary.figure_note(n)),
            "fidelity")


def pairwise_row(row: dict, metric: str, group: str) -> dict:
    """One row of pairwise.csv: a paired difference of `metric` between two systems (A − B), tidy: the metric is a
    column, not a marker in the task column."""
    name = next(k for k in row if k.endswith("_difference"))
    return {"group": group or None, "metric": metric, "system": row["system"], "other": row["other"],
            "difference": row[name], "ci_low": row[f"{name}_ci_low"], "ci_high": row[f"{name}_ci_high"],
            "n": row[f"{name}_n"], "verdict": row["verdict"]}


def ruler_coverage(cells: Sequence[Any], rows_by_cell: Mapping[str, list[dict]]) -> str | None:
    """What the RULER rows of a summary average (tasks, lengths, prompt format) and that it is not RULER's published
    13-task number (tasks.ruler.coverage_of_rows); None without RULER rows."""
    from tasks.ruler import coverage_of_rows

    rows = [r for c in cells if c.task.family == "ruler" for r in rows_by_cell.get(c.key, [])]
    return coverage_of_rows(rows)["line"] if rows else None


def cells_seconds(metrics: list[dict]) -> float:
    """Wall seconds the cells spent generating and teacher-forcing, all sessions together."""
    return sum(m.get("generation_seconds", 0) + m.get("fidelity_seconds", 0) for m in metrics)
