"""Markdown and CSV tables for summaries: number formatting, markdown tables, CSV text, the length × depth grid."""
from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, TypeGuard


def finite(x: object) -> TypeGuard[float]:
    """A measured number: an int or float that is neither NaN nor infinite (None and other types are not)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v, digits) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def length_depth_table(rows: Sequence[dict]) -> str | None:
    """Score per context length × depth (rows whose meta has both), with row/column means."""
    grid: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        m = r.get("meta") or {}
        if "length" in m and "depth" in m:
            grid[(m["length"], m["depth"])].append(r["score"])
    if not grid:
        return None
    lengths = sorted({k[0] for k in grid})
    depths = sorted({k[1] for k in grid})

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    body = []
    for L in lengths:
        cells = [mean(grid.get((L, d), [])) for d in depths]
        body.append([f"{L}", *cells, mean([s for d in depths for s in grid.get((L, d), [])])])
    body.append(["mean", *[mean([s for L in lengths for s in grid.get((L, d), [])]) for d in depths],
                 mean([s for v in grid.values() for s in v])])
    return md_table(["length \\ depth %", *[f"{d}" for d in depths], "mean"], body)


def to_csv(rows: list[dict]) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()
