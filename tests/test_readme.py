"""README.md's quickstart and results blocks are what harness.reporting.readme builds from the committed summaries."""
from pathlib import Path

import pytest

from harness.reporting import readme

ROOT = Path(__file__).resolve().parents[1]


def test_readme_matches_committed_summaries(tmp_path):
    text = (ROOT / "README.md").read_text()
    assert readme.render(text, readme.committed_root(tmp_path)) == text, \
        "README.md is out of date with the committed summaries: run `python -m harness.reporting.readme`"


def test_scratch_and_multirun_folders_never_reach_the_readme(tmp_path):
    """A local `python -m harness` (results/default), a multirun's own exp.name and a local rerun of a committed
    experiment leave the README as the committed summaries make it."""
    root = readme.committed_root(tmp_path / "committed")
    before = readme.render((ROOT / "README.md").read_text(), root)
    for scratch in ("default", "acc_b128", "roofline_toy"):
        (root / "results" / scratch).mkdir(parents=True, exist_ok=True)
        (root / "results" / scratch / "summary.md").write_text(f"# {scratch}\n\n**At a glance:** scratch 99.9.\n")
        (root / "results" / scratch / "scores.csv").write_text("system\nx\n")
    after = readme.render((ROOT / "README.md").read_text(), root)
    assert after == before and "scratch 99.9" not in after
    # the CLI quotes what git holds: a file on disk that git does not hold is not read
    assert readme.committed_root(tmp_path / "again") != ROOT
    assert not (tmp_path / "again" / "results" / "default").exists()


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "results" / "quickstart").mkdir(parents=True)
    (tmp_path / "results" / "quickstart" / "summary.md").write_text(
        "# quickstart: title\n\n**At a glance:** dense wins.\n\n## Table\n\n| a |\n| --- |\n| 1 |\n\n"
        "![quickstart](quickstart.png)\n\nRegenerate: `make run`.\n\nMade by `x` at git `abc123` on cpu.\n")
    (tmp_path / "results" / "offline_throughput").mkdir()
    (tmp_path / "results" / "offline_throughput" / "summary.md").write_text(
        "# offline_throughput\n\n**At a glance:** ratios:\n\n- one 1.3×\n- two 0.6×\n\n| t |\n\n"
        "Regenerate: `python -m harness +exp=offline_throughput n=2`.\n")
    (tmp_path / "results" / "offline_throughput" / "summary.csv").write_text("a\n1\n")
    (tmp_path / "results" / "offline_throughput" / "b.png").write_bytes(b"")
    (tmp_path / "results" / "offline_throughput" / "a.png").write_bytes(b"")
    (tmp_path / "results" / "newexp").mkdir()
    (tmp_path / "results" / "newexp" / "summary.md").write_text("# newexp\n\n**At a glance:** new.\n")
    (tmp_path / "conf" / "exp").mkdir(parents=True)
    (tmp_path / "conf" / "exp" / "newexp.yaml").write_text("# @package _global_\n# A new sweep of things.\nexp: {}\n")
    return tmp_path


def test_blocks_quote_glance_links_images_and_command(tmp_path):
    root = _tree(tmp_path)
    out = readme.render("top\n<!-- quickstart -->\nold\n<!-- /quickstart -->\nmid\n<!-- results -->\nold\n"
                        "<!-- /results -->\nend\n", root)
    quick = out.split("<!-- quickstart -->\n")[1].split("\n<!-- /quickstart -->")[0]
    assert quick.startswith("**At a glance:** dense wins.\n\n#### Table\n\n| a |")
    assert "Regenerate" not in quick and "![" not in quick and "Made by" not in quick
    assert quick.endswith("git `abc123`, `results/quickstart/summary.md`.)")
    res = out.split("<!-- results -->\n")[1].split("\n<!-- /results -->")[0]
    assert "**At a glance:** ratios:\n\n- one 1.3×\n- two 0.6×\n\n[summary.md]" in res
    assert "[summary.csv](results/offline_throughput/summary.csv)" in res
    assert "![a.png](results/offline_throughput/a.png) ![b.png](results/offline_throughput/b.png)" in res
    assert "Regenerate: `python -m harness +exp=offline_throughput n=2`" in res
    assert "### `newexp`" not in res and "**At a glance:** new." not in res      # not a committed experiment
    assert res.endswith("No summary committed yet (a run of each is pending; its summary appears here when it lands): "
                        "`newexp`.")
    assert out.startswith("top\n") and out.endswith("\nend\n") and "old" not in out
    assert readme.render(out, root) == out


def test_experiments_without_a_committed_run_are_named(tmp_path):
    root = _tree(tmp_path)
    for name in ("ruler", "ruler_paper", "quickstart"):
        (root / "conf" / "exp" / f"{name}.yaml").write_text("# @package _global_\n# A thing.\nexp: {}\n")
    (root / "conf" / "exp" / "newexp.yaml").unlink()
    res = readme.results_block(root)
    assert res.endswith("No summary committed yet (a run of each is pending; its summary appears here when it lands): "
                        "`ruler`.")
    (root / "results" / "ruler").mkdir()
    (root / "results" / "ruler" / "summary.md").write_text("# ruler\n\n**At a glance:** ok.\n\nCost: 3 min on this "
                                                           "machine.\n\nMachine class: x86_64 CPU, 2 cores.\n")
    res = readme.results_block(root)
    assert "No summary committed yet" not in res
    assert "Cost: 3 min on this machine. Machine class: x86_64 CPU, 2 cores." in res     # figures quoted, not restated


def test_missing_marker_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="add the two marker lines"):
        readme.render("no markers here\n", _tree(tmp_path))


def _example(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"<!-- example: {name} -->\n```python\n", 1)[1].split("```", 1)[0]


def test_the_add_an_experiment_example_runs_resumes_and_rebuilds(tiny_llama_dir, tmp_path, monkeypatch):
    """The README's new kind, installed outside the tree (an entry point in `kvharness.experiments`), runs through
    the driver, skips its finished cells on a rerun, and its summary rebuilds from disk."""
    import csv

    from harness.reporting.rebuild import summarize_from_disk
    from harness.running.config import compose
    from harness.running.driver import run

    code = _example("harness/experiments/first_token.py")
    assert len(code.splitlines()) < 60
    site = tmp_path / "site"
    (site / "first_token_example-0.1.dist-info").mkdir(parents=True)
    (site / "first_token_example.py").write_text(code)
    (site / "first_token_example-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: x\nVersion: 1\n")
    (site / "first_token_example-0.1.dist-info" / "entry_points.txt").write_text(
        "[kvharness.experiments]\nfirst_token = first_token_example:EXPERIMENT\n")
    monkeypatch.syspath_prepend(str(site))
    overrides = ["exp.kind=first_token", "exp.name=first_token", "exp.systems=[dense,streaming]",
                 "+exp.params.lengths=[200,400]", "+exp.params.budget=64", f"model.path={tiny_llama_dir}",
                 "model.dtype=float32", "model.max_input_tokens=1000", "model.max_model_len=2048", "progress=false",
                 f"results_dir={tmp_path / 'results'}"]
    first = run(compose(overrides))
    assert [m["length"] for m in first] == [200, 400, 200, 400] and all(m["ttft_ms"] > 0 for m in first)
    folder = tmp_path / "results" / "first_token"
    rows = list(csv.DictReader(open(folder / "summary.csv")))
    assert {r["system"] for r in rows} == {"engine-dense", "engine-streaming"}
    assert (folder / "ttft.png").is_file() and "**At a glance:** `engine-dense`" in (folder / "summary.md").read_text()
    assert run(compose(overrides)) == first                                  # complete cells are reused
    md = (folder / "summary.md").read_text()
    (folder / "summary.md").unlink()
    summarize_from_disk(overrides)
    assert (folder / "summary.md").read_text().split("Made by")[0] == md.split("Made by")[0]
