"""Hydra multirun: whichever job ends last, the experiment's summary covers every finished cell of its folder, and
its provenance records the user's command, not a worker's argv; the Ray launcher runs the same sweep."""
import csv
import os
import subprocess
import sys

import pytest

SRT = "needlebench_srt:{lengths:[300],depths:[50],max_new_tokens:4}"


def _sweep(tiny_llama_dir, tmp_path, *extra):
    cmd = [sys.executable, "-m", "harness", "-m", "+exp=accuracy_retention", "system=dense,streaming",
           "exp.systems=[]", "exp.tasks=[needlebench_srt]", "exp.params.budget=64", f"exp.params.task_params={{{SRT}}}",
           f"model.path={tiny_llama_dir}", "model.dtype=float32", "model.max_input_tokens=1000",
           "model.max_model_len=2048", "progress=false", f"results_dir={tmp_path / 'results'}",
           f"hydra.sweep.dir={tmp_path / 'multirun'}", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "results" / "accuracy_retention"
    with open(folder / "summary.csv") as f:
        systems = {r["system"] for r in csv.DictReader(f)}
    return systems, (folder / "summary.md").read_text()


def test_multirun_summary_covers_every_job(tiny_llama_dir, tmp_path):
    systems, md = _sweep(tiny_llama_dir, tmp_path)
    assert {"engine-dense", "engine-streaming"} <= systems
    assert "engine-streaming" in md and "engine-dense" in md
    made = next(line for line in md.splitlines() if line.startswith("Made by"))
    assert "system=" in made and "hydra" not in made.split(" at git")[0]


@pytest.mark.slow
def test_sweep_on_a_local_ray_cluster(tiny_llama_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="run `make setup-ray`")
    # the launcher's default asks each job for 4 CPUs and a GPU: a 2-core machine would queue them forever
    systems, md = _sweep(tiny_llama_dir, tmp_path, "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
                         "+hydra.launcher.ray.init.include_dashboard=false", "hydra.launcher.ray.remote.num_cpus=1",
                         "hydra.launcher.ray.remote.num_gpus=0")
    assert {"engine-dense", "engine-streaming"} <= systems
    made = next(line for line in md.splitlines() if line.startswith("Made by"))
    # the user's overrides, not a worker's argv
    assert "hydra/launcher" not in made and "_remote" not in made and "system=" in made
