"""The front door at toy scale on the real SmolLM2 (slow): a row per system, dense's retention exactly 1.0."""
import csv
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.running.config import CONF_DIR
from harness.running.driver import run
from harness.running.schema import register

pytestmark = pytest.mark.slow
register()


def test_quickstart_toy_scale(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "+exp=quickstart", f"results_dir={tmp_path}", "progress=false",
            "+exp.params.task_overrides={limit: 1}",
            "exp.params.throughput.systems=[dense,flexicache]", "exp.params.throughput.num_requests=2",
            "exp.params.throughput.input_len=256", "exp.params.throughput.output_len=4"])
    run(cfg)
    out = Path(tmp_path) / "quickstart"
    rows = list(csv.DictReader((out / "scores.csv").open()))
    units = [r for r in rows if r.get("task") == "needlebench_srt_quick"]
    assert {r["system"] for r in units} == {f"engine-{s}" for s in cfg.exp.systems}
    dense = next(r for r in units if r["system"] == "engine-dense")
    assert float(dense["retention"]) == 1.0 and float(dense["fid_top1"]) == 1.0
    assert all(r["n"] == "1" for r in units)
    assert (out / "quickstart_retention.png").stat().st_size > 10_000
    assert "retention [95 % CI]" in (out / "summary.md").read_text()
