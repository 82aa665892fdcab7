"""Shared matplotlib figures for experiment summaries: line plots, heatmaps and heatmap grids, saved as PNG."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

Series = Mapping[str, Sequence[tuple[float, float]]]   # label -> [(x, y), ...]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")        # headless: summaries are written on machines without a display
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")  # written whole, then renamed: readers never see half a PNG
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    _pyplot().close(fig)
    return str(path)


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def line_plot(path: Path, series: Series, xlabel: str, ylabel: str, title: str, *,
              dashed: Series | None = None, dashed_label: str = "analytic (dashed)", logx: bool = False,
              logy: bool = False) -> str:
    """One line per label (markers at the points); `dashed` adds reference lines (e.g. analytic bounds) in the
    same colour as the solid series of the same label, or grey when there is none."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {}
    for label, pts in series.items():
        pts = sorted((x, y) for x, y in pts if _finite(y))
        if pts:
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            colours[label] = line.get_color()
    named = False
    for label, pts in (dashed or {}).items():
        pts = sorted((x, y) for x, y in pts if _finite(y))
        if pts:     # one legend entry for all dashed lines: each takes its solid series' colour
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="--", linewidth=1,
                    color=colours.get(label, "grey"), label=None if named else dashed_label)
            named = True
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def _draw_heatmap(ax, values, row_labels, col_labels, vmin, vmax, cmap, digits):
    import numpy as np
    data = np.array([[v if _finite(v) else np.nan for v in row] for row in values], dtype=float)
    image = ax.imshow(data, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(col_labels)), [str(c) for c in col_labels], fontsize=7)
    ax.set_yticks(range(len(row_labels)), [str(r) for r in row_labels], fontsize=7)
    span = (vmax - vmin) if vmax is not None and vmin is not None else 1.0
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if not np.isnan(v):
                frac = (v - vmin) / (span or 1.0) if vmin is not None else 0.5
                dark = frac < 0.2 or frac > 0.85          # the dark ends of a diverging map
                ax.text(j, i, f"{v:.{digits}f}", ha="center", va="center", fontsize=6,
                        color="white" if dark else "black")
    return image


def heatmap(path: Path, values: Sequence[Sequence[float]], row_labels: Sequence, col_labels: Sequence, *,
            xlabel: str, ylabel: str, title: str, colorbar: str, vmin: float | None = None,
            vmax: float | None = None, cmap: str = "RdYlGn", digits: int = 0) -> str:
    """One annotated heatmap (rows top to bottom in the given order); NaN cells stay blank."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(col_labels) + 2.5), max(3.0, 0.45 * len(row_labels) + 1.5)))
    image = _draw_heatmap(ax, values, row_labels, col_labels, vmin, vmax, cmap, digits)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=colorbar)
    return _save(fig, path)


def heatmap_grid(path: Path, panels: Sequence[tuple[str, Sequence[Sequence[float]], Sequence, Sequence]], *,
                 xlabel: str, ylabel: str, title: str, colorbar: str, vmin: float = 0.0, vmax: float = 100.0,
                 cmap: str = "RdYlGn", ncols: int = 3, digits: int = 0) -> str:
    """Several heatmaps on one shared colour scale: panels are (panel title, values, row labels, column labels)."""
    plt = _pyplot()
    n = max(1, len(panels))
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.8 * ncols + 1, 3.0 * nrows + 0.6), squeeze=False,
                             layout="constrained")     # keeps panel labels and the shared colourbar apart
    image = None
    for ax, (name, values, rows, cols) in zip(axes.flat, panels):
        image = _draw_heatmap(ax, values, rows, cols, vmin, vmax, cmap, digits)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label=colorbar, shrink=0.8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)
    return str(path)


def bar_plot(path: Path, groups: Sequence[str], series: Mapping[str, Sequence[float]], *, xlabel: str,
             ylabel: str, title: str, reference: float | None = None, reference_label: str = "reference") -> str:
    """Grouped bars: one group per entry of `groups`, one bar per series label; `reference` draws a labelled
    horizontal line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(groups) * max(1, len(series)) / 2 + 3), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if _finite(v) else 0.0 for v in vals], width=width, label=label)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=0.8, linestyle=":", label=reference_label)
    ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)
