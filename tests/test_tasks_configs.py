"""Every conf/task YAML has the TaskConfig keys, names itself after its file and builds its task."""
import pathlib

import pytest
from omegaconf import OmegaConf

from tasks.base import load_task

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf" / "task"
MINE = ("needlebench", "longbench", "leval", "recall")


@pytest.mark.parametrize("path", sorted(p for p in CONF.glob("*.yaml") if p.stem.startswith(MINE)),
                         ids=lambda p: p.stem)
def test_task_yaml_builds(path):
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert set(cfg) == {"name", "family", "params", "limit", "fraction"}
    assert cfg["name"] == path.stem
    task = load_task(cfg["family"], cfg["name"], cfg["params"], limit=cfg["limit"], fraction=cfg["fraction"])
    assert task.name == path.stem
