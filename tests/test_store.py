"""Store: atomic rows, resume after a crash (torn last line, duplicates), completion marker."""
import json

from harness.store import Cell, atomic_write_json


def _rows(ids):
    return [{"id": i, "score": 1.0} for i in ids]


def test_resume_after_torn_write(tmp_path):
    cell = Cell(tmp_path / "c")
    cell.open("a: 1\n", {"git_sha": "x"})
    cell.append(_rows(["s0", "s1"]))
    # simulate a crash mid-write: a partial JSON line with no newline
    with open(cell.predictions_path, "a") as f:
        f.write('{"id": "s2", "sco')
    cell2 = Cell(tmp_path / "c")
    cell2.open("a: 1\n", {"git_sha": "x"})
    assert cell2.done_ids() == {"s0", "s1"}
    cell2.append(_rows(["s2"]))
    assert [r["id"] for r in cell2.rows()] == ["s0", "s1", "s2"]
    assert not cell2.is_complete()
    cell2.write_metrics({"n": 3})
    assert cell2.is_complete() and cell2.metrics()["n"] == 3


def test_duplicates_dropped_on_open(tmp_path):
    cell = Cell(tmp_path / "c")
    cell.open("", {})
    cell.append(_rows(["a", "b", "a"]))
    Cell(tmp_path / "c").open("", {})
    assert [r["id"] for r in cell.rows()] == ["a", "b"]


def test_atomic_json_leaves_no_temp(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"x": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
