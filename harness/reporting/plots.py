"""Shared matplotlib figures for experiment summaries: line plots, bars, heatmaps and heatmap grids, saved as PNG.

Conventions every figure follows: one fixed colour per system across all figures (`colour`); a missing value is
left out, never drawn as 0; error bars where a value has an interval, nudged apart (`dodge`) so neighbours do not hide
each other; ratio plots draw their y = 1 line; legends sit outside the axes, so no legend covers a line; log axes
are ticked at the data's own values in plain numbers (1k, 2k; 32, 128), never 2⁶ or 6×10¹; colour scales span the
data unless the caller fixes them; `note` (every summary passes its n, budget and machine class:
Summary.figure_note) is printed under the figure; labels are laid out so none is clipped.
"""
from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.reporting.tables import finite

Series = Mapping[str, Sequence[tuple[float, float]]]                 # label -> [(x, y), ...]
Errors = Mapping[str, Sequence[tuple[float, float, float]]]          # label -> [(x, low, high), ...]

# A system's colour is a hash of its name into a fixed palette: the same in every figure and run, for any system,
# with no list of names to keep. SALT is the first that gives every system of conf/system its own colour
# (tests/test_experiments_summaries.py checks it; a new system that collides moves SALT on).
_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
            "#e6550d", "#31a354", "#756bb1", "#636363", "#1b9e77", "#d95f02", "#7570b3", "#e7298a",
            "#66a61e", "#e6ab02", "#a6761d", "#000080", "#808000", "#008080", "#800000", "#ff1493"]
SALT = 135


def colour(label: str) -> str:
    """The fixed colour of a system; `system@budget` labels (and `system ...` variants) take their system's colour."""
    base = str(label).split("@")[0].split(" ")[0]
    return _PALETTE[int(hashlib.sha1(f"{SALT}:{base}".encode()).hexdigest(), 16) % len(_PALETTE)]


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    h = hex_colour.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def _distance(a: str, b: str) -> float:
    return math.dist(_rgb(a), _rgb(b))


NEAR = 120.0        # RGB distance under which two colours read as one on a small figure (two greens, two blues)


def figure_colours(labels: Sequence[str]) -> dict[str, str]:
    """Each label's colour in one figure: its system's fixed colour (`system@budget` labels share it), unless that
    reads as the colour of another system drawn before it (the palette has near neighbours); then the palette
    colour farthest from those in use."""
    by_system: dict[str, str] = {}
    for label in labels:
        system = str(label).split("@")[0].split(" ")[0]
        if system in by_system:
            continue
        mine = colour(system)
        used = list(dict.fromkeys(by_system.values()))
        if used and min(_distance(mine, c) for c in used) < NEAR:
            mine = max(_PALETTE, key=lambda c: min(_distance(c, u) for u in used))
        by_system[system] = mine
    return {label: by_system[str(label).split("@")[0].split(" ")[0]] for label in labels}


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")        # headless: summaries are written on machines without a display
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, path: Path, note: str | None = None) -> str:
    if note:                                   # under everything drawn; bbox "tight" grows the canvas to hold it
        lowest = fig.get_tightbbox(fig.canvas.get_renderer()).y0 / fig.get_figheight()
        fig.text(0.5, lowest - 0.01, note, ha="center", va="top", fontsize=7, wrap=True, color="#333333")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole under a name of this process, then renamed: readers never see half a PNG, and two runs that
    # finish together (sharing a reference cell) never rename each other's file away
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")  # tight: long tick labels and colourbars are never clipped
    tmp.replace(path)
    _pyplot().close(fig)
    return str(path)


def line_plot(path: Path, series: Series, xlabel: str, ylabel: str, title: str, note: str | None = None,
              **kwargs: Any) -> str:
    """One line per label (markers at the points, error bars from `errors`, nudged apart on x with `dodge`);
    `dashed` adds reference lines (e.g. analytic bounds) in the colour of the solid series of the same label, with
    black × markers at their points so they stay visible where they coincide with the measured line; `band` =
    (label, value, low, high) draws a horizontal line with its shaded interval (a reference system's score);
    `hline` a thin line (y = 1 on ratio plots); `ymin` pins the y axis's bottom (0 for times and rates);
    `footnote` is printed in the axes' lower corner (e.g. which systems are missing where)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    _lines(ax, series, xlabel, ylabel, title, **kwargs)
    return _save(fig, path, note)


def line_panels(path: Path, panels: Sequence[dict], xlabel: str, title: str, note: str | None = None) -> str:
    """Side-by-side line plots sharing x (each panel: series, ylabel, title and line_plot's keyword options)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.6 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        panel = dict(panel)
        _lines(ax, panel.pop("series"), xlabel, panel.pop("ylabel"), panel.pop("title"), legend_below=True, **panel)
    fig.suptitle(title)
    return _save(fig, path, note)


def tick_label(x: float) -> str:
    """A tick in plain numbers: 1024 -> 1k, 2048 -> 2k, 4000 -> 4k, 32 -> 32, 0.5 -> 0.5."""
    for unit in (1024, 1000):
        if x >= unit and x % unit == 0:
            return f"{x / unit:g}k"
    return f"{x:g}"


def _shift(x: float, i: int, n: int, logx: bool, span: float) -> float:
    """Series i of n nudged sideways around x, so error bars at one x stay apart (log axes: a factor)."""
    offset = (i - (n - 1) / 2) * 0.035
    return x * (2 ** offset) if logx else x + offset * span


def _lines(ax: Any, series: Series, xlabel: str, ylabel: str, title: str, *,
           dashed: Series | None = None, dashed_label: str = "analytic count (×, dashed)", logx: bool = False,
           logy: bool = False, errors: Errors | None = None, band: tuple[str, float, float, float] | None = None,
           hline: float | None = None, colours: Mapping[str, str] | None = None, dodge: bool = False,
           ymin: float | None = None, footnote: str | None = None, legend_below: bool = False) -> None:
    own = figure_colours([str(label) for label in series])

    def pick(label: str) -> str:
        return (colours or {}).get(label) or own.get(label) or colour(label)

    for label, pts in (dashed or {}).items():
        pts = sorted((x, y) for x, y in pts if finite(y))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=(0, (6, 3)), linewidth=2.2, alpha=0.45,
                    color=pick(label), zorder=1)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="none", marker="x", markersize=6,
                    color="black", zorder=4)
    if dashed:
        ax.plot([], [], linestyle=(0, (6, 3)), marker="x", linewidth=2.2, alpha=0.6, color="grey", label=dashed_label)
    if band is not None and finite(band[1]):
        name, value, low, high = band
        ax.axhline(value, color=pick(name), linewidth=1.2, label=f"{name} (95 % CI shaded)", zorder=2)
        if finite(low) and finite(high):
            ax.axhspan(low, high, color=pick(name), alpha=0.15, zorder=0)
    if hline is not None:
        ax.axhline(hline, color="black", linewidth=0.8, linestyle=":", zorder=1)
    drawn = [label for label, pts in series.items() if any(finite(y) for _, y in pts)]
    all_x = sorted({float(x) for pts in series.values() for x, y in pts if finite(y)})
    span = (all_x[-1] - all_x[0]) if len(all_x) > 1 else 1.0
    for i, (label, pts) in enumerate(series.items()):
        pts = sorted((x, y) for x, y in pts if finite(y))
        if not pts:
            continue
        k = drawn.index(label)

        def at(x: float) -> float:
            return _shift(x, k, len(drawn), logx, span) if dodge else x   # noqa: B023 - used at once
        marker = "osD^vP*X"[i % 8]
        ax.plot([at(p[0]) for p in pts], [p[1] for p in pts], marker=marker, markersize=4.5, label=label,
                color=pick(label), zorder=3)
        bars = [(x, lo, hi) for x, lo, hi in (errors or {}).get(label, ()) if finite(lo) and finite(hi)]
        if bars:
            ys = dict(pts)
            xs = [x for x, _, _ in bars if x in ys]
            ax.errorbar([at(x) for x in xs], [ys[x] for x in xs],
                        yerr=[[max(0.0, ys[x] - lo) for x, lo, _ in bars if x in ys],
                              [max(0.0, hi - ys[x]) for x, _, hi in bars if x in ys]],
                        fmt="none", ecolor=pick(label), elinewidth=0.9, capsize=2.5, alpha=0.8, zorder=3)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
        _plain_ticks(ax.yaxis)
    if logx and all_x:                # ticks at the data's own x values, in plain numbers
        ax.set_xticks(all_x, [tick_label(x) for x in all_x])
        ax.xaxis.set_minor_locator(_pyplot().NullLocator())
    if ymin is not None:
        ax.set_ylim(bottom=ymin)
    if footnote:
        ax.text(0.01, 0.01, footnote, transform=ax.transAxes, fontsize=6.5, va="bottom", ha="left", color="#444444",
                wrap=True)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    _legend_outside(ax, below=legend_below)


def _plain_ticks(axis: Any) -> None:
    """Plain numbers on a log axis at 1, 2 and 5 of each decade (60, not 6×10¹)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v > 0 else ""))
    axis.set_minor_formatter(NullFormatter())


def _legend_outside(ax: Any, below: bool = False, **kwargs: Any) -> None:
    """The legend off the axes (right of them; below them in side-by-side panels, where the right is the next
    panel): inside, it would sit on a line (the y = 1 reference, a band)."""
    if not (ax.get_legend_handles_labels()[0] or kwargs.get("handles")):
        return
    if below:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, borderaxespad=0.0, **kwargs)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def _draw_heatmap(ax: Any, values: Sequence[Sequence[float]], row_labels: Sequence, col_labels: Sequence,
                  vmin: float | None, vmax: float | None, cmap: str, digits: int,
                  notes: Sequence[Sequence[str]] | None = None) -> Any:
    import numpy as np
    data = np.array([[v if finite(v) else np.nan for v in row] for row in values], dtype=float)
    if vmin is None or vmax is None:            # fit the scale to the data (a fixed 0..1.2 hides ratios above it)
        measured = data[np.isfinite(data)]
        lo, hi = (float(measured.min()), float(measured.max())) if measured.size else (0.0, 1.0)
        vmin = lo if vmin is None else vmin
        vmax = (hi if hi > vmin else vmin + 1.0) if vmax is None else vmax
    masked = np.ma.masked_invalid(data)         # missing cells stay blank (grey), not coloured as 0
    image = ax.imshow(masked, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    ax.set_facecolor("#eeeeee")
    ax.set_xticks(range(len(col_labels)), [str(c) for c in col_labels], fontsize=7)
    ax.set_yticks(range(len(row_labels)), [str(r) for r in row_labels], fontsize=7)
    span = (vmax - vmin) or 1.0
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if not np.isnan(v):
                frac = (v - vmin) / span
                dark = frac < 0.2 or frac > 0.85          # the dark ends of a diverging map
                text = f"{v:.{digits}f}" + (f"\n{notes[i][j]}" if notes and notes[i][j] else "")
                ax.text(j, i, text, ha="center", va="center", fontsize=6, color="white" if dark else "black")
    return image


def heatmap(path: Path, values: Sequence[Sequence[float]], row_labels: Sequence, col_labels: Sequence, *,
            xlabel: str, ylabel: str, title: str, colorbar: str, vmin: float | None = None,
            vmax: float | None = None, cmap: str = "RdYlGn", digits: int = 0,
            notes: Sequence[Sequence[str]] | None = None, note: str | None = None) -> str:
    """One annotated heatmap (rows top to bottom in the given order); NaN cells stay blank; `notes` adds a second
    line per cell (e.g. its n or interval)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(col_labels) + 2.5), max(3.0, 0.5 * len(row_labels) + 1.5)))
    image = _draw_heatmap(ax, values, row_labels, col_labels, vmin, vmax, cmap, digits, notes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=colorbar)
    return _save(fig, path, note)


def heatmap_grid(path: Path, panels: Sequence[tuple], *, xlabel: str, ylabel: str, title: str, colorbar: str,
                 vmin: float = 0.0, vmax: float = 100.0, cmap: str = "RdYlGn", ncols: int = 3, digits: int = 0,
                 note: str | None = None) -> str:
    """Several heatmaps on one shared colour scale: panels are (panel title, values, row labels, column labels) with
    an optional fifth entry, a second line per cell (its interval or n)."""
    plt = _pyplot()
    n = max(1, len(panels))
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.8 * ncols + 1, 3.0 * nrows + 0.6), squeeze=False,
                             layout="constrained")     # keeps panel labels and the shared colourbar apart
    image = None
    for ax, (name, values, rows, cols, *cell_notes) in zip(axes.flat, panels):
        image = _draw_heatmap(ax, values, rows, cols, vmin, vmax, cmap, digits, cell_notes[0] if cell_notes else None)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label=colorbar, shrink=0.8)
    return _save(fig, path, note)


def bar_plot(path: Path, groups: Sequence[str], series: Mapping[str, Sequence[float]], *, xlabel: str,
             ylabel: str, title: str, reference: float | None = None, reference_label: str = "reference",
             errors: Mapping[str, Sequence[tuple[float, float]]] | None = None, colour_by: str = "series",
             notes: Mapping[str, Sequence[str]] | None = None, note: str | None = None) -> str:
    """Grouped bars: one group per entry of `groups`, one bar per series label, error bars from `errors` (per series,
    (low, high) per group); missing values leave a gap. `colour_by="group"` colours bars by their group label (use
    when the groups are systems; series are then told apart by hatching, and the legend shows the hatches, not a
    system's colour); `reference` draws a labelled horizontal line; `notes` prints text (e.g. n) over each bar."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(groups) * max(1, len(series)) / 2 + 3.5), 4.8))
    _bars(ax, groups, series, errors=errors, colour_by=colour_by, notes=notes, reference=reference,
          reference_label=reference_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return _save(fig, path, note)


def bar_panels(path: Path, groups: Sequence[str], panels: Sequence[dict], *, xlabel: str, title: str,
               colour_by: str = "group", note: str | None = None) -> str:
    """Side-by-side bar charts over the same groups, each on its own y axis (quantities in different units: a
    fraction and nats never share one); each panel: series, ylabel, title and bar_plot's errors / notes /
    reference / reference_label."""
    plt = _pyplot()
    width = max(4.5, 0.5 * len(groups) + 2.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        panel = dict(panel)
        ylabel, sub_title = panel.pop("ylabel"), panel.pop("title")
        _bars(ax, groups, panel.pop("series"), colour_by=colour_by, legend_below=True, **panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(sub_title, fontsize=10)
    fig.suptitle(title)
    return _save(fig, path, note)


def _bars(ax: Any, groups: Sequence[str], series: Mapping[str, Sequence[float]], *,
          errors: Mapping[str, Sequence[tuple[float, float]]] | None = None, colour_by: str = "series",
          notes: Mapping[str, Sequence[str]] | None = None, reference: float | None = None,
          reference_label: str = "reference", legend_below: bool = False) -> None:
    from matplotlib.patches import Patch

    width = 0.8 / max(1, len(series))
    hatches = ["", "//", "..", "xx", "\\\\", "oo"]
    handles = []
    own = figure_colours(list(groups) if colour_by == "group" else list(series))
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        keep = [j for j, v in enumerate(vals) if finite(v)]
        by_group = colour_by == "group"
        colours = [own[groups[j]] if by_group else own[label] for j in keep]
        hatch = hatches[i % len(hatches)] if by_group else ""
        ax.bar([xs[j] for j in keep], [vals[j] for j in keep], width=width, color=colours, edgecolor="white",
               hatch=hatch)
        handles.append(Patch(facecolor="#dddddd" if by_group else own[label], edgecolor="#555555", hatch=hatch,
                             label=label))
        errs = (errors or {}).get(label)
        if errs:
            ok = [j for j in keep if finite(errs[j][0]) and finite(errs[j][1])]
            ax.errorbar([xs[j] for j in ok], [vals[j] for j in ok],
                        yerr=[[max(0.0, vals[j] - errs[j][0]) for j in ok],
                              [max(0.0, errs[j][1] - vals[j]) for j in ok]],
                        fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
        for j in keep:
            text = (notes or {}).get(label, [None] * len(groups))[j]
            if text:
                ax.annotate(text, (xs[j], 0), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=5.5,
                            rotation=90, va="bottom")
    if reference is not None:
        line = ax.axhline(reference, color="black", linewidth=0.8, linestyle=":", label=reference_label)
        handles.append(line)
    ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    # one swatch per series only when the series are not the colours (by group: the hatch tells series apart)
    shown = handles if len(series) > 1 or reference is not None else []
    if len(series) == 1 and colour_by == "group":
        shown = [h for h in shown if not isinstance(h, Patch)]
    if shown:
        _legend_outside(ax, below=legend_below, handles=shown)
