"""Accuracy numbers with their uncertainty, from per-sample rows: scores, retention, fidelity, paired comparisons.

Every accuracy experiment reports through `AccuracyData` (one object per summary), so each number carries its n and
a 95 % bootstrap interval (harness.reporting.uncertainty) and two systems are ranked only where the paired interval
of their difference excludes 0. Definitions:

- task unit: a task, or each part its benchmark reports one number for (the task's `unit_key`: LongBench's
  datasets, L-Eval's tasks, RULER's lengths); averages give every unit the same weight, as the papers do.
- score: the mean of per-sample scores (0–100).
- retention: (policy − chance) ÷ (reference − chance) on the samples both ran, with `meta.chance_score` the score a
  content-free answer gets (recall: ROUGE-L of a random paragraph; 0 where absent). A unit whose reference score is
  less than `min_reference` above chance is flagged and left out of averages: its ratio is noise.
- macro retention: the mean of per-unit retentions (FlexiCache's average); ratio of means: mean score ÷ mean
  reference score over the same units (CAKE's).
- fidelity (harness.measuring.fidelity): top-1 agreement and KL(reference ‖ policy) per sample, averaged over all
  samples (each sample weighs the same); Δ gold log-likelihood: policy − reference, paired per sample.
- device KV: resident device pages × page size at the end of a request, per layer and KV head (the budget a policy
  really keeps; retrieval policies keep everything and spend their budget on reads).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.reporting import uncertainty as unc
from harness.reporting.uncertainty import Estimate
from tasks.base import task_class

MIN_REFERENCE = 5.0
FIDELITY = {"fid_top1": "top-1 agreement", "fid_kl": "KL(ref ‖ policy) nats"}


def unit_names(task: str, rows: Sequence[dict], key: str | None) -> dict[str, str]:
    """row id -> task unit: one unit per value of the task's unit key (meta), or the whole task when it has one
    value or the task none."""
    values = {(r.get("meta") or {}).get(key) for r in rows} if key else set()
    if len(values - {None}) > 1 and None not in values:
        return {r["id"]: f"{task}/{r['meta'][key]}" for r in rows}
    return {r["id"]: task for r in rows}


class AccuracyData:
    """Per-sample rows of every (system label, task unit), and the estimates built from them."""

    def __init__(self, cells: Sequence, labels: Sequence[str], rows_by_cell: dict[str, list[dict]],
                 min_reference: float = MIN_REFERENCE, task_name: Callable[[Any], str] | None = None,
                 unit_of: Callable[[str, dict], str] | None = None):
        """`unit_of(task name, row)` overrides how rows split into task units (e.g. RULER task × length)."""
        self.min_reference = min_reference
        self.rows: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
        self.systems: list[str] = []
        self.units: list[str] = []
        self.page_size: dict[str, int] = {}
        for cell, label in zip(cells, labels):
            system = getattr(cell, "system", None)
            page = OmegaConf.select(system, "engine.page_size") if isinstance(system, DictConfig) else None
            if page:
                self.page_size[label] = int(page)
            rows = rows_by_cell.get(cell.key, [])
            task = task_name(cell) if task_name else cell.task.name
            units = ({r["id"]: unit_of(task, r) for r in rows} if unit_of
                     else unit_names(task, rows, task_class(cell.task.family).unit_key))
            for row in rows:
                unit = units[row["id"]]
                self.rows[(label, unit)][row["id"]] = row
                if unit not in self.units:
                    self.units.append(unit)
            if label not in self.systems:
                self.systems.append(label)

    # ---- raw per-sample vectors ------------------------------------------------------------------------------
    def _paired(self, labels: Sequence[str], unit: str) -> tuple[list[str], list[dict[str, dict]]]:
        per = [self.rows.get((label, unit), {}) for label in labels]
        ids = sorted(set.intersection(*(set(p) for p in per))) if per else []
        return ids, per

    def vectors(self, labels: Sequence[str], unit: str, key: str = "score") -> tuple[list[list[float]], list[float]]:
        """Per label the `key` of every sample all labels ran (aligned by id), and the chance scores."""
        ids, per = self._paired(labels, unit)
        ids = [i for i in ids if all(_num(p[i].get(key)) for p in per)]
        values = [[float(p[i][key]) for i in ids] for p in per]
        chance = [float((per[0][i].get("meta") or {}).get("chance_score") or 0.0) for i in ids] if per else []
        return values, chance

    def n(self, label: str, unit: str) -> int:
        return len(self.rows.get((label, unit), {}))

    # ---- estimates -------------------------------------------------------------------------------------------
    def score(self, label: str, unit: str) -> Estimate:
        (values,), _ = self.vectors([label], unit)
        return unc.mean(values)

    def chance(self, label: str, unit: str) -> float:
        _, chance = self.vectors([label], unit)
        return sum(chance) / len(chance) if chance else math.nan

    def flagged(self, reference: str) -> list[str]:
        """Units whose reference score is less than min_reference above chance."""
        out = []
        for unit in self.units:
            (ref,), chance = self.vectors([reference], unit)
            if not ref or sum(ref) / len(ref) - sum(chance) / len(chance) < self.min_reference:
                out.append(unit)
        return out

    def usable(self, reference: str, units: Sequence[str] | None = None) -> list[str]:
        flagged = set(self.flagged(reference))
        return [u for u in (units or self.units) if u not in flagged]

    def retention(self, label: str, unit: str, reference: str) -> Estimate:
        (p, r), chance = self.vectors([label, reference], unit)
        return unc.retention(p, r, chance)

    def macro_retention(self, label: str, reference: str, units: Sequence[str] | None = None) -> Estimate:
        data = []
        for unit in self.usable(reference, units):
            (p, r), chance = self.vectors([label, reference], unit)
            if p:
                data.append((p, r, chance))
        return unc.macro_retention(data) if data else unc.NAN

    def ratio_of_means(self, label: str, reference: str, units: Sequence[str] | None = None) -> Estimate:
        data = []
        for unit in self.usable(reference, units):
            (p, r), _ = self.vectors([label, reference], unit)
            if p:
                data.append((p, r))
        if not data:
            return unc.NAN
        import numpy as np
        point, low, high = unc.stratified(
            data, lambda us: np.mean([p.mean(-1) for p, _ in us], 0) / np.mean([r.mean(-1) for _, r in us], 0))
        return Estimate(point, low, high, sum(len(p) for p, _ in data))

    def macro_difference(self, a: str, b: str, reference: str, units: Sequence[str] | None = None) -> Estimate:
        data = []
        for unit in self.usable(reference, units):
            (x, y, r), chance = self.vectors([a, b, reference], unit)
            if x:
                data.append((x, y, r, chance))
        return unc.macro_difference(data) if data else unc.NAN

    def fidelity(self, label: str, key: str, units: Sequence[str] | None = None) -> Estimate:
        """Mean of a per-sample fidelity field over every sample of the units."""
        values: list[float] = []
        for unit in units or self.units:
            (v,), _ = self.vectors([label], unit, key)
            values += v
        return unc.mean(values)

    def fidelity_difference(self, a: str, b: str, key: str, units: Sequence[str] | None = None) -> Estimate:
        xs: list[float] = []
        ys: list[float] = []
        for unit in units or self.units:
            (x, y), _ = self.vectors([a, b], unit, key)
            xs += x
            ys += y
        return unc.difference(xs, ys)

    def gold_delta(self, label: str, reference: str, units: Sequence[str] | None = None) -> Estimate:
        """Policy − reference log-likelihood of the gold answer (nats), paired per sample."""
        return self.fidelity_difference(label, reference, "gold_loglik", units)

    def device_kv(self, label: str, units: Sequence[str] | None = None) -> Estimate:
        """Tokens per layer and KV head resident on the device at the end of a request (pages × page size)."""
        page = self.page_size.get(label)
        values = []
        for unit in units or self.units:
            for row in self.rows.get((label, unit), {}).values():
                stats = row.get("kv_stats") or {}
                kept, pages = stats.get("kept_tokens"), stats.get("device_pages")
                if page and kept and kept[0] and isinstance(pages, (int, float)) and _num(pages):
                    values.append(pages * page / (len(kept) * len(kept[0])))
        return unc.mean(values)

    def has(self, key: str) -> bool:
        return any(_num(r.get(key)) for per in self.rows.values() for r in per.values())

    # ---- sentences and tables --------------------------------------------------------------------------------
    def ranking(self, reference: str, systems: Sequence[str] | None = None, units: Sequence[str] | None = None
                ) -> str:
        """`A 0.95 [0.90, 0.99] > B 0.80 [...] ≈ C ...`: systems by macro retention, `>` only where the paired 95 %
        interval of the adjacent difference excludes 0, `≈` where the data cannot order them."""
        systems = [s for s in (systems or self.systems) if s != reference]
        est = {s: self.macro_retention(s, reference, units) for s in systems}
        ranked = sorted((s for s in systems if _num(est[s].value)), key=lambda s: -est[s].value)
        if not ranked:
            return ""
        parts = [f"{ranked[0]} {est[ranked[0]].fmt(2, with_n=False)}"]
        for a, b in zip(ranked, ranked[1:]):
            sep = ">" if self.macro_difference(a, b, reference, units).excludes(0.0) else "≈"
            parts.append(f"{sep} {b} {est[b].fmt(2, with_n=False)}")
        return " ".join(parts)

    def fidelity_ranking(self, key: str, reference: str, systems: Sequence[str] | None = None) -> str:
        """The same chain for a fidelity field (higher top-1 / lower KL first)."""
        systems = [s for s in (systems or self.systems) if s != reference]
        est = {s: self.fidelity(s, key) for s in systems}
        sign = -1 if key == "fid_kl" else 1
        ranked = sorted((s for s in systems if _num(est[s].value)), key=lambda s: -sign * est[s].value)
        if not ranked:
            return ""
        digits = 3 if key == "fid_kl" else 2
        parts = [f"{ranked[0]} {est[ranked[0]].fmt(digits, with_n=False)}"]
        for a, b in zip(ranked, ranked[1:]):
            sep = ">" if self.fidelity_difference(a, b, key).excludes(0.0) else "≈"
            parts.append(f"{sep} {b} {est[b].fmt(digits, with_n=False)}")
        return " ".join(parts)

    def unit_table(self, reference: str | None, units: Sequence[str] | None = None) -> tuple[list, list[dict]]:
        """Markdown rows and CSV rows, one per (system, unit): n, score, retention, fidelity, Δ gold."""
        md, csv = [], []
        flagged = set(self.flagged(reference)) if reference else set()
        for unit in units or self.units:
            for s in self.systems:
                if not self.n(s, unit):
                    continue
                score = self.score(s, unit)
                ret = self.retention(s, unit, reference) if reference and s != reference else None
                fid = {k: self.fidelity(s, k, [unit]) for k in FIDELITY}
                gold = self.gold_delta(s, reference, [unit]) if reference and s != reference else None
                md.append([s, f"{unit} †" if unit in flagged else unit, score.n, score.fmt(1, with_n=False),
                           ret.fmt(2) if ret else "—", fid["fid_top1"].fmt(3, with_n=False),
                           fid["fid_kl"].fmt(3, with_n=False), gold.fmt(2, with_n=False) if gold else "—"])
                csv.append({"system": s, "task": unit, "n": score.n, "score": score.value,
                            "score_ci_low": score.low, "score_ci_high": score.high,
                            "chance": self.chance(s, unit), "reference": reference,
                            **(csv_estimate(ret, "retention") if ret
                               else {"retention": 1.0 if s == reference else None}),
                            "flagged_small_reference": unit in flagged,
                            **{f: v for k, e in fid.items() for f, v in csv_estimate(e, k).items()},
                            **(csv_estimate(gold, "gold_loglik_delta") if gold else {})})
        return md, csv

    UNIT_HEADER = ["system", "task", "n", "score [95 % CI]", "retention [95 % CI] n", "top-1 agreement",
                   "KL (nats)", "Δ gold log-lik"]

    def average_table(self, reference: str, units: Sequence[str] | None = None) -> tuple[list, list[dict]]:
        md, csv = [], []
        use = self.usable(reference, units)
        for s in self.systems:
            macro = self.macro_retention(s, reference, use) if s != reference else None
            rom = self.ratio_of_means(s, reference, use) if s != reference else None
            fid = {k: self.fidelity(s, k, units) for k in FIDELITY}
            gold = self.gold_delta(s, reference, units) if s != reference else None
            kv = self.device_kv(s, units)
            md.append([s, macro.fmt(2) if macro else "1 (reference)", rom.fmt(2, with_n=False) if rom else "—",
                       fid["fid_top1"].fmt(3), fid["fid_kl"].fmt(3, with_n=False),
                       gold.fmt(2) if gold else "—", f"{kv.value:.0f}" if _num(kv.value) else "—"])
            csv.append({"system": s, "task": "AVERAGE", "units_used": len(use), "reference": reference,
                        **(csv_estimate(macro, "retention") if macro else {"retention": 1.0}),
                        **(csv_estimate(rom, "ratio_of_means") if rom else {}),
                        **{f: v for k, e in fid.items() for f, v in csv_estimate(e, k).items()},
                        **(csv_estimate(gold, "gold_loglik_delta") if gold else {}),
                        **csv_estimate(kv, "device_kv_tokens")})
        return md, csv

    AVERAGE_HEADER = ["system", "macro retention [95 % CI] n", "ratio of means", "top-1 agreement n", "KL (nats)",
                      "Δ gold log-lik n", "device KV (tokens / layer·head)"]

    def pairwise_table(self, reference: str, units: Sequence[str] | None = None,
                       systems: Sequence[str] | None = None) -> tuple[list, list[dict]]:
        """Every pair of non-reference systems (of `systems`, default all): difference in macro retention, paired,
        and what it supports."""
        systems = [s for s in (systems or self.systems) if s != reference]
        md, csv = [], []
        for i, a in enumerate(systems):
            for b in systems[i + 1:]:
                d = self.macro_difference(a, b, reference, units)
                if not _num(d.value):
                    continue
                verdict = (f"{a} keeps more" if d.low > 0 else f"{b} keeps more") if d.excludes(0) else \
                    "indistinguishable at this n"
                md.append([a, b, d.fmt(3), verdict])
                csv.append({"system": a, "other": b, **csv_estimate(d, "retention_difference"), "verdict": verdict})
        return md, csv

    def fidelity_pairwise(self, key: str, reference: str | None, systems: Sequence[str] | None = None,
                          units: Sequence[str] | None = None) -> list[dict]:
        """CSV rows: every pair of non-reference systems (of `systems`), the paired difference in a fidelity field."""
        systems = [s for s in (systems or self.systems) if s != reference]
        rows = []
        for i, a in enumerate(systems):
            for b in systems[i + 1:]:
                d = self.fidelity_difference(a, b, key, units)
                if _num(d.value):
                    rows.append({"system": a, "other": b, **csv_estimate(d, f"{key}_difference"),
                                 "verdict": (f"{a if d.low > 0 else b} higher" if d.excludes(0)
                                             else "indistinguishable at this n")})
        return rows

    PAIRWISE_HEADER = ["system A", "system B", "A − B macro retention [95 % CI] n", "supported ordering"]


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def same_budget(labels: Sequence[str]) -> dict[str, list[str]]:
    """{"budget B": the `<system>@B` labels} for every budget two or more policies share: policies are compared at
    equal budget, since a pair across budgets says nothing about either policy."""
    groups: dict[str, list[str]] = defaultdict(list)
    for label in dict.fromkeys(labels):
        if "@" in label:
            groups[f"budget {label.rsplit('@', 1)[1]}"].append(label)
    return {t: g for t, g in groups.items() if len(g) > 1}


def csv_estimate(e: Estimate, name: str) -> dict[str, Any]:
    return {name: e.value, f"{name}_ci_low": e.low, f"{name}_ci_high": e.high, f"{name}_n": e.n}
