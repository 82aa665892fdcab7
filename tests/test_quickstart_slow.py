"""The front door at toy scale on the real SmolLM2 (slow): a row per system, dense's retention exactly 1.0."""
import csv
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.runner import CONF_DIR, run
from harness.schema import register

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
    rows = list(csv.DictReader((out / "summary.csv").open()))
    acc = [r for r in rows if r["part"] == "accuracy"]
    systems = {c for c in cfg.exp.systems}
    assert len(acc) == len(systems) == 7
    dense = next(r for r in acc if r["system"] == "engine-dense")
    for key, value in dense.items():
        if key.endswith(".retention") and value:
            assert float(value) == 1.0
    assert (out / "quickstart.png").stat().st_size > 10_000
    assert "retention" in (out / "summary.md").read_text()
