"""How many CPU threads the engine runs now: at most as many as the cores other processes leave free.

Every parallel region (a GEMM, an attention kernel) ends when its slowest thread does. When another process keeps
a core busy, the engine thread that shares that core gets half of it, or is descheduled for a whole time slice in
the middle of its share of the work, and every region waits for it: measured on a 2-core host beside one busy-loop,
two threads ran a 6000-row GEMM no faster than one and the prompt-attention kernel 1.5x slower. So the engine
counts, over the last half second, the CPU time the other processes spent on the cores it may use, and runs on the
cores that are left (never fewer than one, never more than configured). Tokens do not depend on the thread count:
every kernel's result per row is fixed whatever the split, so adapting changes speed only.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import torch

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal: time the core was not ours to take


def _busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds spent busy on `cpus` since boot (all processes), from /proc/stat; None where it cannot tell."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    per_cpu = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit():
            values = rest.split()
            per_cpu[int(name[3:])] = sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    if any(c not in per_cpu for c in cpus):
        return None
    return sum(per_cpu[c] for c in cpus) / ticks


class ThreadGovernor:
    """Sets torch's thread count before each engine step from what the rest of the machine uses."""

    def __init__(self, max_threads: int, enabled: bool = True, interval_s: float = 0.5):
        self.max_threads = max_threads
        self.current = max_threads
        self.interval_s = interval_s
        self.steps_at: Counter[int] = Counter()
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.enabled = enabled and max_threads > 1 and _busy_seconds(self.cpus) is not None
        self._mark = self._sample() if self.enabled else None

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = _busy_seconds(self.cpus)
        return None if busy is None else (self._now(), busy, time.process_time())

    def others_cores(self, before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
        """Cores' worth of CPU the other processes used on our cores between two samples."""
        wall = after[0] - before[0]
        return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall if wall > 0 else 0.0

    def threads_for(self, others: float) -> int:
        free = len(self.cpus) - others
        return max(1, min(self.max_threads, int(free + 0.5)))

    def update(self) -> int:
        """The thread count for the next step (re-measured at most every interval_s)."""
        if self.enabled and self._mark is not None and self._now() - self._mark[0] >= self.interval_s:
            now = self._sample()
            if now is not None:
                want = self.threads_for(self.others_cores(self._mark, now))
                if want != self.current:
                    torch.set_num_threads(want)
                    self.current = want
                self._mark = now
        self.steps_at[self.current] += 1
        return self.current

    def restore(self) -> None:
        """Back to the configured count (after a run: the next one starts from the full count)."""
        if self.current != self.max_threads:
            torch.set_num_threads(self.max_threads)
            self.current = self.max_threads
        if self.enabled:
            self._mark = self._sample()
