"""Progress display: which cell runs, how many are left, a per-cell bar and an ETA for the whole run.

On a terminal: tqdm bars. Elsewhere (a log file, CI, a pipe) bars would write control codes, so each cell's start
and end become one log line with the run's ETA instead (logger `kvharness`, which Hydra also writes to the run's
log file).
"""
from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("kvharness")


class RunProgress:
    """An outer bar over every sample of every pending cell, and an inner bar for the cell in flight."""

    def __init__(self, cells_total: int, samples_total: int, enabled: bool = True):
        self.enabled, self.cells_total, self.cell_index = enabled, cells_total, 0
        self.bars = enabled and sys.stderr.isatty()
        self.samples_total, self.samples_done, self.label = samples_total, 0, ""
        self.started = time.perf_counter()
        self.outer = tqdm(total=samples_total, desc="run", unit="sample", position=0, disable=not self.bars,
                          file=sys.stderr, dynamic_ncols=True, bar_format="{desc} {percentage:3.0f}%|{bar}| "
                          "{n_fmt}/{total_fmt} samples [{elapsed}<{remaining} for the whole run]")
        self.inner = None

    def start_cell(self, label: str, done: int, total: int) -> None:
        self.cell_index += 1
        left = self.cells_total - self.cell_index
        self.outer.set_description_str(f"cell {self.cell_index}/{self.cells_total} ({left} left after this)")
        self.inner = tqdm(total=total, initial=done, desc=label, unit="sample", position=1, leave=False,
                          disable=not self.bars, file=sys.stderr, dynamic_ncols=True)
        self.label = label
        if self.enabled and not self.bars:
            log.info("cell %d/%d: %s (%d/%d samples on disk)", self.cell_index, self.cells_total, label, done,
                     total)

    def skip_cell(self, label: str) -> None:
        self.cell_index += 1
        if not self.enabled:
            return
        if self.bars:
            tqdm.write(f"[skip] {label}: complete on disk", file=sys.stderr)
        else:
            log.info("cell %d/%d: %s complete on disk, skipped", self.cell_index, self.cells_total, label)

    def advance(self, n: int) -> None:
        self.outer.update(n)
        self.samples_done += n
        if self.inner is not None:
            self.inner.update(n)

    def eta(self) -> str:
        elapsed = time.perf_counter() - self.started
        if not self.samples_done or self.samples_done >= self.samples_total:
            return f"{elapsed / 60:.1f} min elapsed"
        left = elapsed / self.samples_done * (self.samples_total - self.samples_done)
        return f"{elapsed / 60:.1f} min elapsed, about {left / 60:.0f} min left"

    def end_cell(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None
            if self.enabled and not self.bars:
                log.info("cell %d/%d done: %s (%s)", self.cell_index, self.cells_total, self.label, self.eta())

    def close(self) -> None:
        self.end_cell()
        self.outer.close()
