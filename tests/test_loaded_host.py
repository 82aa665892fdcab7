"""loaded_host's measurement points and its per-run record."""
from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from harness.experiments.loaded_host import Params, _runs, points
from systems.hardware import allowed_cpus, cpu_list_text


def _cell(name: str, backend: str):
    return SimpleNamespace(system=OmegaConf.create({"name": name, "backend": backend, "engine": {"threads": None}}))


def test_points_cover_every_thread_count_and_load_on_the_same_cores():
    n = len(allowed_cpus())
    pts = points([_cell("engine-dense", "engine"), _cell("vllm", "vllm")], Params())
    keys = [key for *_, key in pts]
    assert len(keys) == len(set(keys)) == 2 * 2 * 3
    engine = {(t, bg, s.engine.threads) for s, t, bg, _ in pts if s.name == "engine-dense"}
    vllm = {(t, bg, s.omp_threads_bind) for s, t, bg, _ in pts if s.name == "vllm"}
    assert {(1, bg, 1) for bg in (0, 1, 2)} <= engine and {(n, bg, n) for bg in (0, 1, 2)} <= engine
    assert vllm == {(t, bg, cpu_list_text(allowed_cpus()[:t])) for t in (1, n) for bg in (0, 1, 2)}


def test_runs_are_reported_beside_the_median():
    assert _runs({"total_tok_s": 5.0, "total_tok_s_runs": [510.2, 562.0, 566.4]}) == "510/562/566"
    assert _runs({"total_tok_s": 5.0}) == "5"
