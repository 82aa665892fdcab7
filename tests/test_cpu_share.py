"""The engine's thread governor: as many threads as the cores other processes leave free, measured from /proc."""
from __future__ import annotations

import time

import pytest
import torch

from systems.engine.cpu_share import ThreadGovernor, _busy_seconds


@pytest.fixture
def governor():
    """A 2-core governor whose estimate of the other processes' load the test sets by hand."""
    g = ThreadGovernor(2, enabled=False)
    g.cpus, g.enabled = [0, 1], True
    before = torch.get_num_threads()
    yield g
    g.stop()
    torch.set_num_threads(before)


def test_threads_follow_the_free_cores(governor):
    g = governor
    assert g.update() == 2
    g.others = 0.9                          # a busy-loop holds a core
    assert g.update() == 1 and torch.get_num_threads() == 1
    assert g.update() == 1
    g.others = 0.05                         # gone
    assert g.update() == 2 and torch.get_num_threads() == 2
    assert g.steps_at == {2: 2, 1: 2}
    g.others = 1.0
    g.update()
    g.stop()                                # back to the configured count
    assert g.current == 2 and torch.get_num_threads() == 2


def test_load_arithmetic():
    g = ThreadGovernor(2, enabled=False)
    g.cpus = [0, 1]
    assert g.threads_for(5.0) == 1 and g.threads_for(0.0) == 2
    assert g.threads_for(0.4) == 2 and g.threads_for(0.6) == 1
    # we used 1.1 of the 2 busy core-seconds in one second: others held 0.9 of a core
    assert g.others_cores((0.0, 10.0, 3.0), (1.0, 12.0, 4.1)) == pytest.approx(0.9)
    assert g.others_cores((0.0, 0.0, 0.0), (1.0, 0.5, 0.9)) == 0.0      # counters' granularity: never < 0


def test_watcher_measures_a_busy_loop():
    """The daemon thread's estimate sees another process that keeps a core busy."""
    import multiprocessing as mp

    if _busy_seconds([0]) is None:
        pytest.skip("no /proc/stat here")
    g = ThreadGovernor(2, interval_s=0.2)
    burner = mp.get_context("spawn").Process(target=_spin, args=(time.time() + 30,), daemon=True)
    burner.start()
    try:
        deadline = time.time() + 10
        while g.others < 0.7 and time.time() < deadline:
            time.sleep(0.1)
        assert g.others >= 0.7
    finally:
        burner.kill()
        burner.join()
        g.stop()


def _spin(until: float) -> None:
    while time.time() < until:
        pass


def test_single_thread_engines_are_left_alone():
    assert not ThreadGovernor(1).enabled
