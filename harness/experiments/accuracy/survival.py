"""The "answer kept" column of accuracy summaries: samples whose whole gold answer the heads read at decode step 1.

Rows of tasks whose gold answer sits in the context carry `answer_survival` (harness.measuring.answer_survival); a
summary over such rows gains, per system (and per task unit), the share of samples whose every gold token is read
by at least half of the (layer, KV head) pairs at the first decode step, 0–100 with its n and 95 % bootstrap
interval, and in the CSV the mean share of gold tokens a head reads. Summaries without such rows are unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from harness.experiments.accuracy.data import AccuracyData, csv_estimate
from harness.reporting import uncertainty as unc
from harness.reporting.uncertainty import Estimate

HEADER = "answer kept [95 % CI] n"
DEFINITION = (
    "Answer kept: the share of samples (0–100) whose whole gold answer — every token of every span the task marks in "
    "the context (needle values, chain variables, the paragraph to recall) — is still read at the first decode step "
    "by at least half of the (layer, KV head) pairs (held, for policies that read all they hold; the pages read, for "
    "retrieval policies), with a 95 % bootstrap interval over those samples; n counts the samples the engine could "
    "probe (systems that cannot look inside their cache, and samples that stop at their first token, have none).")


def _survival_rows(data: AccuracyData, label: str, units: Sequence[str]) -> list[dict]:
    return [r["answer_survival"] for u in units for r in data.rows.get((label, u), {}).values()
            if isinstance(r.get("answer_survival"), dict)]


def has_answer_survival(data: AccuracyData) -> bool:
    return any(isinstance(r.get("answer_survival"), dict) for per in data.rows.values() for r in per.values())


def answer_kept(data: AccuracyData, label: str, units: Sequence[str] | None = None) -> Estimate:
    """Share of the label's samples (0–100) whose whole answer at least half of the heads read."""
    return unc.mean([100.0 * bool(s["span_kept"]) for s in _survival_rows(data, label, units or data.units)])


def gold_read(data: AccuracyData, label: str, units: Sequence[str] | None = None) -> Estimate:
    """Mean over samples of the share of gold tokens a (layer, KV head) reads, averaged over heads (0–1)."""
    return unc.mean([float(np.mean(s["read"])) for s in _survival_rows(data, label, units or data.units)])


def with_answer_kept(data: AccuracyData, header: Sequence[str], md: list, csv: list[dict],
                     units_of: Callable[[dict], Sequence[str]]) -> tuple[list[str], list, list[dict]]:
    """A table (markdown rows aligned with CSV rows that name their `system`) with the answer-kept column added where
    the data has any; `units_of(csv row)` says which task units the row covers."""
    if not has_answer_survival(data):
        return list(header), md, csv
    out_md: list[Any] = []
    for row, c in zip(md, csv):
        kept = answer_kept(data, c["system"], units_of(c))
        c.update(csv_estimate(kept, "answer_kept"), **csv_estimate(gold_read(data, c["system"], units_of(c)),
                                                                  "gold_read_share"))
        out_md.append([*row, kept.fmt(1) if kept.n else "—"])
    return [*header, HEADER], out_md, csv
