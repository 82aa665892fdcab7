"""Progress display: which cell runs, how many are left, a per-cell bar and an ETA for the whole run."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class RunProgress:
    """An outer bar over every sample of every pending cell, and an inner bar for the cell in flight."""

    def __init__(self, cells_total: int, samples_total: int, enabled: bool = True):
        self.enabled, self.cells_total, self.cell_index = enabled, cells_total, 0
        self.started = time.perf_counter()
        self.outer = tqdm(total=samples_total, desc="run", unit="sample", position=0, disable=not enabled,
                          file=sys.stderr, dynamic_ncols=True, bar_format="{desc} {percentage:3.0f}%|{bar}| "
                          "{n_fmt}/{total_fmt} samples [{elapsed}<{remaining} for the whole run]")
        self.inner = None

    def start_cell(self, label: str, done: int, total: int) -> None:
        self.cell_index += 1
        left = self.cells_total - self.cell_index
        self.outer.set_description_str(f"cell {self.cell_index}/{self.cells_total} ({left} left after this)")
        self.inner = tqdm(total=total, initial=done, desc=label, unit="sample", position=1, leave=False,
                          disable=not self.enabled, file=sys.stderr, dynamic_ncols=True)

    def skip_cell(self, label: str) -> None:
        self.cell_index += 1
        if self.enabled:
            tqdm.write(f"[skip] {label}: complete on disk", file=sys.stderr)

    def advance(self, n: int) -> None:
        self.outer.update(n)
        if self.inner is not None:
            self.inner.update(n)

    def end_cell(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None

    def close(self) -> None:
        self.end_cell()
        self.outer.close()
