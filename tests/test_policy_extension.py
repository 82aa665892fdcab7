"""A policy the harness was never told about (tests/extension/keep_first_pages.py) is run, checked and reported
correctly: the engine's invariants hold under it and +exp=memory's analytic check agrees with what it holds."""
import importlib.util
import sys
from pathlib import Path

import pytest
from test_engine_invariants import _engine, _fuzz
from test_experiments_e2e import _run

from systems.policies import load_policy

NAME = "keep_first_pages"


@pytest.fixture
def keep_first_pages(monkeypatch):
    spec = importlib.util.spec_from_file_location(f"systems.policies.{NAME}",
                                                  Path(__file__).parent / "extension" / f"{NAME}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, f"systems.policies.{NAME}", module)   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_engine_invariants_hold(keep_first_pages, tiny_llama_dir):
    engine = _engine(tiny_llama_dir, load_policy(NAME, {"pages": 2}), blocks=160)
    for seed in (0, 1):
        _fuzz(engine, seed)


def test_memory_experiment_checks_its_own_count(keep_first_pages, tiny_llama_dir, tmp_path):
    _, md, rows, _ = _run("memory", tiny_llama_dir, tmp_path, "exp.systems=[]", "system=dense",
                          "system.name=engine-keep-first", f"system.policy={NAME}", "+system.params.pages=3",
                          "exp.params.budget=null", "exp.params.lengths=[300,600]", "exp.params.output_len=4",
                          "exp.params.warmup=false")
    assert [r["system"] for r in rows] == ["engine-keep-first"] * 2
    assert all(r["matches_analytic"] == "True" for r in rows)
    # 3 pages of 16 tokens + 3 decode tokens = 51 tokens = 4 pages per (layer, KV head), at both lengths
    for r in rows:
        pages = int(r["layers"]) * int(r["kv_heads"]) * 4
        assert (float(r["device_kv_final_bytes"]) == float(r["analytic_device_kv_bytes"])
                == pages * int(r["bytes_per_block"]))
