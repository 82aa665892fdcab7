"""How many CPU threads the engine runs now: at most as many as the cores other processes leave free.

Every parallel region (a GEMM, an attention kernel) ends when its slowest thread does. When another process keeps
a core busy, the engine thread that shares that core gets half of it, or is descheduled for a whole time slice in
the middle of its share of the work, and every region waits for it: measured on a 2-core host beside one busy-loop,
two threads ran a 6000-row GEMM no faster than one and the prompt-attention kernel 1.5x slower. So the engine
counts, over the last half second, the CPU time the other processes spent on the cores it may use, and runs on the
cores that are left (never fewer than one, never more than configured). In batch-invariant mode (what accuracy
runs use) tokens do not depend on the thread count, so there adapting changes speed only.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
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
    """Sets torch's thread count before each engine step from what the rest of the machine used in the last
    interval_s. A daemon thread samples /proc/stat every interval_s / 2, so the estimate is fresh at the first step
    after an idle gap (a stale window spanning the gap would dilute a load that began during it)."""

    def __init__(self, max_threads: int, enabled: bool = True, interval_s: float = 0.5):
        self.max_threads = max_threads
        self.current = max_threads
        self.interval_s = interval_s
        self.steps_at: Counter[int] = Counter()
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.enabled = enabled and max_threads > 1 and _busy_seconds(self.cpus) is not None
        self.others = 0.0                # cores' worth the other processes used in the last interval
        self._stop = threading.Event()
        if self.enabled:
            threading.Thread(target=self._watch, name="kvharness-cpu-share", daemon=True).start()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = _busy_seconds(self.cpus)
        return None if busy is None else (time.monotonic(), busy, time.process_time())

    def _watch(self) -> None:
        window: deque[tuple[float, float, float]] = deque(maxlen=3)
        while not self._stop.wait(self.interval_s / 2):
            now = self._sample()
            if now is None:
                continue
            window.append(now)
            if len(window) == window.maxlen:
                self.others = self.others_cores(window[0], now)

    @staticmethod
    def others_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
        """Cores' worth of CPU the other processes used on our cores between two (wall, busy, own CPU) samples."""
        wall = after[0] - before[0]
        return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall if wall > 0 else 0.0

    def threads_for(self, others: float) -> int:
        free = len(self.cpus) - others
        return max(1, min(self.max_threads, int(free + 0.5)))

    def update(self) -> int:
        """The thread count for the next step."""
        if self.enabled:
            want = self.threads_for(self.others)
            if want != self.current:
                torch.set_num_threads(want)
                self.current = want
        self.steps_at[self.current] += 1
        return self.current

    def stop(self) -> None:
        """Stop watching and go back to the configured count (torch's thread count is process-wide)."""
        self._stop.set()
        if self.current != self.max_threads:
            torch.set_num_threads(self.max_threads)
            self.current = self.max_threads
