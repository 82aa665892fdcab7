"""Hydra multirun: a job of a sweep over systems keeps its fidelity (the reference's cell is reused or run once, never
twice, under a per-cell file lock), the sweep prints one summary after its last job, and that summary's Regenerate
line is the sweep's command; the Ray launcher runs the same sweep."""
import csv
import json
import os
import subprocess
import sys

import pytest

SRT = "needlebench_srt:{lengths:[300],depths:[50],max_new_tokens:4}"


def _args(tiny_llama_dir, tmp_path):
    return ["+exp=accuracy_retention", "exp.tasks=[needlebench_srt]", "exp.params.budget=64",
            f"exp.params.task_params={{{SRT}}}", "exp.params.fidelity={steps:4,gold:false}",
            f"model.path={tiny_llama_dir}", "model.dtype=float32", "model.max_input_tokens=1000",
            "model.max_model_len=2048", "progress=false", f"results_dir={tmp_path / 'results'}"]


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _sweep(tiny_llama_dir, tmp_path, *extra):
    cmd = [sys.executable, "-m", "harness", "-m", "system=dense,streaming", "exp.systems=[]",
           *_args(tiny_llama_dir, tmp_path), f"hydra.sweep.dir={tmp_path / 'multirun'}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, tmp_path / "results" / "accuracy_retention"


def _scores(folder):
    with open(folder / "scores.csv") as f:
        return {r["system"]: r for r in csv.DictReader(f)}


def test_multirun_keeps_fidelity_and_prints_one_summary_naming_the_sweep(tiny_llama_dir, tmp_path):
    proc, folder = _sweep(tiny_llama_dir, tmp_path)
    scores = _scores(folder)
    assert {"engine-dense", "engine-streaming"} <= set(scores)
    # the streaming job compared itself with the reference: fidelity and retention are numbers, not "—"
    assert float(scores["engine-streaming"]["fid_top1"]) >= 0 and scores["engine-streaming"]["retention"] != ""
    md = (folder / "summary.md").read_text()
    assert "teacher-forced top-1 agreement with `engine-dense`: engine-streaming" in md
    assert (folder / "fidelity.png").is_file()
    assert proc.stdout.count("At a glance:") == 1, proc.stdout       # one summary, after the last job
    assert proc.stdout.rstrip().splitlines()[-1].startswith(("- ", "At a glance:"))     # the glance ends the run
    regenerate = next(line for line in md.splitlines() if line.startswith("Regenerate:"))
    assert regenerate.startswith("Regenerate: `python -m harness -m system=dense,streaming exp.systems=[] "
                                 "+exp=accuracy_retention"), regenerate
    assert "hydra.sweep.dir" not in regenerate and "results_dir=" not in regenerate
    made = next(line for line in md.splitlines() if line.startswith("Made by"))
    assert "system=" in made and "hydra" not in made.split(" at git")[0]
    doc = json.loads((folder / "results.json").read_text())
    assert doc["provenance"]["regenerate"] == regenerate.split("`")[1]


def test_concurrent_runs_share_one_reference_cell(tiny_llama_dir, tmp_path):
    """Two processes at once, each comparing one policy with engine-dense: the dense cell runs in exactly one of
    them (the other waits on its lock and reuses it), its rows are not duplicated, and both policies get fidelity."""
    # progress=true off a terminal logs one line per cell started ("... (0/1 samples on disk)") or skipped
    procs = [subprocess.Popen([sys.executable, "-m", "harness", f"exp.systems=[{system}]",
                               *_args(tiny_llama_dir, tmp_path), "progress=true"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True, env=_env(), cwd=tmp_path) for system in ("streaming", "snapkv")]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ran = [out for out in outs if "engine-dense × needlebench_srt (0/" in out]
    assert len(ran) == 1, outs                                           # started from scratch once, in one process
    folder = tmp_path / "results" / "accuracy_retention"
    (dense,) = [d for d in folder.iterdir() if d.name.startswith("engine-dense__")]
    ids = [json.loads(line)["id"] for line in (dense / "predictions.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) and ids
    rows = {}
    for d in folder.iterdir():
        if d.name.startswith(("engine-streaming__", "engine-snapkv__")):
            rows[d.name.split("__")[0]] = [json.loads(x) for x in (d / "predictions.jsonl").read_text().splitlines()]
    assert set(rows) == {"engine-streaming", "engine-snapkv"}
    assert all("fid_top1" in r for rs in rows.values() for r in rs)


@pytest.mark.slow
def test_sweep_on_a_local_ray_cluster(tiny_llama_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="run `make setup-ray`")
    # the launcher's default asks each job for 4 CPUs and a GPU: a 2-core machine would queue them forever
    _, folder = _sweep(tiny_llama_dir, tmp_path, "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
                       "+hydra.launcher.ray.init.include_dashboard=false", "hydra.launcher.ray.remote.num_cpus=1",
                       "hydra.launcher.ray.remote.num_gpus=0")
    assert {"engine-dense", "engine-streaming"} <= set(_scores(folder))
    made = next(line for line in (folder / "summary.md").read_text().splitlines() if line.startswith("Made by"))
    # the user's overrides, not a worker's argv
    assert "hydra/launcher" not in made and "_remote" not in made and "system=" in made
