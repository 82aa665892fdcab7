"""How many CPU threads the engine runs now: at most as many as the cores other processes leave free.

Every parallel region (a GEMM, an attention kernel) ends when its slowest thread does. When another process keeps
a core busy, the engine thread that shares that core gets half of it, or is descheduled for a whole time slice in
the middle of its share of the work, and every region waits for it: measured on a 2-core host beside one busy-loop,
two threads ran a 6000-row GEMM no faster than one and the prompt-attention kernel 1.5x slower. So the engine
estimates the cores' worth of CPU the other processes used on its cores over the last half second, and runs on the
cores that are left (never fewer than one, never more than configured). In batch-invariant mode (what accuracy
runs use) tokens do not depend on the thread count, so there adapting changes speed only.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections import Counter, deque
from pathlib import Path

import torch

# /proc/stat columns: user nice system idle iowait irq softirq steal (guest time is already inside user and nice).
# Busy = time the core was not ours to take. Niced work yields its core to a nice-0 engine thread, so it counts only
# when the engine runs niced itself (its own time is then booked under nice as well).
_BUSY = (0, 1, 2, 5, 6, 7) if os.nice(0) > 0 else (0, 2, 5, 6, 7)
LOWER_ABOVE = 0.6     # drop a thread when the others' load leaves less than (threads - 0.6) cores free
RAISE_BELOW = 0.3     # take it back when at least (threads + 1 - 0.3) are free: no flapping around half a core


def busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds spent busy on `cpus` since boot (all processes), from /proc/stat; None where it cannot tell."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    per_cpu = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit():
            values = rest.split()
            per_cpu[int(name[3:])] = sum(int(values[i]) for i in _BUSY if i < len(values))
    if not cpus or any(c not in per_cpu for c in cpus):
        return None
    return sum(per_cpu[c] for c in cpus) / os.sysconf("SC_CLK_TCK")


def others_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores' worth of CPU the other processes used on our cores between two (wall, busy, own CPU) samples."""
    wall = after[0] - before[0]
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall if wall > 0 else 0.0


def _watch(ref: weakref.ref, cpus: list[int], period: float, stop: threading.Event) -> None:
    """Sampling loop of one governor; ends when the governor is stopped or garbage-collected."""
    window: deque[tuple[float, float, float]] = deque(maxlen=3)
    while not stop.wait(period):
        busy = busy_seconds(cpus)
        governor = ref()
        if governor is None:
            return
        if busy is not None:
            window.append((time.monotonic(), busy, time.process_time()))
            if len(window) == window.maxlen:
                governor.others = others_cores(window[0], window[-1])
        del governor


class ThreadGovernor:
    """Sets torch's thread count before each engine step from what the rest of the machine used in the last
    2 x period_s (sampled every period_s on a daemon thread, so the estimate is fresh at the first step after an
    idle gap). Off when max_threads is 1 or exceeds the cores this process may use (oversubscribing on purpose)."""

    def __init__(self, max_threads: int, enabled: bool = True, period_s: float = 0.25):
        self.max_threads = max_threads
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.enabled = (enabled and 1 < max_threads <= len(self.cpus) and busy_seconds(self.cpus) is not None)
        self.others = 0.0                # cores' worth the other processes used lately (set by the watcher)
        self.steps_at: Counter[int] = Counter()
        self._stop = threading.Event()
        if self.enabled:
            threading.Thread(target=_watch, args=(weakref.ref(self), self.cpus, period_s, self._stop),
                             name="kvharness-cpu-share", daemon=True).start()

    def threads_for(self, others: float, current: int) -> int:
        """The count for `others` cores of foreign load, moving from `current` with hysteresis."""
        free = len(self.cpus) - others
        want = min(max(current, 1), self.max_threads)
        while want > 1 and free < want - LOWER_ABOVE:
            want -= 1
        while want < self.max_threads and free >= want + 1 - RAISE_BELOW:
            want += 1
        return want

    def update(self) -> int:
        """Set and return the thread count for the next step (torch's own count is the state: anything else that
        set it is corrected here)."""
        current = torch.get_num_threads()
        if self.enabled:
            want = self.threads_for(self.others, current)
            if want != current:
                torch.set_num_threads(want)
                current = want
        self.steps_at[current] += 1
        return current

    def stop(self) -> None:
        """Stop adapting and go back to the configured count (torch's thread count is process-wide)."""
        was_enabled, self.enabled = self.enabled, False
        self._stop.set()
        if was_enabled and torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)
