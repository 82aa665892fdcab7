"""Every experiment's figures, drawn from fixture rows: each states its n, the budget and the machine class, and the
issue's defects stay fixed (legends off the lines, one axis per unit, plain ticks at the data, equal lines named)."""
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from harness.reporting import plots
from harness.running.config import load_group
from harness.running.envinfo import machine_class, static_env
from harness.running.experiment import Run
from harness.running.schema import SystemConfig, TaskConfig
from harness.running.workspace import Workspace


@pytest.fixture
def figures(monkeypatch):
    """path name -> every text the figure shows (titles, axis labels, ticks, legend, notes), captured at save."""
    seen: dict[str, list[str]] = {}
    save = plots._save

    def capture(fig, path, note=None):
        out = save(fig, path, note)          # draws the note under the figure, then saves it
        seen[path.name] = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text")) if t.get_text()]
        return out
    monkeypatch.setattr(plots, "_save", capture)
    return seen


def _run(tmp_path, name, params, **exp_params):
    cfg = OmegaConf.create({"exp": {"name": name, "kind": name, "systems": [], "params": exp_params},
                            "model": {"dtype": "float32"}})
    return Run(cfg, params, [], tmp_path, Workspace(cfg))


def _states_n_budget_machine(figures, budget_words):
    assert figures
    machine = machine_class(static_env())
    for name, texts in figures.items():
        text = " ".join(texts)
        assert "n = " in text or "n=" in text, (name, text)
        assert budget_words in text, (name, text)
        assert machine in text, (name, text)


def _accuracy_cells(systems, task="needlebench_srt", rows_of=None, seed=0):
    rng = np.random.default_rng(seed)
    cells, rows = [], {}
    for i, (label, keep) in enumerate(systems):
        system = load_group("system", label.split("@")[0].removeprefix("engine-"), SystemConfig)
        cells.append(SimpleNamespace(key=f"c{i}", system=system, task=load_group("task", task, TaskConfig)))
        rows[f"c{i}"] = rows_of(keep, rng) if rows_of else [
            {"id": f"s{j}", "score": float(100 * (rng.random() < keep)), "fid_top1": keep, "fid_kl": 1 - keep,
             "meta": {"mode": "srt", "length": 1000 * (1 + j % 2), "depth": 10 * (j % 5)}} for j in range(20)]
    return cells, [label for label, _ in systems], rows


def test_accuracy_retention_figures(tmp_path, figures):
    from harness.experiments import accuracy_retention
    from harness.experiments.accuracy.params import AccuracyParams
    cells, labels, rows = _accuracy_cells([("engine-dense", 1.0), ("engine-quest", 0.8), ("engine-snapkv", 0.5)])
    run = _run(tmp_path, "accuracy_retention", AccuracyParams(reference="engine-dense", budget=64), budget=64)
    accuracy_retention.write_summary(run, cells, labels, [], rows)
    assert set(figures) == {"retention.png", "fidelity.png"}
    _states_n_budget_machine(figures, "budget 64 tokens")
    fidelity = " ".join(figures["fidelity.png"])
    # top-1 (a share) and KL (nats) on their own axes: the "perfect agreement" line belongs to top-1 only
    assert "top-1 agreement (share, 95 % CI)" in fidelity and "nats per token" in fidelity


def test_budget_sweep_figure_ticks_budgets_and_names_missing_points(tmp_path, figures):
    from harness.experiments import budget_sweep
    cells, labels, rows = _accuracy_cells([("engine-dense", 1.0), ("engine-quest@32", 0.3), ("engine-quest@128", 0.7),
                                           ("engine-lserve@128", 0.6)])
    run = _run(tmp_path, "budget_sweep", budget_sweep.Params(reference="engine-dense", budgets=[32, 128]),
               budgets=[32, 128])
    budget_sweep.write_summary(run, cells, labels, [], rows)
    _states_n_budget_machine(figures, "budgets 32, 128 tokens")
    text = figures["score_vs_budget.png"]
    assert "32" in text and "128" in text and not any("^" in t for t in text)       # plain ticks, no 2⁵
    assert any("engine-lserve at 32" in t for t in text)                             # the missing point is named


def test_ruler_figures_tick_lengths_in_k(tmp_path, figures):
    from harness.experiments import ruler
    from harness.experiments.accuracy.params import AccuracyParams

    def rows_of(keep, rng):
        return [{"id": f"{t}-{L}-{j}", "score": float(100 * (rng.random() < keep)), "fid_top1": keep,
                 "fid_kl": 1 - keep, "meta": {"ruler_task": t, "length": L}}
                for t in ("vt", "cwe") for L in (1024, 2048) for j in range(6)]
    cells, labels, rows = _accuracy_cells([("engine-dense", 0.9), ("engine-quest", 0.7), ("engine-streaming", 0.4)],
                                          "ruler", rows_of)
    ruler.write_summary(_run(tmp_path, "ruler", AccuracyParams(reference="engine-dense", budget=128), budget=128),
                        cells, labels, [], rows)
    _states_n_budget_machine(figures, "budget 128 tokens")
    assert "1k" in figures["retention_vs_length.png"] and "2k" in figures["retention_vs_length.png"]
    assert "1k" in figures["ruler_heatmap.png"]


def test_needlebench_heatmaps_show_n_once_and_intervals(tmp_path, figures):
    from harness.experiments import needlebench
    from harness.experiments.accuracy.params import AccuracyParams
    cells, labels, rows = _accuracy_cells([("engine-dense", 1.0), ("engine-snapkv", 0.5)])
    for cell in cells:
        cell.task = OmegaConf.create({"name": "needlebench_srt", "family": "needlebench", "params": {"mode": "srt"}})
        for r in rows[cell.key]:
            r["score_v1"] = r["score"]
    needlebench.write_summary(_run(tmp_path, "needlebench", AccuracyParams(reference="engine-dense"), ), cells,
                              labels, [], rows)
    _states_n_budget_machine(figures, "no shared KV budget")
    heat = " ".join(figures["heatmap_srt.png"])
    assert "n = 2 samples per cell" in heat and "2–2" not in heat and "[" in heat        # cells carry their CI


def test_memory_figure_names_equal_lines_and_plain_ticks(tmp_path, figures):
    from harness.experiments import memory
    results = []
    for system, factor in (("engine-dense", 1.0), ("engine-quest", 1.0), ("engine-snapkv", 0.2), ("engine-h2o", 0.2)):
        for n in (1000, 2000, 4000):
            b = 64.0 * n * factor
            results.append({"system": system, "policy": system, "length": n, "tokens_held": n + 15,
                            "output_tokens": 16, "device_kv_final_bytes": b, "analytic_device_kv_bytes": b,
                            "analytic_tolerance_bytes": 0, "device_kv_peak_bytes": b, "minmax_peak_bytes": 0,
                            "host_kv_peak_bytes": 0, "bytes_host_to_device": 0, "ttft_s": 0.1, "tpot_s": 0.01,
                            "mode": "physical", "bytes_per_block": 4096})
    memory.write_summary(_run(tmp_path, "memory", memory.Params(budget=64), budget=64), results)
    _states_n_budget_machine(figures, "budget 64 tokens")
    text = figures["device_kv_vs_length.png"]
    assert "engine-dense = engine-quest" in text and "engine-snapkv = engine-h2o" in text
    assert not any("×10" in t or "^" in t for t in text)


def test_online_sweep_and_throughput_figures(tmp_path, figures):
    from harness.experiments import offline_throughput
    from harness.experiments.online_sweep.params import Params as OnlineParams
    from harness.experiments.online_sweep.report import write_summary as online_summary
    rows = [{"system": s, "request_rate": r, "num_prompts": 8, "completed": 8, "failed": 0, "duration": 4.0,
             "mean_tpot_ms": 50 + r, "mean_ttft_ms": 100 * r, "p99_ttft_ms": 150 * r, "mean_e2el_ms": 900.0}
            for s in ("engine-dense", "vllm") for r in (1.0, 2.0)]
    online_summary(_run(tmp_path, "online_sweep", OnlineParams(num_prompts=8)), rows, [])
    results = [{"system": s, "input_len": 300, "output_len": o, "num_requests": 4, "total_tok_s": 100.0,
                "output_tok_s": 10.0, "req_s": 1.0, "wall_s": 4.0, "device_kv_peak_bytes": 2 ** 20, "mode": "physical",
                "prompt_tokens": 1200, "output_tokens": 4 * o} for s in ("engine-dense", "vllm") for o in (4, 8)]
    offline_throughput.write_summary(_run(tmp_path, "offline_throughput", offline_throughput.Params(num_requests=4)),
                                     results)
    _states_n_budget_machine(figures, "no shared KV budget")
    assert any("n = 8 requests per rate" in t for t in figures["tpot_vs_rate.png"])


def test_decode_microbench_figures_give_each_system_its_own_colour(tmp_path, figures):
    from harness.experiments import decode_microbench
    results = [{"system": s, "batch": b, "total_ms": t * b, "select_ms": 0.1, "attention_ms": t, "after_append_ms": 0,
                "pages_read_per_head_step": 4, "h2d_bytes_per_step": 0, "layers": 2, "num_q_heads": 9,
                "num_kv_heads": 3, "head_dim": 64, "dtype": "float32", "device": "cpu", "pages_per_head": 16}
               for s, t in (("engine-dense", 1.0), ("engine-flexicache", 0.5), ("engine-flexicache-naive", 0.6))
               for b in (1, 2)]
    p = decode_microbench.Params(budget=64, steps=8)
    decode_microbench.write_summary(_run(tmp_path, "decode_microbench", p, budget=64), results, [])
    _states_n_budget_machine(figures, "budget 64 tokens")
    colours = plots.figure_colours(["engine-dense", "engine-flexicache", "engine-flexicache-naive"])
    values = list(colours.values())
    assert min(plots._distance(a, b) for i, a in enumerate(values) for b in values[i + 1:]) >= plots.NEAR


def test_head_stability_and_duo_attention_figures(tmp_path, figures):
    from harness.experiments import duo_attention, head_stability
    heads = [{"layer": layer, "head": h, "ts_mean": 0.5, "ts_std": 0.1, "ts_min": 0.2, "bottom_frequency": 0.1,
              "unstable": (layer, h) == (0, 0)} for layer in range(2) for h in range(2)]
    flexi = {"task": "needlebench_srt", "samples": 4, "windows": 3, "K": 8, "W": 4, "unstable_count": 1,
             "consensus_recall": 0.8, "random_baseline": 0.25, "promoted_share_stable": 0.1,
             "unstable_heads": [[0, 0]], "head_stats": heads}
    results = [{"task": "needlebench_srt", "flexicache": flexi, "rco_by_offset": [[0.5, 0.6, 0.7, 0.2]] * 3}]
    head_stability.write_summary(_run(tmp_path, "head_stability", head_stability.Params()), results)
    metrics = {"gates": [[0.9, 0.1], [0.5, 0.95]], "history": [{"step": 1, "distill": 0.5, "mean_gate": 0.9},
                                                               {"step": 2, "distill": 0.2, "mean_gate": 0.6}],
               "lengths": [200], "sample_tokens": [150, 160], "train_seconds": 60.0, "teacher_seconds": 6.0}
    p = {k: 1 for k in duo_attention.TRAINING} | {"sparsity": 0.5, "steps": 2, "pool": 2}
    duo_attention.write_summary(_run(tmp_path, "duo_attention", duo_attention.Params()), metrics, p, [0, 1])
    _states_n_budget_machine(figures, "no shared KV budget")
