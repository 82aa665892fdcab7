"""Config composition and validation: typos and wrong types fail with one line, before any work."""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from harness.running.config import CONF_DIR, UserError
from harness.running.driver import prepare
from harness.running.grid import resolve_cells
from harness.running.schema import register
from tasks.base import TaskError

ROOT = Path(__file__).resolve().parent.parent
register()


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_default_composes():
    cfg = _compose([])
    assert cfg.system.backend == "hf" and cfg.task.family == "needlebench"
    cells = prepare(cfg)[1].grid
    assert len(cells) == 1 and cells[0].key.startswith("hf__needlebench_srt")


def test_quickstart_exp_composes():
    cfg = _compose(["+exp=quickstart"])
    assert cfg.exp.name == "quickstart"
    cells = prepare(cfg)[1].grid
    assert [c.system.name for c in cells][0] == "engine-dense"
    assert {c.system.name for c in cells} >= {"engine-flexicache", "engine-quest", "engine-cake", "engine-streaming"}
    assert all(c.system.params.get("budget") == 64 for c in cells if c.system.name != "engine-dense")
    # accuracy cells decode batch-invariantly, and the cell key says so
    assert all(c.system.engine.batch_invariant and "batch_invariant=True" in c.key for c in cells)


def test_cell_key_names_overrides():
    cfg = _compose(["task.limit=3", "system.batch_size=2"])
    key = resolve_cells(cfg)[0].key
    assert "limit=3" in key and "batch_size=2" in key


@pytest.mark.parametrize("overrides", [
    ["system.batchsize=3"],            # misspelled key
    ["system.batch_size=many"],        # wrong type
    ["model.max_input_tokens=abc"],
    ["seed=1.5"],
])
def test_schema_rejects(overrides):
    with pytest.raises(ConfigCompositionException):
        _compose(overrides)


@pytest.mark.parametrize("overrides", [["+system.engine.pagesize=8"], ["+model.dtyp=fp32"], ["+foo=1"]])
def test_appended_unknown_keys_rejected(overrides):
    cfg = _compose(overrides)
    with pytest.raises(UserError, match="unknown key"):
        prepare(cfg)


@pytest.mark.parametrize("overrides, needle", [
    (["+task.params.lenghts=[1000]"], "unknown parameter"),
    (["task.limit=0"], "task.limit"),
    (["task.family=nosuchfamily"], "unknown task family"),
    (["system.backend=tpu"], "unknown backend"),
    (["model.max_input_tokens=9000"], "max_input_tokens"),
])
def test_validate_rejects(overrides, needle):
    cfg = _compose(overrides)
    with pytest.raises(Exception, match=needle):
        prepare(cfg)


def test_unknown_exp_group_file():
    cfg = _compose(["+exp=quickstart", "exp.systems=[nosuch]"])
    with pytest.raises(UserError, match="unknown system 'nosuch'"):
        resolve_cells(cfg)


@pytest.mark.parametrize("arg, needle", [
    ("task.params.lenghts=[1]", "lenghts"),          # caught at composition
    ("+task.params.lenghts=[1]", "lenghts"),         # caught by the task's Params dataclass
    ("system.batch_size=many", "many"),
    ("system=nosuch", "nosuch"),
    ("+system.engine.pagesize=8", "pagesize"),
])
def test_cli_error_is_one_line_and_nonzero(tmp_path, arg, needle):
    proc = subprocess.run([sys.executable, "-m", "harness", arg, f"results_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not any(tmp_path.iterdir())  # the store is untouched


@pytest.mark.parametrize("exp", sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml")))
def test_every_experiment_grid_expands_and_validates(exp):
    """A committed experiment's grid (per-task params, budget sweeps) is valid before anyone spends an hour on it."""
    cfg = _compose([f"+exp={exp}"])
    try:
        experiment, run = prepare(cfg)
        cells = experiment.cells(run)
    except TaskError as exc:  # a hub dataset (RULER's QA at paper scale) fails in one line on a machine without it
        assert "HF hub" in str(exc) and "set task.params.data_dir to a folder" in str(exc)
        return
    assert cells and len({c.key for c in cells}) == len(cells)


def test_a_budget_a_policy_cannot_run_at_is_left_out_and_named():
    from harness.running.grid import budgets_left_out, by_budget
    cfg = _compose(["+exp=budget_sweep", "exp.systems=[dense,quest,lserve]"])
    cells = resolve_cells(cfg)
    out, labels = by_budget(cfg, cells, [32, 128], None)
    assert labels == ["engine-dense", "engine-quest@32", "engine-quest@128", "engine-lserve@128"]
    (why,) = budgets_left_out(out, labels, [32, 128])
    assert why.startswith("engine-lserve at 32 (") and "multiple of physical_page=64" in why
    with pytest.raises(UserError, match="engine-lserve runs at none of"):
        by_budget(cfg, cells, [32], None)
