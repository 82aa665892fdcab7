"""exp.params.compression on every accuracy kind: validated, refused for systems that cannot split a prompt, keyed
apart from the default cells, honoured by the engine requests and printed in the summary."""
import json

import pytest
from test_experiments_e2e import SRT, _run

from harness.running.config import UserError


def _cells(folder):
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and (p / "predictions.jsonl").is_file())


def test_an_unknown_mode_is_a_one_line_error_naming_the_modes(tiny_llama_dir, tmp_path):
    with pytest.raises(UserError, match=r"compression='agnostic'.*query_aware.*query_agnostic"):
        _run("accuracy_retention", tiny_llama_dir, tmp_path, "exp.systems=[dense]", "exp.tasks=[needlebench_srt]",
             "+exp.params.compression=agnostic", f"exp.params.task_params={{{SRT}}}")


def test_a_system_without_shared_contexts_is_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(UserError, match=r"\['hf'\] cannot compress a context apart"):
        _run("accuracy_retention", tiny_llama_dir, tmp_path, "exp.systems=[dense,hf]", "exp.tasks=[needlebench_srt]",
             "+exp.params.compression=query_agnostic", f"exp.params.task_params={{{SRT}}}")


def test_query_agnostic_cells_are_keyed_apart_and_say_so(tiny_llama_dir, tmp_path):
    common = ("exp.systems=[dense,snapkv]", "exp.tasks=[needlebench_srt]", "exp.params.budget=64",
              f"exp.params.task_params={{{SRT}}}")
    _, md, rows, _ = _run("accuracy_retention", tiny_llama_dir, tmp_path, *common)
    folder = tmp_path / "accuracy_retention"
    aware = _cells(folder)
    assert "Compression: query-aware" in md and not any("compression=" in c for c in aware)
    _, md, rows, _ = _run("accuracy_retention", tiny_llama_dir, tmp_path, *common,
                          "+exp.params.compression=query_agnostic")
    agnostic = [c for c in _cells(folder) if c not in aware]
    assert len(agnostic) == 2 and all(c.endswith("__compression=query_agnostic") for c in agnostic)
    assert "Compression: query-agnostic" in md
    for cell in agnostic:
        row = json.loads((folder / cell / "predictions.jsonl").read_text().splitlines()[0])
        assert row["kv_stats"]["compression"] == "query_agnostic" and row["kv_stats"]["context_tokens"] > 0
        assert "fid_top1" in row                       # fidelity compared with the reference of the same mode
    unit = next(r for r in rows["scores"] if r["system"] == "engine-snapkv")
    assert unit["n"] == "1" and unit["retention_ci_low"] != ""


def test_budget_sweep_accepts_the_mode(tiny_llama_dir, tmp_path):
    _, md, rows, _ = _run("budget_sweep", tiny_llama_dir, tmp_path, "exp.systems=[dense,streaming]",
                          "exp.tasks=[needlebench_srt]", "exp.params.budgets=[32]", "exp.params.contexts={}",
                          "+exp.params.compression=query_agnostic",
                          f"+exp.params.task_params.{SRT.replace(':', '=', 1)}")
    assert "Compression: query-agnostic" in md
    assert all(c.endswith("__compression=query_agnostic") for c in _cells(tmp_path / "budget_sweep"))
