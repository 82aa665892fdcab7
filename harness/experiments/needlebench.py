"""NeedleBench grid: S-RT / M-RT / M-RS per system, v1 / v2 overall, and length × depth heatmaps per system (CAKE F6).

Cells are ordinary accuracy cells (resumable, one per system × NeedleBench task), run through accuracy.run_cells;
this module only arranges what they stored. The per-(length, depth) score is the task summary's `len{L}_depth{d}`
(for M-RT, the hit rate of the needle placed at that depth). Overall scores follow NeedleBench: v1 = 0.4 S-RT +
0.3 M-RT + 0.3 M-RS, v2 = their plain mean (tasks.needlebench); a mode missing from the grid leaves both blank.

exp.params: budget (applied by the runner), reference (default engine-dense), task_params (per-task overrides, as in
accuracy_retention).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import plots, report
from harness.experiments import accuracy
from harness.experiments.accuracy_retention import with_task_params
from harness.runner import Cell, UserError
from tasks.needlebench import v1_overall, v2_overall

MODES = ("srt", "mrt", "mrs")
LABELS = {"srt": "S-RT", "mrt": "M-RT", "mrs": "M-RS"}
GRID_KEY = re.compile(r"^len(\d+)_depth([0-9.]+)$")


def length_depth(summary: dict) -> tuple[list[int], list[float], dict[tuple[int, float], float]]:
    """(lengths, depths, score per (length, depth)) from a NeedleBench task summary."""
    grid = {}
    for key, value in summary.items():
        m = GRID_KEY.match(key)
        if m and isinstance(value, (int, float)):
            grid[(int(m.group(1)), float(m.group(2)))] = float(value)
    return sorted({k[0] for k in grid}), sorted({k[1] for k in grid}), grid


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    bad = [c.task.name for c in cells if c.task.family != "needlebench"]
    if bad:
        raise UserError(f"the needlebench experiment takes NeedleBench tasks only; remove {sorted(set(bad))} from "
                        f"exp.tasks (use +exp=accuracy_retention for other tasks)")
    cells = with_task_params(cfg, cells)
    metrics = accuracy.run_cells(cfg, cells, out_dir)
    paths = write_summary(cfg, cells, metrics, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return metrics


def _fmt_depth(d: float) -> str:
    return f"{d:g}"


def write_summary(cfg, cells: list[Cell], metrics: list[dict], out_dir: Path) -> dict[str, str]:
    params = OmegaConf.to_container(cfg.exp.params, resolve=True)
    systems = list(dict.fromkeys(m["system"] for m in metrics))
    reference = params.get("reference") or report.reference_system(cfg, cells)
    by = {(m["system"], c.task.params.mode): m for c, m in zip(cells, metrics)}
    modes = [mode for mode in MODES if any((s, mode) in by for s in systems)]
    overall: dict[str, dict[str, float]] = {}
    for s in systems:
        sc = {mode: by[(s, mode)]["summary"]["score"] if (s, mode) in by else math.nan for mode in MODES}
        complete = all(not math.isnan(sc[mode]) for mode in MODES)
        overall[s] = {**sc, "v1": v1_overall(sc["srt"], sc["mrt"], sc["mrs"]) if complete else math.nan,
                      "v2": v2_overall(sc["srt"], sc["mrt"], sc["mrs"]) if complete else math.nan}
    key = "v1" if not math.isnan(overall[systems[0]]["v1"]) else modes[0]
    ref = overall.get(reference, {}).get(key, math.nan)
    ret = {s: overall[s][key] / ref if ref and not math.isnan(ref) else math.nan for s in systems}
    what = "v1 overall" if key == "v1" else LABELS[key]
    budget = params.get("budget")
    glance = (f"**At a glance:** NeedleBench {what} (0–100)" + (f" at a budget of {budget} tokens" if budget else "")
              + ": " + ", ".join(f"{s} {report.fmt(overall[s][key])}" + (f" ({report.fmt(ret[s], 2)}× {reference})"
                                                                          if s != reference else "")
                                 for s in systems) + ".")
    header = ["system", *[LABELS[m] for m in MODES], "v1 overall", "v2 overall", f"{what} ÷ {reference}"]
    rows = [[s, *[overall[s][m] for m in MODES], overall[s]["v1"], overall[s]["v2"], report.fmt(ret[s], 2)]
            for s in systems]
    parts = [f"# {cfg.exp.name}", "", glance, "", report.md_table(header, rows, 1), "",
             "v1 overall = 0.4 S-RT + 0.3 M-RT + 0.3 M-RS; v2 overall = their mean (blank unless all three ran).", ""]
    panels: dict[str, list] = {m: [] for m in modes}
    csv_rows = []
    for s in systems:
        csv_rows.append({"system": s, "mode": "overall", **{LABELS[m]: overall[s][m] for m in MODES},
                         "v1_overall": overall[s]["v1"], "v2_overall": overall[s]["v2"], "retention": ret[s]})
        for mode in modes:
            if (s, mode) not in by:
                continue
            lengths, depths, grid = length_depth(by[(s, mode)]["summary"])
            values = [[grid.get((L, d), math.nan) for d in depths] for L in lengths]
            panels[mode].append((s, values, lengths, [_fmt_depth(d) for d in depths]))
            parts += [f"## {s} × {LABELS[mode]}: score by context length (tokens) × needle depth (%)", "",
                      report.md_table(["length \\ depth %", *[_fmt_depth(d) for d in depths]],
                                      [[L, *row] for L, row in zip(lengths, values)], 0), ""]
            csv_rows += [{"system": s, "mode": LABELS[mode], "length": L, "depth": d, "score": grid.get((L, d))}
                         for L in lengths for d in depths]
    parts += [f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv(csv_rows))
    paths = {"md": str(md), "csv": str(csv_path)}
    for mode in modes:
        if panels[mode]:
            paths[f"png_{mode}"] = plots.heatmap_grid(
                out_dir / f"heatmap_{mode}.png", panels[mode], xlabel="needle depth (%)",
                ylabel="context length (tokens)", colorbar="score (0–100)",
                title=f"NeedleBench {LABELS[mode]} by length × depth")
    return paths
