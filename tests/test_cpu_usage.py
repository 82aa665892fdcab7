"""CpuMeter reads what a process tree used from /proc: children count, excluded subtrees do not; CpuTrace reads the
last part of its window alone."""
import hashlib
import multiprocessing as mp
import os
import sys
import time

import pytest

from harness.measuring.cpu_usage import CpuMeter, CpuTrace, process_tree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin(until: float) -> None:
    """Keep one core busy. Hashing 1 MiB releases the GIL (as a load running in another process leaves it free), so a
    trace's sampling thread in this process keeps its pace."""
    block = bytes(1 << 20)
    while time.time() < until:
        hashlib.sha256(block)


def _measure(exclude_child: bool) -> tuple[float, int]:
    child = mp.get_context("spawn").Process(target=_spin, args=(time.time() + 30,), daemon=True)
    child.start()
    try:
        time.sleep(0.5)                                       # the child is spinning before the window opens
        with CpuMeter(exclude=frozenset({child.pid}) if exclude_child else frozenset()) as meter:
            time.sleep(0.6)
        assert child.pid in process_tree(os.getpid())
    finally:
        child.kill()
        child.join()
    return meter.usage.cpu_s, meter.usage.processes


def test_children_count_and_excluded_subtrees_do_not():
    counted, procs = _measure(exclude_child=False)
    excluded, procs_excluded = _measure(exclude_child=True)
    assert counted >= 0.3 and procs == procs_excluded + 1      # the spinning child used most of the window
    assert excluded < 0.2                                       # this process only slept


def test_trace_reads_the_busy_end_of_its_window_alone():
    """An idle start (a load client importing) then a busy end (its load): the whole window reads well under a core,
    its last part close to one. Bounds leave room for a shared machine (the spinning thread may lose its core for a
    while, and /proc counts CPU time in 10 ms ticks)."""
    with CpuTrace(every_s=0.05) as meter:
        time.sleep(0.6)
        _spin(time.time() + 1.0)
    assert meter.usage is not None
    whole, end = meter.usage, meter.usage_of_last(0.5)
    assert 0.2 < whole.cores_busy < 0.85
    assert end.cores_busy > 0.6 and end.cores_busy > whole.cores_busy + 0.15 and 0.5 <= end.wall_s < 0.7
    assert meter.usage_of_last(60.0).cpu_s == whole.cpu_s      # longer than the window: all of it


def test_trace_reads_the_span_between_two_instants_on_the_monotonic_clock():
    """usage_between takes the snapshots just outside [start, end]: a busy second after an idle 0.6 s reads close
    to a core, its window holds the span and exceeds it by at most one sampling period at each side."""
    with CpuTrace(every_s=0.05) as meter:
        time.sleep(0.6)
        start = time.perf_counter()
        _spin(time.time() + 1.0)
        end = time.perf_counter()
        time.sleep(0.3)
    span = meter.usage_between(start, end)
    assert 1.0 <= span.wall_s <= 1.5          # one sampling period each side, and room for a busy machine
    assert span.cores_busy > 0.6 and span.cores_busy > meter.usage.cores_busy + 0.2
    assert meter.usage_between(start - 60, end + 60).cpu_s == meter.usage.cpu_s     # beyond the window: all of it
