"""loaded_host's measurement points: every core count, and the engine at every core both adapting and fixed."""
from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from harness.experiments.loaded_host import Params, _label, _steps_by_threads, points
from systems.hardware import allowed_cpus


def _cell(name: str, backend: str):
    return SimpleNamespace(system=OmegaConf.create({"name": name, "backend": backend,
                                                    "engine": {"threads": None, "adapt_threads": True}}))


def test_points_cover_threads_burners_and_the_fixed_engine():
    n = len(allowed_cpus())
    pts = points([_cell("engine-dense", "engine"), _cell("vllm", "vllm")], Params())
    keys = [key for *_, key, _ in pts]
    assert len(keys) == len(set(keys))
    engine = [(t, bg, adapt, s.engine.threads, s.engine.adapt_threads)
              for s, t, bg, key, adapt in pts if s.name == "engine-dense"]
    vllm = [(t, bg, adapt, s.omp_threads_bind) for s, t, bg, key, adapt in pts if s.name == "vllm"]
    if n > 1:
        assert (n, 1, False, n, False) in engine and (n, 1, True, n, True) in engine
        assert len(engine) == 2 + 4 and len(vllm) == 4
    assert (1, 0, True, 1, True) in engine
    assert all(adapt is None for _, _, adapt, _ in vllm)
    assert not [p for p in points([_cell("engine-dense", "engine")], Params(fixed_threads=False)) if p[4] is False]


def test_labels_and_thread_counts():
    assert _label({"threads": 2, "adapts": False}) == "2 threads fixed"
    assert _label({"threads": 2, "adapts": None}) == "2 threads"
    row = {"memory": {"extra": {"steps_by_threads": {"2": 3, "16": 1, "1": 40}}}}
    assert _steps_by_threads(row) == "16: 1, 2: 3, 1: 40"
    assert _steps_by_threads({}) == "–"
