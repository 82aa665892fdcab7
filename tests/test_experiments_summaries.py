"""Experiment arithmetic without a model: retention averages, NeedleBench grids, CAKE ablation points, memory bounds."""
import math

import pytest
from omegaconf import OmegaConf

from harness.experiments import cake_ablation, memory, needlebench
from harness.reporting import plots
from harness.running import grid as grid_lib


def test_needlebench_length_depth_grid_from_rows():
    rows = [{"score": 100.0, "meta": {"mode": "srt", "length": 1000, "depth": 10}},
            {"score": 0.0, "meta": {"mode": "srt", "length": 1000, "depth": 10}},
            {"score": 0.0, "meta": {"mode": "srt", "length": 1000, "depth": 90}},
            {"score": 50.0, "hit_depth10": 100.0, "hit_depth50": 0.0,
             "meta": {"mode": "mrt", "length": 2000, "needles": [{"depth": 10}, {"depth": 50}]}}]
    lengths, depths, grid, counts = needlebench.length_depth(rows)
    assert lengths == [1000, 2000] and depths == [10.0, 50.0, 90.0]
    assert grid[(1000, 10.0)] == 50.0 and counts[(1000, 10.0)] == 2
    assert grid[(2000, 50.0)] == 0.0 and (2000, 90.0) not in grid


def test_cake_points_one_factor_studies_and_tau_sweep():
    import dataclasses
    p = cake_ablation.Params(budgets=[64, 128], allocations=["preference", "uniform"],
                             indicators=["mean_plus_var", "mean"], tau1s=[0.5], tau2s=[0.5, 2.0])
    pts = cake_ablation.points(p)
    per_budget = [x for x in pts if x["budget"] == 64]
    assert [x["study"] for x in per_budget].count("allocation") == 2
    assert [x["study"] for x in per_budget].count("indicator") == 2
    assert {(x["tau1"], x["tau2"]) for x in per_budget if x["study"] == "tau"} == {(0.5, 0.5), (0.5, 2.0)}
    grid = cake_ablation.points(dataclasses.replace(p, full_grid=True, tau1s=[]))
    assert len(grid) == 2 * 2 * 2 and {x["study"] for x in grid} == {"grid"}


def test_cake_alias_rows_answer_for_every_study():
    row = {"study": "allocation", "allocation": "preference", "indicator": "mean_plus_var", "tau1": None,
           "tau2": None, "also": ["indicator", "tau"], "tau_alias": [[1.0, 1.0]]}
    assert cake_ablation._matches(row, "indicator", {"indicator": "mean_plus_var"})
    assert cake_ablation._matches(row, "tau", {"tau1": 1.0, "tau2": 1.0})
    assert not cake_ablation._matches(row, "tau", {"tau1": 0.5, "tau2": 1.0})


def test_memory_analytic_counts():
    from types import SimpleNamespace

    import torch

    from systems.policies import load_policy as load

    dims = SimpleNamespace(page_size=16, num_layers=2, num_q_heads=6, num_kv_heads=3, head_dim=8, max_pages=64,
                           device=torch.device("cpu"), dtype=torch.float32, scale=8 ** -0.5)

    def load_policy(name, params):
        policy = load(name, params)
        policy.configure(dims)
        return policy

    spec = {"layers": 2, "kv_heads": 3, "page_size": 16, "bytes_per_block": 100, "minmax_bytes_per_page": 8}
    dense = memory.analytic(load_policy("dense", {}), spec, n=100, out=5)
    assert dense["tokens_held"] == 104
    assert dense["analytic_device_kv_bytes"] == 2 * 3 * 7 * 100            # ceil(104 / 16) = 7 pages
    snap = memory.analytic(load_policy("snapkv", {"budget": 64, "window": 8}), spec, n=100, out=5)
    assert snap["analytic_device_kv_bytes"] == 2 * 3 * 5 * 100             # prefill-only: 64 + 4 decode tokens
    stream = memory.analytic(load_policy("streaming", {"budget": 64}), spec, n=100, out=5)
    assert stream["analytic_device_kv_bytes"] == 2 * 3 * 4 * 100           # held at 64 while decoding
    cake = memory.analytic(load_policy("cake", {"budget": 40, "window": 8, "cascading": False}), spec, n=100, out=5)
    assert cake["analytic_prefill_peak_bytes"] == 2 * 3 * 7 * 100          # no cascading: the whole prompt


def test_variant_names_every_difference():
    from harness.running.config import load_group
    from harness.running.grid import GridCell
    from harness.running.schema import SystemConfig, TaskConfig
    s, t = load_group("system", "cake", SystemConfig), load_group("task", "needlebench_srt", TaskConfig)
    v = grid_lib.variant(GridCell(s, t, "x"), system_params={"allocation": "uniform"}, task_params={"lengths": [300]})
    assert v.key.startswith("engine-cake__needlebench_srt__") and "allocation=uniform" in v.key
    assert "lengths=" in v.key and s.params.allocation == "preference"   # the template is untouched


def test_plots_write_png(tmp_path):
    a = plots.line_plot(tmp_path / "l.png", {"x": [(1, 2.0), (2, math.nan), (4, 3.0)]}, "n (tokens)", "y (MiB)",
                        "t", dashed={"x": [(1, 2.5), (4, 3.5)]}, logx=True)
    b = plots.heatmap_grid(tmp_path / "g.png", [("s", [[0.0, 100.0], [math.nan, 50.0]], [1000, 2000], ["10", "90"])],
                           xlabel="depth (%)", ylabel="length (tokens)", title="t", colorbar="score")
    c = plots.bar_plot(tmp_path / "b.png", ["a", "b"], {"s": [1.0, math.nan]}, xlabel="x", ylabel="y", title="t",
                       reference=1.0)
    for path in (a, b, c):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_task_params_must_name_known_tasks():
    from harness.running.config import UserError, load_group
    from harness.running.grid import GridCell
    from harness.running.schema import SystemConfig, TaskConfig
    cell = GridCell(load_group("system", "dense", SystemConfig), load_group("task", "needlebench_srt", TaskConfig), "k")
    ok = OmegaConf.create({"exp": {"params": {"task_params": {"recall": {"repeats": 2}}}}})
    # a known task outside the grid is ignored
    assert grid_lib.with_task_params(ok, [cell], {"recall": {"repeats": 2}}) == [cell]
    typo = OmegaConf.create({"exp": {"params": {"task_params": {"needlebench_sr": {"repeats": 2}}}}})
    with pytest.raises(UserError, match="unknown task"):
        grid_lib.with_task_params(typo, [cell], {"needlebench_sr": {"repeats": 2}})


def test_regenerate_line_merges_reruns_of_a_subset_and_made_by_names_every_command():
    from harness.reporting import provenance as report
    cfg = OmegaConf.create({"exp": {"name": "accuracy_retention", "systems": ["dense", "quest", "cake"]}})
    full = "python -m harness +exp=accuracy_retention progress=false"
    rerun = "python -m harness +exp=accuracy_retention exp.systems=[dense,quest] results_dir=/tmp/x progress=false"
    envs = [{"command_line": full}] * 3 + [{"command_line": rerun}] * 2
    # a subset rerun elsewhere is the same experiment: one command remakes every cell
    assert report.regenerate_command(cfg, envs) == full
    made = report.provenance(cfg, envs)
    assert f"`{full}` (3 cells), `{rerun}` (2 cells)" in made
    # cells that only ever ran a subset keep it; commands that differ otherwise fall back to the first
    part = [{"command_line": rerun}]
    assert report.regenerate_command(cfg, part) == full + " exp.systems=[dense,quest]"
    other = [{"command_line": full}, {"command_line": "python -m harness +exp=accuracy_retention exp.params.budget=64"}]
    assert report.regenerate_command(cfg, other) == sorted(e["command_line"] for e in other)[0]
    assert "(1 cell)" in report.provenance(cfg, other)


def test_made_by_names_the_code_that_wrote_a_summary_when_it_differs_from_the_cells():
    from harness.reporting import provenance as report
    from harness.running.envinfo import static_env
    cfg = OmegaConf.create({"exp": {"name": "ruler", "systems": ["dense"]}})
    here = static_env()["code_hash"]
    old = report.provenance(cfg, [{"command_line": "python -m harness +exp=ruler", "code_hash": "0ld"}])
    assert f"this summary written by code `{here}`" in old and "code `0ld`" in old
    same = report.provenance(cfg, [{"command_line": "python -m harness +exp=ruler", "code_hash": here}])
    assert "this summary written" not in same


def test_ruler_summary_shows_each_length_figure_with_the_interval_its_verdicts_use(tmp_path):
    """Uneven synthetic RULER rows: the per-length table, the CSV's unit rows and the rankings share one interval."""
    import csv as csv_lib
    from types import SimpleNamespace

    import numpy as np

    from harness.experiments import ruler
    from harness.experiments.accuracy.params import AccuracyParams
    from harness.running.experiment import Run
    from harness.running.workspace import Workspace
    rng = np.random.default_rng(3)
    cells, rows_by_cell = [], {}
    for i, (system, keep) in enumerate((("engine-dense", 1.0), ("engine-a", 0.7), ("engine-b", 0.3))):
        cells.append(SimpleNamespace(key=f"c{i}", task=SimpleNamespace(name="ruler", family="ruler"),
                                     system=OmegaConf.create({"name": system, "engine": {"page_size": 16}})))
        rows_by_cell[f"c{i}"] = [
            {"id": f"{t}-{L}-{j}", "score": float(100 * (rng.random() < keep * (0.9 if t == "vt" else 0.6))),
             "meta": {"ruler_task": t, "length": L}, "fid_top1": float(keep), "fid_kl": 1 - keep}
            for t in ("niah_single_1", "vt", "cwe") for L in (1024, 2048) for j in range(12)]
    cfg = OmegaConf.create({"exp": {"name": "ruler", "systems": ["dense", "a", "b"]}, "model": {"dtype": "float32"}})
    p = AccuracyParams(reference="engine-dense")
    run = Run(cfg, p, [], tmp_path, Workspace(cfg))
    paths = ruler.write_summary(run, cells, [c.system.name for c in cells], [], rows_by_cell)
    md = open(paths["md"]).read()
    rows = list(csv_lib.DictReader(open(paths["csv_scores"])))
    for system in ("engine-dense", "engine-a"):
        unit = next(r for r in rows if r["task"] == "ruler/2048" and r["system"] == system)
        cell = f"{float(unit['score']):.1f} [{float(unit['score_ci_low']):.1f}, {float(unit['score_ci_high']):.1f}]"
        assert cell in md.split("## Retention per length")[0], (system, cell)
    a = next(r for r in rows if r["task"] == "ruler/1024" and r["system"] == "engine-a")
    assert f"{float(a['retention']):.2f} [{float(a['retention_ci_low']):.2f}, " \
           f"{float(a['retention_ci_high']):.2f}]" in md
    assert "Every task has the same number of samples at each length" in md
    pairs = list(csv_lib.DictReader(open(paths["csv_pairwise"])))
    assert any(r["metric"] == "fid_top1" and r["system"] == "engine-a" for r in pairs)
    assert {r["metric"] for r in pairs} == {"macro_retention", "fid_top1"}


def test_every_system_keeps_its_own_colour_without_a_list_of_names():
    import yaml

    from harness.running.config import CONF_DIR
    names = sorted({yaml.safe_load(p.read_text())["name"] for p in (CONF_DIR / "system").glob("*.yaml")})
    colours = {plots.colour(n) for n in names}
    assert len(colours) == len(names), "two systems share a colour: move plots.SALT to the next one that separates them"
    assert plots.colour("engine-quest@64") == plots.colour("engine-quest")            # a budget keeps the colour

