"""SIGKILL at random points, then rerun: predictions and tables equal an uninterrupted run, no lost/duplicated rows."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cmd(model_dir, results):
    return [sys.executable, "-m", "harness", f"model.path={model_dir}", "model.dtype=float32",
            "model.max_input_tokens=1000", "model.max_model_len=2048", "system.batch_size=1",
            "task.params.lengths=[300,400]", "task.params.depths=[10,30,50,70,90]", "task.params.max_new_tokens=8",
            "exp.name=crash", f"results_dir={results}", "progress=false"]


def _rows(results):
    (cell,) = [p for p in (Path(results) / "crash").iterdir() if (p / "predictions.jsonl").is_file()]
    lines = (cell / "predictions.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _table(results):
    text = (Path(results) / "crash" / "summary.md").read_text()
    return [line for line in text.splitlines() if not line.startswith(("Made by", "Regenerate"))]


def test_sigkill_then_resume_equals_clean_run(tiny_llama_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    clean = tmp_path / "clean"
    t0 = time.perf_counter()
    subprocess.run(_cmd(tiny_llama_dir, clean), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    duration = time.perf_counter() - t0
    ref_rows = _rows(clean)
    assert len(ref_rows) == 10

    crashed = tmp_path / "crashed"
    rng = random.Random(1234)
    for _ in range(3):  # kill at several random points of a run, each time resuming what is on disk
        proc = subprocess.Popen(_cmd(tiny_llama_dir, crashed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.0) * duration)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    subprocess.run(_cmd(tiny_llama_dir, crashed), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    rows = _rows(crashed)
    assert [r["id"] for r in rows] == [r["id"] for r in ref_rows] or sorted(r["id"] for r in rows) == sorted(
        r["id"] for r in ref_rows)
    assert len({r["id"] for r in rows}) == len(rows)  # no duplicates
    key = lambda r: r["id"]  # noqa: E731
    timings = ("ttft_s", "tpot_s", "generation_s", "fidelity_s")
    strip = lambda r: {k: v for k, v in r.items() if k not in timings}  # noqa: E731
    assert [strip(r) for r in sorted(rows, key=key)] == [strip(r) for r in sorted(ref_rows, key=key)]
    assert _table(crashed) == _table(clean)
    # the cost counts the samples of the killed runs too, not only those of the last one
    (cell,) = [p for p in (crashed / "crash").iterdir() if (p / "predictions.jsonl").is_file()]
    metrics = json.loads((cell / "metrics.json").read_text())
    assert all(r["generation_s"] > 0 for r in rows)
    assert metrics["generation_seconds"] == pytest.approx(sum(r["generation_s"] for r in rows))
