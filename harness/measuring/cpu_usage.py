"""What a timed run actually used, read from /proc: CPU seconds, busy threads and the cores its processes may run on.

A system under test may live in this process (the engine, HF), in child processes (vLLM's engine core) or in a
server process tree (online sweeps), so a meter watches a process and all its descendants. Threads are told apart
per thread (/proc/<pid>/task/<tid>/stat), so "2 cores" in a summary means two threads each kept a core busy for a
real share of the window, not a configured number.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from systems.hardware import cpu_list_text

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUSY_SHARE = 0.10        # a thread counts as busy when it ran for at least this share of the window


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def process_tree(root: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """`root` and every descendant process alive now, less the subtrees rooted at `exclude`."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid not in seen and pid not in exclude:
            seen.append(pid)
            todo += _children(pid)
    return seen


def _thread_ticks(pid: int) -> dict[tuple[int, int], int]:
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[(pid, int(stat.parent.name))] = int(fields[11]) + int(fields[12])     # utime + stime
    return out


def _allowed(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return _parse_list(line.split(":", 1)[1].strip())
    except OSError:
        pass
    return set()


def _parse_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


@dataclass
class CpuUsage:
    wall_s: float
    cpu_s: float                 # CPU time of the whole process tree in the window
    busy_threads: int            # threads that ran >= BUSY_SHARE of the window
    processes: int
    cpus_allowed: str            # union of the processes' affinity lists, e.g. "0-1"

    @property
    def cores_busy(self) -> float:
        """Average number of cores the tree kept busy (CPU seconds ÷ wall seconds)."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "cores_busy": self.cores_busy,
                "busy_threads": self.busy_threads, "processes": self.processes, "cpus_allowed": self.cpus_allowed}

    def text(self) -> str:
        return (f"{self.cores_busy:.2f} cores busy ({self.busy_threads} busy threads, {self.processes} process"
                f"{'es' * (self.processes != 1)}, CPUs {self.cpus_allowed or '?'})")


class CpuMeter:
    """`with CpuMeter(pid) as m: ...` then `m.usage`: what the tree rooted at `pid` (default: this process) used,
    leaving out the subtrees of `exclude` (e.g. background load the harness itself started)."""

    def __init__(self, root: int | None = None, exclude: frozenset[int] = frozenset()):
        self.root = root if root is not None else os.getpid()
        self.exclude = frozenset(exclude)
        self.usage: CpuUsage | None = None

    def _snapshot(self) -> tuple[dict[tuple[int, int], int], set[int], int]:
        ticks: dict[tuple[int, int], int] = {}
        allowed: set[int] = set()
        tree = process_tree(self.root, self.exclude)
        for pid in tree:
            ticks.update(_thread_ticks(pid))
            allowed |= _allowed(pid)
        return ticks, allowed, len(tree)

    def __enter__(self) -> CpuMeter:
        self._t0 = time.perf_counter()
        self._before, _, _ = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        after, allowed, processes = self._snapshot()
        self.usage = _usage(self._before, after, wall, allowed, processes)


def _usage(before: dict[tuple[int, int], int], after: dict[tuple[int, int], int], wall: float, allowed: set[int],
           processes: int) -> CpuUsage:
    deltas = [(ticks - before.get(key, 0)) / TICK for key, ticks in after.items()]
    return CpuUsage(wall_s=wall, cpu_s=sum(deltas), processes=processes, cpus_allowed=cpu_list_text(allowed),
                    busy_threads=sum(1 for d in deltas if wall > 0 and d >= BUSY_SHARE * wall))


class CpuTrace(CpuMeter):
    """A CpuMeter that also snapshots the tree every `every_s` seconds, so that part of its window can be read
    afterwards (`usage_between`, `usage_of_last`): for a load whose own start-up (a client's imports, its tokenizer,
    the wait for the first arrival) must not count as the server's idle time and whose client alone knows when its
    requests were in flight."""

    def __init__(self, root: int | None = None, exclude: frozenset[int] = frozenset(), every_s: float = 0.25):
        super().__init__(root, exclude)
        self.every_s = every_s
        # per snapshot: when its /proc reading began, when it had ended, the ticks it read
        self._trace: list[tuple[float, float, dict[tuple[int, int], int]]] = []
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            begun = time.perf_counter()
            ticks = self._snapshot()[0]
            self._trace.append((begun, time.perf_counter(), ticks))

    def __enter__(self) -> CpuTrace:
        super().__enter__()
        self._trace = [(self._t0, time.perf_counter(), self._before)]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        end = time.perf_counter()
        after, self._allowed, self._processes = self._snapshot()
        self._trace.append((end, time.perf_counter(), after))
        self.usage = _usage(self._before, after, end - self._t0, self._allowed, self._processes)

    def usage_between(self, start: float, end: float) -> CpuUsage:
        """What the tree used from the last snapshot at or before `start` to the first at or after `end` (times on
        time.perf_counter's clock, which is CLOCK_MONOTONIC and so shared with other processes): a window that holds
        [start, end] and exceeds it by at most one sampling period at each side."""
        # snapshots whose /proc reading lay wholly before `start`, or wholly after `end`
        before = next((s for s in reversed(self._trace) if s[1] <= start), self._trace[0])
        after = next((s for s in self._trace if s[0] >= end), self._trace[-1])
        return _usage(before[2], after[2], after[0] - before[0], self._allowed, self._processes)

    def usage_of_last(self, seconds: float) -> CpuUsage:
        """What the tree used from the last snapshot taken at least `seconds` before the window's end (the whole
        window when it is shorter) to its end."""
        end, _, after = self._trace[-1]
        start, _, before = next((s for s in reversed(self._trace) if s[0] <= end - seconds), self._trace[0])
        return _usage(before, after, end - start, self._allowed, self._processes)
