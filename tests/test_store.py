"""Store: atomic rows, resume after a crash (torn last line, duplicates), completion marker."""
import json
import shutil

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


def _finished_cell(tmp_path, rows=("s0", "s1")):
    from harness.running.envinfo import static_env
    cell = CellStore(tmp_path / "c")
    cell.open("model: m\n", static_env())
    cell.append(_rows(rows))
    cell.write_metrics({"n": len(rows)})
    return cell


def test_what_a_crash_leaves_is_not_damage_but_anything_else_is(tmp_path):
    """A torn last line (or a repeated row) in an unfinished cell is a crash's, which opening repairs; in a finished
    cell, and anywhere a line that is no row, it is damage named by file and line."""
    cell = CellStore(tmp_path / "c")
    cell.open("model: m\n", {"git_sha": "x"})
    cell.append(_rows(["s0", "s0"]))
    with open(cell.predictions_path, "a") as f:
        f.write('{"id": "s1", "sco')
    assert not cell.damage()
    cell.write_metrics({"n": 1})
    assert cell.damage().problems == ["predictions.jsonl line 2: id 's0' repeats line 1",
                                      "predictions.jsonl line 3: cut off (no newline) in a finished cell"]
    assert [r["id"] for r in cell.rows()] == ["s0"]                     # read once, never raised on


def test_every_file_of_a_cell_is_checked(tmp_path):
    cases = [("predictions.jsonl", b'{"id": "s0"}\n\xff\xfe\n', "predictions.jsonl line 2: not UTF-8"),
             ("predictions.jsonl", b'{"id": "s0"}\n[1, 2]\n', "predictions.jsonl line 2: a JSON list"),
             ("predictions.jsonl", b'{"score": 1}\n', "predictions.jsonl line 1: row without ['id']"),
             ("metrics.json", b'{"complete": tr', "metrics.json line 1: not valid JSON"),
             ("metrics.json", b'[]', "metrics.json: holds a list"),
             ("env.json", b'\xff', "env.json: not UTF-8"),
             ("config.yaml", b'a: [1\n', "config.yaml line 2: not valid YAML"),
             ("config.yaml", b'- a\n', "config.yaml: holds list")]
    for name, data, problem in cases:
        cell = _finished_cell(tmp_path)
        (cell.root / name).write_bytes(data)
        damage = cell.damage()
        assert damage.problems and damage.problems[0].startswith(problem), (name, damage.problems)
        assert damage.line().startswith("cell c is damaged: " + problem)
        cell.rows()                                                      # readable rows only, never an exception
        shutil.rmtree(cell.root)
    cell = _finished_cell(tmp_path)
    assert not cell.damage() and cell.damage(("id", "score")).bad_rows == 0
    assert cell.damage(("id", "meta")).problems[0] == "predictions.jsonl line 1: row without ['meta']"


def test_asking_about_a_stale_cell_moves_nothing(tmp_path):
    """Only the driver moves a folder aside, once every check of the run has passed."""
    cell = _finished_cell(tmp_path)
    other = CellStore(tmp_path / "c")
    assert other.stale_reason("model: other\n") == "made with another model, system, task or seed"
    assert not other.is_complete("model: other\n") and other.is_complete("model: m\n")
    assert [p.name for p in tmp_path.iterdir()] == ["c"] and cell.done_ids() == {"s0", "s1"}
