"""results.json validates against its versioned JSON Schema; the CSVs are tidy (one row type per file) and hold the
same rows; per-sample logs carry what lm-eval's --log_samples carries."""
import csv
import json
from types import SimpleNamespace

import numpy as np
from omegaconf import OmegaConf

from harness.reporting import results_file
from harness.running.config import load_group
from harness.running.experiment import Run
from harness.running.schema import SystemConfig, TaskConfig
from harness.running.workspace import Workspace


def _validate(doc):
    import jsonschema
    jsonschema.validate(doc, results_file.schema())


def _accuracy_run(tmp_path):
    from harness.experiments import accuracy_retention
    from harness.experiments.accuracy.params import AccuracyParams
    from harness.experiments.accuracy.samples import write_samples
    rng = np.random.default_rng(1)
    cells, rows = [], {}
    for i, (name, keep) in enumerate((("dense", 1.0), ("quest", 0.7), ("streaming", 0.3))):
        cells.append(SimpleNamespace(key=f"c{i}", system=load_group("system", name, SystemConfig),
                                     task=load_group("task", "needlebench_srt", TaskConfig)))
        rows[f"c{i}"] = [{"id": f"s{j}", "score": float(100 * (rng.random() < keep)), "fid_top1": keep,
                          "fid_kl": 1 - keep, "answers": ["needle"], "prediction": "a needle",
                          "prompt_hash": "ab" * 32, "prompt_tokens": 300, "output_tokens": 4, "meta": {}}
                         for j in range(12)]
    labels = [c.system.name for c in cells]
    cfg = OmegaConf.create({"exp": {"name": "accuracy_retention", "kind": "accuracy_retention", "systems": [],
                                    "params": {"budget": 64, "reference": "engine-dense"}},
                            "model": {"dtype": "float32", "name": "tiny"}, "seed": 0})
    run = Run(cfg, AccuracyParams(reference="engine-dense", budget=64), [], tmp_path, Workspace(cfg))
    paths = accuracy_retention.write_summary(run, cells, labels, [], rows)
    return paths, write_samples(tmp_path, cells, labels, rows)


def test_accuracy_results_json_is_valid_and_matches_the_csvs(tmp_path):
    paths, _ = _accuracy_run(tmp_path)
    doc = json.loads((tmp_path / "results.json").read_text())
    _validate(doc)
    assert doc["schema"] == "kvharness.results" and doc["schema_version"] == results_file.SCHEMA_VERSION == 1
    assert doc["budget"] == {"tokens": 64, "budgets": None, "compression_ratio": None}
    assert doc["machine"]["class"] and doc["versions"]["packages"]["torch"]
    quest = next(r for r in doc["results"] if r["system"] == "engine-quest")
    assert quest["n"] == 12 and quest["retention"]["n"] == 12 and abs(quest["fid_top1"]["value"] - 0.7) < 1e-9
    assert quest["retention"]["ci_low"] <= quest["retention"]["value"] <= quest["retention"]["ci_high"]
    assert set(doc["tables"]) == {"scores", "averages", "pairwise"}
    for name, table in doc["tables"].items():       # the CSV beside it holds the same rows, one row type
        with open(tmp_path / table["file"]) as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == len(table["rows"]) and paths[f"csv_{name}"].endswith(table["file"])
    scores = list(csv.DictReader(open(tmp_path / "scores.csv")))
    assert {r["task"] for r in scores} == {"needlebench_srt"}                 # no AVERAGE / PAIRWISE marker rows
    pairs = list(csv.DictReader(open(tmp_path / "pairwise.csv")))
    assert {r["metric"] for r in pairs} == {"macro_retention", "fid_top1"}
    assert not (tmp_path / "summary.csv").exists()


def test_an_old_layout_csv_is_removed_and_other_kinds_validate(tmp_path):
    from harness.experiments import memory
    (tmp_path / "summary.csv").write_text("system,task\nx,AVERAGE\n")
    results = [{"system": "engine-dense", "policy": "dense", "length": 100, "tokens_held": 103, "output_tokens": 4,
                "device_kv_final_bytes": 1024.0, "analytic_device_kv_bytes": 1024.0, "analytic_tolerance_bytes": 0,
                "device_kv_peak_bytes": 1024, "minmax_peak_bytes": 0, "host_kv_peak_bytes": 0,
                "bytes_host_to_device": 0, "ttft_s": 0.1, "tpot_s": float("nan"), "mode": "physical",
                "bytes_per_block": 512}]
    cfg = OmegaConf.create({"exp": {"name": "memory", "kind": "memory", "systems": [], "params": {}},
                            "model": {"dtype": "float32"}})
    memory.write_summary(Run(cfg, memory.Params(), [], tmp_path, Workspace(cfg)), results)
    doc = json.loads((tmp_path / "results.json").read_text())
    _validate(doc)
    assert doc["results"] == [] and doc["tables"]["memory"]["rows"][0]["tpot_s"] is None     # NaN -> null
    assert not (tmp_path / "summary.csv").exists() and (tmp_path / "memory.csv").exists()


def test_samples_logs_carry_lm_eval_fields(tmp_path):
    _, folder = _accuracy_run(tmp_path)
    lines = [json.loads(x) for x in open(f"{folder}/samples_engine-quest_needlebench_srt.jsonl")]
    assert len(lines) == 12
    first = lines[0]
    assert first["doc_id"] == "s0" and first["prompt_hash"] == "ab" * 32 and first["target"] == ["needle"]
    assert len(first["target_hash"]) == 64 and first["prediction"] == "a needle"
    assert first["fidelity"] == {"fid_top1": 0.7, "fid_kl": 1 - 0.7} and first["score"] in (0.0, 100.0)
