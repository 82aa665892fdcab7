"""The command line against a finished store: every bad command exits 2 with one line and leaves the store as it was;
damage is named (file and line) and recomputed; report-only changes and extended grids reuse the finished cells."""
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from harness import __main__ as entry
from harness.running.config import compose
from harness.running.driver import run

EXP = "accuracy_retention"
SRT = "exp.params.task_params={needlebench_srt:{lengths:[300],depths:[10,50],max_new_tokens:4,repeats:1}}"
TOY = ["model.dtype=float32", "model.max_input_tokens=1000", "model.max_model_len=2048", "progress=false"]


def grid_args(model_dir, results, budgets="[64]", systems="[dense,snapkv]"):
    """The finished experiment's command line: two systems, one budget, two samples each, fidelity on."""
    return [f"+exp={EXP}", f"exp.systems={systems}", "exp.tasks=[needlebench_srt]", "exp.params.budget=null",
            f"+exp.params.budgets={budgets}", SRT, "exp.params.fidelity={steps:4,gold:false}",
            f"model.path={model_dir}", f"results_dir={results}", *TOY]


@pytest.fixture(autouse=True)
def no_hydra_leftovers():
    """An in-process `python -m harness` leaves Hydra's run config and log handlers behind; later tests compose
    without Hydra's app (its group choices would leak into their cell keys)."""
    import logging

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_llama_dir):
    results = tmp_path_factory.mktemp("finished") / "results"
    run(compose(grid_args(tiny_llama_dir, results)))
    return results


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` with a hash of its bytes: equal snapshots, an untouched store."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def cell(results: Path, system: str) -> Path:
    (folder,) = [p for p in (results / EXP).iterdir() if p.name.startswith(f"{system}__") and "." not in
                 p.name.split("__")[0] and ".stale-" not in p.name and ".damaged-" not in p.name]
    return folder


def damage(system, name, how):
    """A setup that damages file `name` of the `system` cell: `how` maps its bytes to the damaged bytes."""
    def apply(results, model_dir):
        path = cell(results, system) / name
        if name.endswith(".pt"):
            path = sorted((cell(results, system) / "reference_logprobs").glob("*.pt"))[0]
        path.write_bytes(how(path.read_bytes()))
    return apply


def strip_fields(results, model_dir):
    folder = cell(results, "engine-dense")
    (folder / "metrics.json").unlink()
    first = json.loads((folder / "predictions.jsonl").read_text().splitlines()[0])
    (folder / "predictions.jsonl").write_text(json.dumps({"id": first["id"], "score": 0.0}) + "\n")


def corrupt_model(results, model_dir):
    shutil.copytree(model_dir, results.parent / "model")
    (results.parent / "model" / "config.json").write_text('{"hidden_size": 64,\n "num_hidden_layers": ')


def unwritable_cache(results, model_dir):
    (results.parent / "a_file").write_text("")          # KVHARNESS_CACHE lies under it


GARBAGE = b'{"id": "x", "sco\xff\n'
ONE_CELL = ["system=dense", "exp.systems=[]", "exp.tasks=[]", "exp.params.task_params={}"]   # the default run's shape
# (command line after the finished experiment's, setup of the store, a phrase the one-line message must contain)
CASES = [
    (["exp.params.task_params={needlebench_srt:{lengths:[300],max_new_tokens:0}}"], None, "max_new_tokens=0"),
    (ONE_CELL + ["task.params.max_new_tokens=0"], None, "max_new_tokens=0"),
    (ONE_CELL + ["task.params.max_new_tokens=-3"], None, "max_new_tokens=-3"),
    (["exp.name=../x"], None, "exp.name='../x' must be a folder name inside results_dir"),
    (["exp.name=/tmp/elsewhere"], None, "not absolute"),
    (["exp.name="], None, "exp.name is empty"),
    (["results_dir="], None, "results_dir is empty"),
    (["results_dir=../up"], None, "contains '..'"),
    (["exp.params.fidelity=7"], None, "exp.params.fidelity=7: use true, false or"),
    (["exp.params.fidelity={steps:0}"], None, "fidelity.steps=0 must be a positive integer"),
    (["exp.params.fidelity={steps:-4}"], None, "fidelity.steps=-4 must be a positive integer"),
    (["exp.tasks=[quickstart_srt]", "++exp.params.task_params={quickstart_srt:{lengths:[300]}}"], None,
     "'quickstart_srt' -> 'needlebench_srt_quick'"),
    (["model.max_model_len=1100", "model.max_input_tokens=150"], None, "model.max_input_tokens=150"),
    (["-m", "system=dense,nosuch", "exp.systems=[]"], None, "system/nosuch"),
    (["-m", "seed=0,1", "exp.name=../x"], None, "exp.name='../x'"),
    (["system.batchsize=2", "--cfg", "job"], None, "batchsize"),
    (["--cfg", "job", "seed=1"], None, "put every key=value together before the options"),
    (["--bogus"], None, "unknown option(s) ['--bogus']"),
    (["model.path=MODEL"], corrupt_model, "config.json line 2 is not valid JSON"),
    (["model.path=null"], unwritable_cache, "set KVHARNESS_CACHE to a folder you can write"),
    (["recompute_damaged=false"], damage("engine-dense", "predictions.jsonl", lambda b: b + GARBAGE),
     "predictions.jsonl line 3: not UTF-8"),
    (["recompute_damaged=false"], damage("engine-dense", "predictions.jsonl", lambda b: b"garbage\n" + b),
     "predictions.jsonl line 1: not valid JSON"),
    (["recompute_damaged=false"], strip_fields, "predictions.jsonl line 1: row without ['prediction'"),
    (["recompute_damaged=false"], damage("engine-dense", "metrics.json", lambda b: b[:20]),
     "metrics.json line 2: not valid JSON"),
    (["recompute_damaged=false"], damage("engine-snapkv", "config.yaml", lambda b: b"model: [unclosed\n"),
     "config.yaml line 2: not valid YAML"),
    (["recompute_damaged=false"], damage("engine-snapkv", "env.json", lambda b: b[:30]),
     "env.json line 3: not valid JSON"),
    (["recompute_damaged=false"], damage("engine-dense", "x.pt", lambda b: b[:1000]),
     "reference_logprobs/"),
]


@pytest.mark.parametrize("extra, setup, phrase", CASES, ids=[f"{i}-{c[2][:40]}" for i, c in enumerate(CASES)])
def test_bad_command_is_one_line_and_leaves_the_store(extra, setup, phrase, finished, tiny_llama_dir, tmp_path,
                                                      monkeypatch, capsys):
    results = tmp_path / "results"
    shutil.copytree(finished, results)
    monkeypatch.chdir(tmp_path)                          # Hydra's outputs/ go here
    monkeypatch.setenv("KVHARNESS_CACHE", str(tmp_path / "a_file" / "cache"))   # nothing may prepare the model
    argv = [*grid_args(tiny_llama_dir, results), *extra]
    argv = [a.replace("model.path=MODEL", f"model.path={tmp_path / 'model'}") for a in argv]
    if extra[0] == "-m":            # Hydra reads the overrides as one group: its flags go before or after them
        argv = ["-m", *grid_args(tiny_llama_dir, results), *extra[1:]]
    if "--cfg" in extra:
        argv = [a for a in argv if a not in extra] + extra
    if setup is not None:
        setup(results, tiny_llama_dir)
    before = snapshot(results)
    monkeypatch.setattr(sys, "argv", ["kvharness", *argv])
    with pytest.raises(SystemExit) as exit_info:
        entry.cli()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert phrase in err, err
    assert snapshot(results) == before                   # nothing renamed, moved, written or removed


def cells_snapshot(results: Path) -> dict[str, str]:
    """The cell folders' files only (a rebuilt summary rewrites summary.md, the CSVs, the PNGs and the per-sample
    logs in samples/ beside them; a cell that runs leaves its lock file in .locks/)."""
    return {k: v for k, v in snapshot(results / EXP).items()
            if ("/" in k or v == "dir") and not k.startswith(("samples/", ".locks/"))}


def summary_systems(results: Path) -> set[str]:
    import csv
    with open(results / EXP / "scores.csv") as f:
        return {r["system"] for r in csv.DictReader(f) if r.get("task") == "needlebench_srt"}


@pytest.mark.parametrize("change, expect", [
    (["exp.params.min_reference_score=1"], "less than 1 points above chance"),
    (["exp.params.size_reason=because-it-is-small"], "**Why this size:** because-it-is-small"),
    (["exp.params.reference=engine-snapkv@64"], "measured against `engine-dense` when the cells ran"),
])
def test_a_report_parameter_rebuilds_the_summary_from_the_cells(change, expect, finished, tiny_llama_dir, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(finished, results)
    before = cells_snapshot(results)
    run(compose([*grid_args(tiny_llama_dir, results), *change]))
    assert cells_snapshot(results) == before                 # no cell ran again, none was moved
    md = (results / EXP / "summary.md").read_text()
    assert expect in md, md
    assert summary_systems(results) == {"engine-dense", "engine-snapkv@64"}


@pytest.mark.parametrize("extension, new", [
    ({"systems": "[dense,snapkv,streaming]"}, "engine-streaming@64"),
    ({"budgets": "[64,128]"}, "engine-snapkv@128"),
])
def test_an_extended_grid_runs_only_its_new_cells(extension, new, finished, tiny_llama_dir, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(finished, results)
    before = cells_snapshot(results)
    run(compose(grid_args(tiny_llama_dir, results, **extension)))
    after = cells_snapshot(results)
    assert {k: v for k, v in after.items() if k in before} == before      # the finished cells as they were
    added = {k.split("/")[0] for k in set(after) - set(before)}
    assert len(added) == 1, added                                          # one new cell folder, nothing else
    assert summary_systems(results) == {"engine-dense", "engine-snapkv@64", new}


def test_a_damaged_cell_is_moved_aside_and_recomputed(finished, tiny_llama_dir, tmp_path, caplog):
    results = tmp_path / "results"
    shutil.copytree(finished, results)
    folder = cell(results, "engine-dense")
    rows = (folder / "predictions.jsonl").read_bytes()
    (folder / "predictions.jsonl").write_bytes(rows.replace(b"\n", b"\n" + GARBAGE, 1))
    run(compose(grid_args(tiny_llama_dir, results)))
    assert "predictions.jsonl line 2: not UTF-8" in caplog.text and "moved to" in caplog.text
    (aside,) = (results / EXP).glob("engine-dense__*.damaged-*")
    assert GARBAGE in (aside / "predictions.jsonl").read_bytes()           # kept for inspection, not deleted
    assert (folder / "predictions.jsonl").read_bytes().count(b"\n") == 2 and GARBAGE not in (
        folder / "predictions.jsonl").read_bytes()
    assert json.loads((folder / "metrics.json").read_text())["n"] == 2     # recomputed: n stays 2
    assert "Unreadable on disk" not in (results / EXP / "summary.md").read_text()


def test_a_summary_rebuilt_from_a_damaged_store_says_what_it_could_not_read(finished, tiny_llama_dir, tmp_path):
    from harness.reporting.rebuild import main as report
    results = tmp_path / "results"
    shutil.copytree(finished, results)
    dense, snapkv = cell(results, "engine-dense"), cell(results, "engine-snapkv")
    (dense / "predictions.jsonl").write_bytes((dense / "predictions.jsonl").read_bytes() + b"garbage\n")
    (snapkv / "env.json").write_text("{")
    before = cells_snapshot(results)
    assert report([EXP, *grid_args(tiny_llama_dir, results)[1:]]) == 0
    md = (results / EXP / "summary.md").read_text()
    assert "1 unreadable row(s) of `engine-dense__" in md and "predictions.jsonl line 3: not valid JSON" in md
    assert f"cell `{snapkv.name}` (env.json line 1: not valid JSON" in md  # the system that could not be read
    assert cells_snapshot(results) == before                              # a rebuild repairs nothing by itself
