"""The teacher-forced fidelity pass reads its generation's kept prefill: the same numbers, the reuse and its saving
recorded in the cell's metrics."""
import json

import pytest
from test_experiments_e2e import _run

SRT = "needlebench_srt:{lengths:[300],depths:[10,50,90],max_new_tokens:6,repeats:1}"
FIELDS = ("fid_top1", "fid_kl", "fid_steps", "gold_loglik", "prediction")


def _cells(folder):
    out = {}
    for cell in folder.iterdir():
        if (cell / "metrics.json").is_file() and (cell / "predictions.jsonl").is_file():
            rows = [json.loads(line) for line in (cell / "predictions.jsonl").read_text().splitlines()]
            out[cell.name] = (json.loads((cell / "metrics.json").read_text()), {r["id"]: r for r in rows})
    return out


@pytest.mark.parametrize("mode", ["query_aware", "query_agnostic"])
def test_fidelity_is_unchanged_by_reusing_the_prefill(tiny_llama_dir, tmp_path, monkeypatch, mode):
    args = ("exp.systems=[dense,snapkv]", "exp.tasks=[needlebench_srt]", "exp.params.budget=48",
            "exp.params.fidelity={steps:6,gold:true}", f"exp.params.task_params={{{SRT}}}",
            f"+exp.params.compression={mode}")
    _run("accuracy_retention", tiny_llama_dir, tmp_path / "reuse", *args)
    from systems.engine.system import EngineSystem
    monkeypatch.setattr(EngineSystem, "supports_shared_context", False)      # the harness asks: no reuse
    _run("accuracy_retention", tiny_llama_dir, tmp_path / "fresh", *args)
    reuse, fresh = _cells(tmp_path / "reuse" / "accuracy_retention"), _cells(tmp_path / "fresh" / "accuracy_retention")
    assert sorted(reuse) == sorted(fresh) and len(reuse) == 2
    for key in reuse:
        (m_reuse, rows_reuse), (m_fresh, rows_fresh) = reuse[key], fresh[key]
        assert {i: [r.get(f) for f in FIELDS] for i, r in rows_reuse.items()} == \
            {i: [r.get(f) for f in FIELDS] for i, r in rows_fresh.items()}
        assert m_fresh["fidelity_prefills_reused"] == 0 and m_fresh["fidelity_prefill_saved_seconds"] == 0
        # every sample has a gold forced pass, and the policy's diverging samples a fidelity one: all reused
        assert m_reuse["fidelity_prefills_reused"] >= 3 and m_reuse["fidelity_prefill_saved_seconds"] > 0
