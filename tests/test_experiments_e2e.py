"""Each experiment end to end at toy scale on the tiny random model: cells run, summary.md / .csv / PNGs appear."""
import csv

import pytest
from hydra import compose, initialize_config_dir

from harness.running.config import CONF_DIR, UserError
from harness.running.driver import run
from harness.running.schema import register

register()  # the structured config schema `python -m harness` registers on import

TOY = ["model.dtype=float32", "model.max_input_tokens=1000", "model.max_model_len=2048", "progress=false"]
SRT = "needlebench_srt:{lengths:[300],depths:[50],max_new_tokens:4,repeats:1}"


def _run(exp: str, model_dir, results, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+exp={exp}", f"model.path={model_dir}",
                                                       f"results_dir={results}", *TOY, *overrides])
    out = run(cfg)
    folder = results / cfg.exp.name
    md = (folder / "summary.md").read_text()
    assert md.startswith(f"# {cfg.exp.name}") and "**At a glance:**" in md and "Regenerate: `" in md
    tables = {}
    for path in folder.glob("*.csv"):           # tidy: one row type per file, named for it
        with open(path) as f:
            tables[path.stem] = list(csv.DictReader(f))
    assert tables and all(tables.values()) and (folder / "results.json").is_file()
    return out, md, tables, sorted(p.name for p in folder.glob("*.png"))


def test_accuracy_retention_end_to_end(tiny_llama_dir, tmp_path):
    _, md, rows, pngs = _run("accuracy_retention", tiny_llama_dir, tmp_path, "exp.systems=[dense,snapkv]",
                             "exp.tasks=[needlebench_srt]", "exp.params.budget=64",
                             f"exp.params.task_params={{{SRT}}}")
    assert "## Per task unit" in md and "retention [95 % CI]" in md and pngs == ["fidelity.png", "retention.png"]
    rows = rows["scores"]
    assert {r["system"] for r in rows} == {"engine-dense", "engine-snapkv"}
    unit = next(r for r in rows if r["system"] == "engine-snapkv" and r["task"] == "needlebench_srt")
    assert unit["n"] == "1" and {"ci_low", "ci_high"} <= {k.removeprefix("retention_") for k in unit}
    assert float(unit["fid_top1"]) >= 0 and float(unit["fid_kl"]) >= 0        # teacher-forced fidelity ran
    assert "Machine class:" in md and "model dtype float32" in md


def test_accuracy_retention_sweeps_budgets(tiny_llama_dir, tmp_path):
    """exp.params.budgets: each policy with a budget runs at every budget (`system@budget`), dense once."""
    _, md, rows, _ = _run("accuracy_retention", tiny_llama_dir, tmp_path, "exp.systems=[dense,quest]",
                          "exp.tasks=[needlebench_srt]", "exp.params.budget=null", "+exp.params.budgets=[32,64]",
                          f"exp.params.task_params={{{SRT}}}")
    assert {r["system"] for r in rows["scores"]} == {"engine-dense", "engine-quest@32", "engine-quest@64"}
    assert "at budgets of 32, 64 tokens" in md
    # one policy at two budgets: nothing to compare at equal budget, and pairs across budgets say nothing
    assert "pairwise" not in rows
    cells = sorted(p.name for p in (tmp_path / "accuracy_retention").iterdir() if p.is_dir())
    assert sum("budget=32" in c for c in cells) == 1 and sum("budget=64" in c for c in cells) == 1


def test_budget_and_budgets_together_is_a_one_line_error(tiny_llama_dir, tmp_path):
    from harness.running.config import UserError
    with pytest.raises((UserError, SystemExit), match="budget"):
        _run("accuracy_retention", tiny_llama_dir, tmp_path, "exp.systems=[dense,quest]", "exp.tasks=[needlebench_srt]",
             "+exp.params.budgets=[32]", "exp.params.budget=64", f"exp.params.task_params={{{SRT}}}")


def test_needlebench_end_to_end_all_modes(tiny_llama_dir, tmp_path):
    params = (f"exp.params.task_params={{{SRT},needlebench_mrt:{{lengths:[300],depths:[10,50],max_new_tokens:4}},"
              "needlebench_mrs:{lengths:[300],depths:[10],needle_counts:[2],max_new_tokens:4}}")
    _, md, rows, pngs = _run("needlebench", tiny_llama_dir, tmp_path, "exp.systems=[dense]", params)
    assert pngs == ["heatmap_mrs.png", "heatmap_mrt.png", "heatmap_srt.png"]
    overall = rows["overall"]
    assert len(overall) == 1 and overall[0]["v2_overall"] != ""       # all three modes ran: the overall is defined
    assert "- v2 overall (0–100): engine-dense " in md


def test_cake_ablation_end_to_end(tiny_llama_dir, tmp_path):
    _, md, rows, pngs = _run("cake_ablation", tiny_llama_dir, tmp_path, "exp.params.budgets=[48]",
                             "exp.params.allocations=[preference,uniform]", "exp.params.indicators=[mean_plus_var]",
                             "exp.params.tau1s=[0.5,1.0]", "exp.params.tau2s=[1.0]",
                             f"exp.params.task_params={{{SRT}}}")
    studies = sorted([r["study"] for r in rows["points"]] + ["reference"])
    # the base point runs once (it is also the indicator study's only point and tau (1, 1)), then uniform,
    # tau (0.5, 1), and the dense reference
    assert studies == ["allocation", "allocation", "reference", "tau"]
    assert "| 1 | " in md and "| 0.5 | " in md                   # both tau rows filled
    assert "retention_all.png" in pngs
    pngs = [p for p in pngs if p not in ("retention_all.png", "fidelity_all.png")]
    assert {"allocation.png", "indicator.png", "tau_sweep_b48.png"} == set(pngs)


@pytest.mark.slow
def test_memory_end_to_end_matches_analytic(tiny_llama_dir, tmp_path):
    _, md, rows, pngs = _run("memory", tiny_llama_dir, tmp_path, "exp.systems=[dense,streaming,cake,cake_nocascade]",
                             "exp.params.budget=64", "exp.params.lengths=[300,600]", "exp.params.output_len=4",
                             "exp.params.warmup=false")
    rows = rows["memory"]
    assert all(r["matches_analytic"] == "True" for r in rows)
    peak = {(r["system"], r["length"]): float(r["device_kv_peak_bytes"]) for r in rows}
    assert peak[("engine-cake", "600")] < peak[("engine-cake-nocascade", "600")]   # cascading bounds prefill
    assert "cake_prefill_peak.png" in pngs and "device_kv_vs_length.png" in pngs


def test_memory_one_length_end_to_end(tiny_llama_dir, tmp_path):
    _, md, rows, pngs = _run("memory", tiny_llama_dir, tmp_path, "exp.systems=[dense,snapkv]", "exp.params.budget=64",
                             "exp.params.lengths=[300]", "exp.params.output_len=3", "exp.params.warmup=false")
    assert [r["matches_analytic"] for r in rows["memory"]] == ["True", "True"]
    assert pngs == ["device_kv_vs_length.png"]


def test_decode_microbench_end_to_end(tiny_llama_dir, tmp_path):
    _, md, rows, pngs = _run("decode_microbench", tiny_llama_dir, tmp_path,
                             "exp.params.systems=[dense,quest,quest_kv_head,flexicache,flexicache_naive]",
                             "exp.params.context=256",
                             "exp.params.budget=64", "exp.params.batch_sizes=[1,2]", "exp.params.steps=4",
                             "exp.params.warmup=1")
    rows = rows["points"]
    assert len(rows) == 10 and pngs == ["latency_vs_batch.png", "speedup_vs_batch.png"]
    by = {(r["system"], r["batch"]): r for r in rows}
    assert float(by[("engine-dense", "2")]["pages_read_per_head_step"]) == 17.0     # ceil(256 + 5 tokens / 16)
    assert float(by[("engine-quest-kvhead", "2")]["pages_read_per_head_step"]) == 4.0   # budget 64 = 4 pages
    # per query head: each KV head reads the union of its query heads' 4 pages
    assert 4.0 < float(by[("engine-quest", "2")]["pages_read_per_head_step"]) <= 4.0 * 2   # group of 2
    assert "engine-flexicache-naive ÷ engine-flexicache = " in md and "engine-quest ÷ engine-quest-kvhead = " in md


def test_decode_roofline_end_to_end(tiny_llama_dir, tmp_path):
    """Bytes are counted, not modelled: dense reads every token it holds, FlexiCache whole selected pages plus the
    MinMax bounds it scored; the floor follows from the bandwidth measured in the same run."""
    _, md, rows, pngs = _run("decode_roofline", tiny_llama_dir, tmp_path, "exp.params.systems=[dense,flexicache]",
                             "exp.params.contexts=[64]", "exp.params.batch_sizes=[1,2]", "exp.params.budget=32",
                             "exp.params.steps=2", "exp.params.split_steps=1", "exp.params.warmup=0",
                             "exp.params.bandwidth_gib=0.05")      # no warm-up: FlexiCache's step-1 rerank is timed
    rows = rows["points"]
    assert pngs == ["achieved_vs_attainable.png"] and len(rows) == 4
    assert "its bandwidth floor" in md and "streaming read bandwidth measured in this run" in md
    by = {(r["system"], r["batch"]): r for r in rows}
    dense, flexi = by[("engine-dense", "2")], by[("engine-flexicache", "2")]
    tokens = 64 + 2 + 1                     # context + timed steps + the split step that counts
    assert float(dense["kv_bytes"]) == 2 * 2 * 2 * tokens * 2 * 16 * 4   # batch x layers x KV heads x K,V x fp32
    assert float(dense["metadata_bytes"]) == 0 < float(flexi["metadata_bytes"])
    assert 0 < float(flexi["kv_bytes"]) < float(dense["kv_bytes"])
    for r in rows:
        assert float(r["floor_ms"]) == pytest.approx(float(r["bytes_read"]) / float(r["bandwidth_gbs"]) / 1e6)


def test_ruler_end_to_end(tiny_llama_dir, tmp_path):
    _, md, rows, pngs = _run("ruler", tiny_llama_dir, tmp_path, "exp.systems=[dense,streaming]",
                             "exp.params.budget=64", "exp.params.task_params.ruler.tasks=[niah_single_1,vt]",
                             "exp.params.task_params.ruler.lengths=[1024,1280]",
                             "exp.params.task_params.ruler.num_samples=2", "model.max_input_tokens=1500")
    assert "RULER average per length" in md and "engine-streaming: RULER table" in md
    assert {"ruler_heatmap.png", "retention_vs_length.png"} <= set(pngs)
    cells = [r for r in rows["ruler_table"] if r["task"] == "vt" and r["system"] == "engine-dense"]
    assert sorted(r["length"] for r in cells) == ["1024", "1280"] and all(r["n"] == "2" for r in cells)
    avg = [r for r in rows["ruler_average"] if r["system"] == "engine-streaming"]
    assert avg and avg[0]["score_n"] == "8"
    # rankings and averages use RULER's unit, one length (the mean over its tasks), not task × length cells
    assert "macro retention vs `engine-dense` over lengths" in md
    units = {r["task"] for r in rows["scores"] if r["system"] == "engine-streaming" and r.get("retention_n")}
    assert units == {"ruler/1024", "ruler/1280"}, units
    # what each policy really keeps on the device: the window policy its 64 tokens (whole pages), dense everything
    kv = {r["system"]: float(r["device_kv_tokens"]) for r in rows["averages"] if r.get("device_kv_tokens")}
    assert 64 <= kv["engine-streaming"] <= 64 + 16 < kv["engine-dense"], kv
    assert "device KV (tokens / layer·head)" in md
    # the average says what it covers; niah and vt mark their answers, which dense reads whole in every sample
    assert "RULER average = mean over 2 lengths (1,024, 1,280 tokens) of the mean over 2 of RULER's 13 tasks" in md
    assert "Not RULER's published average" in md and "answer kept [95 % CI] n" in md
    kept = {r["system"]: r for r in rows["averages"] if r.get("answer_kept_n")}
    assert kept["engine-dense"]["answer_kept"] == "100.0" and kept["engine-dense"]["answer_kept_n"] == "8"
    # a length whose prompts exceed the model's input limit fails in one line before its prompts are built
    with pytest.raises(UserError, match="builds prompts of up to 2018 tokens > model.max_input_tokens=1500"):
        _run("ruler", tiny_llama_dir, tmp_path / "long", "exp.systems=[dense]", "exp.params.budget=64",
             "exp.params.task_params.ruler.tasks=[vt]", "exp.params.task_params.ruler.lengths=[1024,2048]",
             "model.max_input_tokens=1500")


def test_budget_sweep_end_to_end(tiny_llama_dir, tmp_path):
    _, md, rows, pngs = _run("budget_sweep", tiny_llama_dir, tmp_path, "exp.systems=[dense,quest,streaming]",
                             "exp.tasks=[needlebench_srt]", "exp.params.budgets=[32,64]", "exp.params.contexts={}",
                             f"+exp.params.task_params.{SRT.replace(':', '=', 1)}")
    assert "score_vs_budget.png" in pngs and "Score, retention and fidelity per policy and budget" in md
    means = {(r["system"], r["budget"]) for r in rows["budget_curve"]}
    assert means == {("engine-quest", "32"), ("engine-quest", "64"), ("engine-streaming", "32"),
                     ("engine-streaming", "64"), ("engine-dense", "")}
    # policies are compared at equal budget only
    pairs = {(r["group"], r["system"], r["other"]) for r in rows["pairwise"]}
    assert pairs == {("budget 32", "engine-quest@32", "engine-streaming@32"),
                     ("budget 64", "engine-quest@64", "engine-streaming@64")}, pairs
    # the needle's keyword is marked in the context: the share of samples whose answer survives, beside the score
    kept = {(r["system"], r["budget"]): r["answer_kept"] for r in rows["budget_curve"]}
    assert kept[("engine-dense", "")] == "100.0" and all(kept.values()), kept
    assert "answer kept" in md and "· kept " in md


def test_quickstart_end_to_end(tiny_llama_dir, tmp_path):
    """`make run` at CI's toy scale: accuracy cells beside a timed throughput cell, one summary."""
    out, md, rows, pngs = _run("quickstart", tiny_llama_dir, tmp_path, "exp.systems=[dense,streaming]",
                               "++exp.params.task_overrides={limit:2}", "exp.params.fidelity={steps:4,gold:false}",
                               "exp.params.throughput.systems=[dense]", "exp.params.throughput.num_requests=2",
                               "exp.params.throughput.input_len=300", "exp.params.throughput.output_len=4")
    assert len(out) == 3 and out[-1]["system"] == "engine-dense" and out[-1]["output_tok_s"] > 0
    assert rows["throughput"][0]["system"] == "engine-dense" and "Offline throughput" in md

