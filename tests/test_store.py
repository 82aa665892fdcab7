"""Store: atomic rows, resume after a crash (torn last line, duplicates), completion marker."""
import json

from harness.running.store import CellStore, atomic_write_json


def _rows(ids):
    return [{"id": i, "score": 1.0} for i in ids]


def test_resume_after_torn_write(tmp_path):
    cell = CellStore(tmp_path / "c")
    cell.open("a: 1\n", {"git_sha": "x"})
    cell.append(_rows(["s0", "s1"]))
    # simulate a crash mid-write: a partial JSON line with no newline
    with open(cell.predictions_path, "a") as f:
        f.write('{"id": "s2", "sco')
    cell2 = CellStore(tmp_path / "c")
    cell2.open("a: 1\n", {"git_sha": "x"})
    assert cell2.done_ids() == {"s0", "s1"}
    cell2.append(_rows(["s2"]))
    assert [r["id"] for r in cell2.rows()] == ["s0", "s1", "s2"]
    assert not cell2.is_complete()
    cell2.write_metrics({"n": 3})
    assert cell2.is_complete() and cell2.metrics()["n"] == 3


def test_duplicates_dropped_on_open(tmp_path):
    cell = CellStore(tmp_path / "c")
    cell.open("", {})
    cell.append(_rows(["a", "b", "a"]))
    CellStore(tmp_path / "c").open("", {})
    assert [r["id"] for r in cell.rows()] == ["a", "b"]


def test_atomic_json_leaves_no_temp(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"x": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_cell_made_by_other_code_is_moved_aside_and_rerun(tmp_path, caplog):
    """Resume and reuse only under the code that made the rows: other source files or another package set (or
    another model / system / task) retires the folder, so a summary never mixes code versions under one provenance;
    a new commit that leaves the code as it was (docs, tests, results) keeps the rows."""
    env_a = {"git_sha": "a" * 40, "git_diff": None, "code_hash": "c0de", "packages": {"torch": "2.13.0"}, "seed": 0}
    cell = CellStore(tmp_path / "c")
    cell.open("model: m\nexp: {x: 1}\n", env_a)
    cell.append(_rows(["s0"]))
    cell.write_metrics({"n": 1})
    same = CellStore(tmp_path / "c")
    same.open("model: m\nexp: {x: 2}\n", {**env_a, "seed": 0, "command": ["other"]})   # exp block is not the cell's
    assert same.is_complete() and same.done_ids() == {"s0"}
    docs_commit = CellStore(tmp_path / "c")
    docs_commit.open("model: m\n", {**env_a, "git_sha": "b" * 40, "git_diff": "d0c5"})
    assert docs_commit.is_complete() and "stale cell" not in caplog.text
    old_record = {k: v for k, v in env_a.items() if k != "code_hash"}               # written before code_hash
    for env, config in (({**env_a, "code_hash": "c0de2"}, "model: m\n"),
                        ({**env_a, "packages": {"torch": "2.14.0"}}, "model: m\n"),
                        (env_a, "model: other\n")):
        CellStore(tmp_path / "c").open("model: m\n", env_a)                              # rows of code A
        CellStore(tmp_path / "c").append(_rows(["s0"]))
        fresh = CellStore(tmp_path / "c")
        fresh.open(config, env)
        assert fresh.done_ids() == set() and not fresh.is_complete()
        assert "stale cell c:" in caplog.text
        caplog.clear()
    for env, kept in (({**old_record, "git_sha": "b" * 40}, False), (old_record, True)):
        CellStore(tmp_path / "c").open("model: m\n", old_record)
        CellStore(tmp_path / "c").append(_rows(["s0"]))
        again = CellStore(tmp_path / "c")
        again.open("model: m\n", env)
        assert (again.done_ids() == {"s0"}) is kept
    stale = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("c.stale-"))
    assert len(stale) == 8                   # each reopen by code A retires the previous variant too: nothing lost


def test_code_hash_follows_source_files_not_docs(tmp_path):
    from harness.running.envinfo import code_hash
    (tmp_path / "systems").mkdir()
    (tmp_path / "systems" / "k.cpp").write_text("int x;")
    (tmp_path / "README.md").write_text("docs")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("x = 1")
    first = code_hash(tmp_path)
    (tmp_path / "README.md").write_text("more docs")
    (tmp_path / "tests" / "t.py").write_text("x = 2")
    assert code_hash(tmp_path) == first
    (tmp_path / "systems" / "k.cpp").write_text("int y;")
    assert code_hash(tmp_path) != first
