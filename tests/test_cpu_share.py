"""The engine's thread governor: as many threads as the cores other processes leave free, measured from /proc."""
from __future__ import annotations

import pytest
import torch

from systems.engine.cpu_share import ThreadGovernor, _busy_seconds


@pytest.fixture
def governor(monkeypatch):
    """A 2-core governor on a scripted machine: each update reads the next (wall s, busy s, own CPU s) sample."""
    g = ThreadGovernor(2, enabled=False)
    g.cpus, g.enabled = [0, 1], True
    script: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)]
    g._mark = script[0]
    monkeypatch.setattr(g, "_now", lambda: script[-1][0])
    monkeypatch.setattr(g, "_sample", lambda: script[-1])
    before = torch.get_num_threads()
    yield g, script
    torch.set_num_threads(before)


def test_threads_follow_the_free_cores(governor):
    g, script = governor
    script.append((1.0, 1.9, 1.9))          # idle machine: we used 1.9 of 2 cores
    assert g.update() == 2
    script.append((2.0, 3.9, 3.0))          # a busy-loop took a core: we got 1.1, others 0.9
    assert g.update() == 1 and torch.get_num_threads() == 1
    script.append((3.0, 5.9, 4.0))          # still there: we get our core, others keep theirs
    assert g.update() == 1
    script.append((3.2, 6.2, 4.2))          # less than interval_s later: no new decision
    assert g.update() == 1
    script.append((4.0, 6.9, 5.0))          # gone: others used 0.0
    assert g.update() == 2 and torch.get_num_threads() == 2
    assert g.steps_at == {2: 2, 1: 3}


def test_never_below_one_nor_above_the_configured_count(governor):
    g, _ = governor
    assert g.threads_for(5.0) == 1 and g.threads_for(0.0) == 2
    assert g.threads_for(0.4) == 2 and g.threads_for(0.6) == 1
    assert g.others_cores((0.0, 0.0, 0.0), (1.0, 0.5, 0.9)) == 0.0       # clock skew between counters: not < 0


def test_single_thread_engines_are_left_alone():
    assert not ThreadGovernor(1).enabled


def test_proc_stat_counts_busy_time():
    busy = _busy_seconds([0])
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy > 0 and _busy_seconds([10 ** 6]) is None
