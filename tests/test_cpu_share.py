"""The engine's thread governor: as many threads as the cores other processes leave free, measured from /proc."""
from __future__ import annotations

import gc
import multiprocessing as mp
import threading
import time

import pytest
import torch

from systems.engine.cpu_share import ThreadGovernor, busy_seconds, others_cores


@pytest.fixture
def governor():
    """A 2-core governor without its watcher thread: the test sets the others' load by hand; torch starts at 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    g = ThreadGovernor(2, enabled=False)
    g.cpus, g.enabled = [0, 1], True
    yield g
    g.stop()
    torch.set_num_threads(before)


def test_threads_follow_the_free_cores(governor):
    g = governor
    assert g.update() == 2
    g.others = 0.9                          # a busy-loop holds a core
    assert g.update() == 1 and torch.get_num_threads() == 1
    g.others = 0.5                          # inside the dead band: stay
    assert g.update() == 1
    g.others = 0.05                         # gone
    assert g.update() == 2 and torch.get_num_threads() == 2
    g.others = 0.5                          # dead band from above: stay
    assert g.update() == 2
    assert g.steps_at == {2: 3, 1: 2}
    g.others = 1.0
    assert g.update() == 1
    torch.set_num_threads(2)                # someone else raised torch's count: the governor corrects it
    assert g.update() == 1 and torch.get_num_threads() == 1
    g.stop()                                # back to the configured count, and no more adapting
    assert torch.get_num_threads() == 2 and g.update() == 2


def test_hysteresis_and_bounds(governor):
    g = governor
    assert g.threads_for(5.0, 2) == 1 and g.threads_for(0.0, 1) == 2
    assert g.threads_for(0.7, 2) == 1 and g.threads_for(0.55, 2) == 2
    assert g.threads_for(0.35, 1) == 1 and g.threads_for(0.25, 1) == 2


def test_load_arithmetic():
    # we used 1.1 of the 2 busy core-seconds in one second: others held 0.9 of a core
    assert others_cores((0.0, 10.0, 3.0), (1.0, 12.0, 4.1)) == pytest.approx(0.9)
    assert others_cores((0.0, 0.0, 0.0), (1.0, 0.5, 0.9)) == 0.0        # counters' granularity: never < 0


def test_off_where_it_cannot_help():
    assert not ThreadGovernor(1).enabled                    # one thread: nothing to drop
    assert not ThreadGovernor(10 ** 4).enabled              # more threads than cores: oversubscribed on purpose


def _spin(until: float) -> None:
    while time.time() < until:
        pass


def _watchers() -> int:
    return sum(t.name == "kvharness-cpu-share" for t in threading.enumerate())


def test_watcher_sees_a_busy_loop_and_ends_with_its_governor():
    """The daemon thread's estimate rises by about a core when another process spins; it exits once stopped."""
    before = torch.get_num_threads()
    try:
        g = ThreadGovernor(2, period_s=0.1)
        if not g.enabled:
            pytest.skip("needs /proc/stat and two usable cores")
        time.sleep(0.5)
        baseline = g.others
        if baseline > 0.8:
            pytest.skip(f"the host is already busy ({baseline:.1f} cores used by others)")
        burner = mp.get_context("spawn").Process(target=_spin, args=(time.time() + 30,), daemon=True)
        burner.start()
        try:
            deadline = time.time() + 10
            while g.others < baseline + 0.6 and time.time() < deadline:
                time.sleep(0.1)
            assert g.others >= baseline + 0.6
        finally:
            burner.kill()
            burner.join()
        g.stop()
        deadline = time.time() + 5
        while _watchers() and time.time() < deadline:
            time.sleep(0.05)
        assert _watchers() == 0
        h = ThreadGovernor(2, period_s=0.1)     # dropped without stop(): its thread ends with it
        del h
        gc.collect()
        deadline = time.time() + 5
        while _watchers() and time.time() < deadline:
            time.sleep(0.05)
        assert _watchers() == 0
    finally:
        torch.set_num_threads(before)


def test_proc_stat_counts_busy_time():
    busy = busy_seconds([0])
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy > 0 and busy_seconds([10 ** 6]) is None
