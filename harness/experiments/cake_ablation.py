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

import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import plots, report
from harness.experiments import accuracy
from harness.experiments.accuracy_retention import variant, with_task_params
from harness.runner import Cell, UserError, validate
from systems.policies import load_policy

DEFAULTS = {"budgets": [128], "allocations": ["preference", "uniform", "pyramid", "random"],
            "indicators": ["mean_plus_var", "mean", "var", "mean_times_var"], "full_grid": False,
            "tau1s": [], "tau2s": [], "base": {"allocation": "preference", "indicator": "mean_plus_var"},
            "reference": None, "task_params": {}, "template_params": {}}


def points(p: dict) -> list[dict]:
    """Ablation points (dicts of cake params plus the study they belong to), without duplicates."""
    base = p["base"]
    out: list[dict] = []
    for budget in p["budgets"]:
        combos = []
        if p["full_grid"]:
            combos += [("grid", a, i, None, None) for a in p["allocations"] for i in p["indicators"]]
        else:
            combos += [("allocation", a, base["indicator"], None, None) for a in p["allocations"]]
            combos += [("indicator", base["allocation"], i, None, None) for i in p["indicators"]]
        combos += [("tau", base["allocation"], base["indicator"], float(t1), float(t2))
                   for t1 in p["tau1s"] for t2 in p["tau2s"]]
        for study, a, i, t1, t2 in combos:
            out.append({"study": study, "budget": int(budget), "allocation": a, "indicator": i, "tau1": t1,
                        "tau2": t2})
    return out


def _default_taus(cell: Cell, point: dict) -> tuple[float, float]:
    """The taus the template resolves to at this point (its own, or CAKE's table): a tau point equal to them is the
    base point, run once."""
    params = {**OmegaConf.to_container(cell.system.params, resolve=True), **point}
    return tuple(float(t) for t in load_policy(cell.system.policy, params).taus)


def expand(cfg: DictConfig, cells: list[Cell], p: dict) -> tuple[list[Cell], list[dict]]:
    """Reference cells as they are, plus one cell per (CAKE template cell, ablation point); validated."""
    templates = [c for c in cells if c.system.policy == "cake"]
    if not templates:
        raise UserError("cake_ablation needs a CAKE system in exp.systems (e.g. cake) as the template")
    out_cells, tags = [], []
    for c in cells:
        if c.system.policy != "cake":
            out_cells.append(c)
            tags.append({"study": "reference", "budget": None})
    seen = set()
    for c in templates:
        for pt in points(p):
            params = {**p["template_params"], **{k: pt[k] for k in ("budget", "allocation", "indicator")}}
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
    validate(cfg, out_cells)
    return out_cells, tags


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    p = {**DEFAULTS, **OmegaConf.to_container(cfg.exp.params, resolve=True)}
    if not p["budgets"]:
        raise UserError("exp.params.budgets must list at least one CAKE budget (tokens per layer)")
    cells = with_task_params(cfg, cells)
    cells, tags = expand(cfg, cells, p)
    metrics = accuracy.run_cells(cfg, cells, out_dir)
    paths = write_summary(cfg, cells, tags, metrics, p, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return metrics


def _matches(row: dict, study: str, want: dict) -> bool:
    """Whether a row is the point `want` of `study` (run for it, or run for another study with the same params)."""
    if row["study"] == study:
        return all(row[k] == v for k, v in want.items())
    if study not in row.get("also", []):
        return False
    if study == "tau":
        return [want["tau1"], want["tau2"]] in row.get("tau_alias", [])
    return all(row[k] == v for k, v in want.items())


def write_summary(cfg, cells, tags, metrics, p: dict, out_dir: Path) -> dict[str, str]:
    ref_name = p["reference"] or report.reference_system(cfg, cells)
    rows = [{**t, "system": m["system"], "score": m["summary"].get("score"), "cell": c.key}
            for c, t, m in zip(cells, tags, metrics)]
    ref = [r["score"] for r in rows if r["study"] == "reference" and r["system"] == ref_name]
    ref_score = ref[0] if ref else math.nan
    for r in rows:
        r["retention"] = r["score"] / ref_score if ref_score and not math.isnan(ref_score) else math.nan
    budgets = [int(b) for b in p["budgets"]]
    base = p["base"]

    def score(budget, study, **want):
        hits = [r["score"] for r in rows if r["budget"] == budget and _matches(r, study, want)]
        return hits[0] if hits else math.nan

    parts = [f"# {cfg.exp.name}", ""]
    is_default = lambda r: r["allocation"] == base["allocation"] and r["indicator"] == base["indicator"]  # noqa
    cake_rows = [r for r in rows if r["study"] != "reference" and r["tau1"] is None]
    best = max(cake_rows, key=lambda r: r["score"] if r["score"] is not None else -1, default=None)
    defaults = {r["budget"]: r["score"] for r in cake_rows if is_default(r)}
    glance = f"**At a glance:** `{ref_name}` scores {report.fmt(ref_score)}; CAKE (preference + mean+var) " + \
        ", ".join(f"{report.fmt(defaults.get(b))} at budget {b}" for b in budgets)
    if best is not None:
        glance += (f"; best point {best['allocation']} + {best['indicator']} at budget {best['budget']}: "
                   f"{report.fmt(best['score'])}")
    parts += [glance + " (NeedleBench score, 0–100).", ""]
    paths: dict[str, str] = {}
    studies = (["grid"] if p["full_grid"] else ["allocation", "indicator"])
    for study in studies:
        if study == "grid":
            for b in budgets:
                vals = [[score(b, "grid", allocation=a, indicator=i) for i in p["indicators"]]
                        for a in p["allocations"]]
                parts += [f"## Allocation × indicator at budget {b} (CAKE F8; T2/T3 are its row/column)", "",
                          report.md_table(["allocation \\ indicator", *p["indicators"]],
                                          [[a, *v] for a, v in zip(p["allocations"], vals)], 1), ""]
                paths[f"png_grid_{b}"] = plots.heatmap(
                    out_dir / f"allocation_x_indicator_b{b}.png", vals, p["allocations"], p["indicators"],
                    xlabel="eviction indicator", ylabel="budget allocation", colorbar="NeedleBench score (0–100)",
                    title=f"CAKE ablation at {b} tokens/layer", vmin=0, vmax=100)
            continue
        axis = "allocations" if study == "allocation" else "indicators"
        fixed = (f"indicator {base['indicator']}" if study == "allocation" else f"allocation {base['allocation']}")
        table = [[x, *[score(b, study, **{study: x}) for b in budgets]] for x in p[axis]]
        parts += [f"## {study.capitalize()} study ({fixed}; CAKE {'T2' if study == 'allocation' else 'T3'})", "",
                  report.md_table([study, *[f"budget {b}" for b in budgets]], table, 1), ""]
        paths[f"png_{study}"] = plots.bar_plot(
            out_dir / f"{study}.png", [str(x) for x in p[axis]],
            {f"budget {b}": [score(b, study, **{study: x}) for x in p[axis]] for b in budgets},
            xlabel=study, ylabel="NeedleBench score (0–100)", reference=ref_score, reference_label=ref_name,
            title=f"CAKE {study} ablation ({fixed})")
    if p["tau1s"] and p["tau2s"]:
        for b in budgets:
            vals = [[score(b, "tau", tau1=float(t1), tau2=float(t2)) for t2 in p["tau2s"]] for t1 in p["tau1s"]]
            parts += [f"## tau1 × tau2 at budget {b} (CAKE F13; {base['allocation']} + {base['indicator']})", "",
                      report.md_table(["tau1 \\ tau2", *[f"{t:g}" for t in p["tau2s"]]],
                                      [[f"{t1:g}", *v] for t1, v in zip(p["tau1s"], vals)], 1), ""]
            paths[f"png_tau_{b}"] = plots.heatmap(
                out_dir / f"tau_sweep_b{b}.png", vals, p["tau1s"], p["tau2s"], xlabel="tau2 (variance exponent 1/τ2)",
                ylabel="tau1 (entropy exponent 1/τ1)", colorbar="NeedleBench score (0–100)",
                title=f"CAKE tau sweep at {b} tokens/layer", vmin=0, vmax=100)
    parts += [f"Scores are the task's overall NeedleBench score; retention (in summary.csv) is score ÷ `{ref_name}`. "
              "Budgets are CAKE's cache_size: average tokens per layer and KV head, window included.", "",
              f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    csv_rows = [{k: r.get(k) for k in ("study", "system", "task", "budget", "allocation", "indicator", "tau1", "tau2",
                                        "score", "retention", "cell")} for r in rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv(csv_rows))
    return {"md": str(md), "csv": str(csv_path), **paths}
