"""+exp=shared_context end to end at toy scale: three modes on the same samples, intervals, one context read once."""
import json

import pytest
from test_experiments_e2e import _run

from harness.running.config import UserError

RULER = "exp.params.task_params.ruler={tasks:[niah_single_1],lengths:[512],num_samples:2,questions_per_context:2}"
MRT = "exp.params.task_params.needlebench_mrt={{lengths:[300],depths:{depths},repeats:1,max_new_tokens:4," \
      "question_per_needle:true}}"


def _predictions(folder, system, task, mode):
    """The rows of one cell, by id."""
    cell = next(p for p in folder.iterdir() if p.name.startswith(f"{system}__{task}__") and (
        p.name.endswith(f"__compression={mode}") if mode != "query_aware" else "__compression=" not in p.name))
    return {r["id"]: r for r in map(json.loads, (cell / "predictions.jsonl").read_text().splitlines())}


def test_three_modes_side_by_side(tiny_llama_dir, tmp_path):
    # the random toy model scores about nothing: keep every unit (min_reference_score) so each estimate has its n
    _, md, rows, pngs = _run("shared_context", tiny_llama_dir, tmp_path, "exp.systems=[dense,snapkv]",
                             "exp.tasks=[ruler,needlebench_mrt]", "exp.params.budget=64",
                             "exp.params.min_reference_score=-1",
                             "exp.params.fidelity={steps:4,gold:false}", RULER,
                             MRT.format(depths="[10,50]"))
    assert pngs == ["retention_by_mode.png"]
    by_mode = {(r["system"], r["mode"]): r for r in rows["retention_by_mode"]}
    assert {m for _, m in by_mode} == {"query_aware", "query_agnostic", "shared"}
    snap = by_mode[("engine-snapkv", "shared")]
    assert snap["retention_n"] == "6" and {"retention_ci_low", "retention_ci_high"} <= set(snap)
    assert {(r["mode"], r["versus"]) for r in rows["mode_differences"]} == {
        ("query_agnostic", "query_aware"), ("shared", "query_agnostic"), ("shared", "query_aware")}
    assert {r["question"] for r in rows["retention_by_question"]} == {"first", "later"}
    for heading in ("Retention vs `engine-dense` per mode", "Paired difference between modes",
                    "first asked of a context vs the later ones", "Shared vs independent prefill"):
        assert heading in md
    folder = tmp_path / "shared_context"
    # every shared question read one compressed context; the independent ones compressed their own
    for task in ("ruler", "needlebench_mrt"):
        shared = _predictions(folder, "engine-snapkv", task, "shared")
        agnostic = _predictions(folder, "engine-snapkv", task, "query_agnostic")
        assert all(r["kv_stats"].get("shared_context") for r in shared.values())
        # fidelity of every mode against dense query-aware
        assert all(r["fid_steps"] == 4 for r in [*shared.values(), *agnostic.values()])
        assert all(r["kv_stats"]["compression"] == "query_agnostic" for r in agnostic.values())
        assert {i: r["prediction"] for i, r in shared.items()} == {i: r["prediction"] for i, r in agnostic.items()}
    # the context is held once per context in the shared mode, once per question in the independent ones
    kv = {(r["system"], r["mode"]): r for r in rows["kv_and_speed"]}
    assert len(kv) == len(rows["kv_and_speed"]) == 6 and kv[("engine-dense", "shared")]["context_kv_tokens_n"] == "3"
    assert float(kv[("engine-dense", "shared")]["context_kv_tokens"]) < float(
        kv[("engine-dense", "query_agnostic")]["context_kv_tokens"])


def test_one_question_shared_equals_query_agnostic_for_dense(tiny_llama_dir, tmp_path):
    _, md, rows, _ = _run("shared_context", tiny_llama_dir, tmp_path, "exp.systems=[dense]",
                          "exp.tasks=[needlebench_mrt]", "exp.params.modes=[query_agnostic,shared]",
                          MRT.format(depths="[50]"))
    folder = tmp_path / "shared_context"
    shared = _predictions(folder, "engine-dense", "needlebench_mrt", "shared")
    agnostic = _predictions(folder, "engine-dense", "needlebench_mrt", "query_agnostic")
    assert len(shared) == 1 and all(r["kv_stats"]["shared_context"] for r in shared.values())
    assert [r["output_ids"] for r in shared.values()] == [r["output_ids"] for r in agnostic.values()]


def test_modes_are_checked_before_any_model_loads(tiny_llama_dir, tmp_path):
    with pytest.raises(UserError, match="exp.params.modes"):
        _run("shared_context", tiny_llama_dir, tmp_path, "exp.systems=[dense]", "exp.params.modes=[shared,other]")
    with pytest.raises(UserError, match=r"\['hf'\] cannot compress"):
        _run("shared_context", tiny_llama_dir, tmp_path, "exp.systems=[dense,hf]")


def test_chunks_never_split_a_context():
    from types import SimpleNamespace

    from harness.experiments.accuracy.cells import chunks
    todo = [(SimpleNamespace(id=f"s{i}"), [i]) for i in range(7)]
    keys = {"s0": "a", "s1": "a", "s2": "a", "s3": "b", "s4": "b", "s6": "c"}
    got = [[s.id for s, _ in c] for c in chunks(todo, 2, keys)]
    assert got == [["s0", "s1", "s2"], ["s3", "s4"], ["s5", "s6"]]
    assert [[s.id for s, _ in c] for c in chunks(todo, 3, {})] == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]


def test_context_kv_counts_shared_pages_once():
    from harness.experiments.shared_context.report import context_kv
    kept = [[8, 8]]                                                 # one layer, two KV heads
    shared = [{"id": f"q{i}", "context": "c", "kv_stats": {"kept_tokens": kept, "device_pages": 10,
                                                           "shared_device_pages": 8}} for i in range(3)]
    alone = [{"id": f"q{i}", "context": "c", "kv_stats": {"kept_tokens": kept, "device_pages": 10}} for i in range(3)]
    # pages × page size ÷ (layers × heads): 8 shared + 3 × 2 own = 14 pages, or 3 × 10
    assert context_kv(shared, 4).value == 14 * 4 / 2 and context_kv(alone, 4).value == 30 * 4 / 2
