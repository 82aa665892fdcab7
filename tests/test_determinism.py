"""Same config and seed: identical sample selection and greedy predictions across runs and batch sizes."""
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.running.config import CONF_DIR
from harness.running.driver import run
from harness.running.schema import register

register()


def _run(tmp, model_dir, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[
            f"model.path={model_dir}", "model.dtype=float32", "model.max_input_tokens=1000",
            "model.max_model_len=2048", "task.params.lengths=[300,500]", "task.params.depths=[10,50,90]",
            "task.params.max_new_tokens=8", "task.limit=4", "exp.name=det", f"results_dir={tmp}",
            "progress=false", *overrides])
    run(cfg)
    (cell,) = [p for p in (Path(tmp) / "det").iterdir() if (p / "predictions.jsonl").is_file()]
    rows = [json.loads(x) for x in (cell / "predictions.jsonl").read_text().splitlines()]
    return {r["id"]: r["prediction"] for r in rows}


@pytest.mark.parametrize("system", ["hf", "dense"])
def test_same_seed_same_predictions_across_runs_and_batch_sizes(tiny_llama_dir, tmp_path, system):
    a = _run(tmp_path / "a", tiny_llama_dir, [f"system={system}", "system.batch_size=1"])
    b = _run(tmp_path / "b", tiny_llama_dir, [f"system={system}", "system.batch_size=1"])
    c = _run(tmp_path / "c", tiny_llama_dir, [f"system={system}", "system.batch_size=4"])
    assert len(a) == 4
    assert a == b == c


def test_seed_changes_selection_not_determinism(tiny_llama_dir, tmp_path):
    a = _run(tmp_path / "a", tiny_llama_dir, ["seed=1"])
    b = _run(tmp_path / "b", tiny_llama_dir, ["seed=1"])
    assert list(a) == list(b)
