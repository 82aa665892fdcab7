"""An installed package adds a policy and a task family through entry points, without touching the tree.

The package (tests/extension/kvx_toy) is installed into a temporary folder as pip would lay it out — the package plus a
dist-info with entry_points.txt (`kvharness.policies`, `kvharness.tasks`) — and put on the path; the harness then runs
the policy and the task by name: engine invariants hold under the policy, +exp=accuracy_retention runs both at toy
scale in a fresh process (and its summary says the shared budget left the budget-free policy as configured), and
+exp=memory's analytic check agrees with what the policy holds.
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_invariants import _engine, _fuzz
from test_experiments_e2e import _run

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = """[kvharness.policies]
keep_first_pages = kvx_toy.policy:KeepFirstPages

[kvharness.tasks]
repeat_number = kvx_toy.task:RepeatNumber
"""


@pytest.fixture
def installed(tmp_path_factory) -> Path:
    """A site folder holding kvx_toy as an installed distribution (package + dist-info with its entry points)."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(Path(__file__).parent / "extension" / "kvx_toy", site / "kvx_toy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    info = site / "kvx_toy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvx-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


@pytest.fixture
def on_path(installed, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(installed))
    return installed


def test_installed_policy_and_task_are_found_by_name(on_path):
    from systems.policies import load_policy, policy_names
    from tasks.base import task_class, task_families

    assert "keep_first_pages" in policy_names() and "repeat_number" in task_families()
    assert type(load_policy("keep_first_pages", {"pages": 2})).__module__ == "kvx_toy.policy"
    assert task_class("repeat_number").__module__ == "kvx_toy.task"


def test_engine_invariants_hold(on_path, tiny_llama_dir):
    from systems.policies import load_policy

    engine = _engine(tiny_llama_dir, load_policy("keep_first_pages", {"pages": 2}), blocks=160)
    for seed in (0, 1):
        _fuzz(engine, seed)


def test_accuracy_retention_runs_the_extension_in_a_fresh_process(installed, tiny_llama_dir, tmp_path):
    cmd = [sys.executable, "-m", "harness", "+exp=accuracy_retention", "exp.systems=[dense,keep_first_pages]",
           "exp.tasks=[repeat_number]", "exp.params.budget=64", "exp.params.task_params={}",
           "exp.params.fidelity={steps:4,gold:false}", f"model.path={tiny_llama_dir}", "model.dtype=float32",
           "model.max_input_tokens=1000", "model.max_model_len=2048", "progress=false", f"results_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(installed)]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "accuracy_retention"
    rows = list(csv.DictReader(open(folder / "scores.csv")))
    units = {(r["system"], r["task"]) for r in rows if r["n"]}
    assert units == {("engine-dense", "repeat_number"), ("engine-keep_first_pages", "repeat_number")}, units
    md = (folder / "summary.md").read_text()
    assert "Left out of the shared budget, run as configured: engine-keep_first_pages (policy 'keep_first_pages' " \
           "maps no shared budget onto its knobs)." in md
    assert not (ROOT / "kvx_toy").exists() and "kvx_toy" not in (ROOT / "pyproject.toml").read_text()


def test_memory_experiment_checks_its_own_count(on_path, tiny_llama_dir, tmp_path):
    _, md, rows, _ = _run("memory", tiny_llama_dir, tmp_path, "exp.systems=[]", "system=dense",
                          "system.name=engine-keep-first", "system.policy=keep_first_pages", "+system.params.pages=3",
                          "exp.params.budget=null", "exp.params.lengths=[300,600]", "exp.params.output_len=4",
                          "exp.params.warmup=false")
    rows = rows["memory"]
    assert [r["system"] for r in rows] == ["engine-keep-first"] * 2
    assert all(r["matches_analytic"] == "True" for r in rows)
    # 3 pages of 16 tokens + 3 decode tokens = 51 tokens = 4 pages per (layer, KV head), at both lengths
    for r in rows:
        pages = int(r["layers"]) * int(r["kv_heads"]) * 4
        assert (float(r["device_kv_final_bytes"]) == float(r["analytic_device_kv_bytes"])
                == pages * int(r["bytes_per_block"]))
