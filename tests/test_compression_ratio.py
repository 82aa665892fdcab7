"""exp.params.compression_ratio (kvpress's budget language): per-sample budgets from each prompt's length, rounded to
each policy's granularity, carried by the request into generation and teacher forcing; exclusive with budget."""
import json

import pytest
from omegaconf import OmegaConf

from harness.experiments.accuracy import ratio
from harness.running.config import UserError, compose, load_group
from harness.running.schema import SystemConfig


def _system(name, **params):
    s = load_group("system", name, SystemConfig)
    s.merge_with({"params": params})
    return s


def test_budget_is_kvpress_kept_count_rounded_down_to_the_policy_granularity():
    # kvpress: n_kept = int(k_len * (1 - r)); token policies keep that many, paged ones whole pages of it
    assert ratio.budget_for(_system("snapkv"), 0.5, 301) == 150
    assert ratio.budget_for(_system("quest"), 0.5, 301) == 144                 # 16-token pages
    assert ratio.budget_for(_system("lserve"), 0.5, 301) == 128                # 64-token physical pages
    assert ratio.budget_for(_system("quest"), 0.99, 301) == 16                 # never below one page
    assert ratio.budget_for(_system("snapkv"), 0.0, 301) == 301                # ratio 0 keeps everything
    assert ratio.applies(_system("snapkv"), 0.5) and not ratio.applies(_system("dense"), 0.5)
    assert "kvpress compression_ratio 0.5" in ratio.phrase(0.5, None, None)


def test_ratio_and_budget_are_exclusive_and_the_ratio_is_a_share():
    with pytest.raises(UserError, match="compression_ratio or exp.params.budget"):
        ratio.check(0.5, 64, None)
    with pytest.raises(UserError, match="0 <= ratio < 1"):
        ratio.check(1.0, None, None)
    from harness.running.driver import prepare
    cfg = compose(["+exp=accuracy_retention", "exp.params.budget=64", "+exp.params.compression_ratio=0.5"])
    with pytest.raises(UserError, match="not both"):
        prepare(cfg)


def test_a_policy_that_cannot_keep_a_sample_names_it():
    class S:
        id = "s1"
    with pytest.raises(UserError, match="sample 's1'.*lower the ratio"):
        ratio.sample_budgets(_system("snapkv", window=32), 0.95, [S()], [[1] * 300])   # 15 tokens < window


def test_each_sample_runs_at_its_own_budget(tiny_llama_dir, tmp_path):
    from harness.running.driver import run
    overrides = ["+exp=accuracy_retention", "exp.systems=[dense,snapkv,quest]", "exp.tasks=[needlebench_srt]",
                 "+exp.params.compression_ratio=0.5", "exp.params.budget=null",
                 "exp.params.fidelity={steps:4,gold:false}",
                 "exp.params.task_params={needlebench_srt:{lengths:[300,500],depths:[50],max_new_tokens:4}}",
                 f"model.path={tiny_llama_dir}", "model.dtype=float32", "model.max_input_tokens=1000",
                 "model.max_model_len=2048", "progress=false", f"results_dir={tmp_path}"]
    run(compose(overrides))
    folder = tmp_path / "accuracy_retention"
    cells = {d.name.split("__")[0]: d for d in folder.iterdir() if (d / "metrics.json").is_file()}
    assert cells["engine-snapkv"].name.endswith("__compression_ratio=0.5")        # the ratio names the cell
    assert "compression_ratio" not in cells["engine-dense"].name
    for system, step in (("engine-snapkv", 1), ("engine-quest", 16)):
        rows = [json.loads(x) for x in (cells[system] / "predictions.jsonl").read_text().splitlines()]
        assert len({r["prompt_tokens"] for r in rows}) > 1                     # two lengths: two budgets
        for r in rows:
            assert r["kv_budget"] == max(step, int(r["prompt_tokens"] * 0.5) // step * step)
            assert "fid_top1" in r
    snap = [json.loads(x) for x in (cells["engine-snapkv"] / "predictions.jsonl").read_text().splitlines()]
    for r in snap:      # SnapKV holds its budget after prefill: what each head kept is that sample's budget
        kept = [n for layer in r["kv_stats"]["kept_tokens"] for n in layer]
        assert max(kept) <= r["kv_budget"] + r["output_tokens"] and r["kv_stats"]["budget_tokens_per_layer"] == \
            r["kv_budget"]
    doc = json.loads((folder / "results.json").read_text())
    assert doc["budget"]["compression_ratio"] == 0.5 and doc["budget"]["tokens"] is None
    assert "kvpress compression_ratio 0.5" in (folder / "summary.md").read_text()
    assert OmegaConf.load(cells["engine-snapkv"] / "config.yaml").compression_ratio == 0.5
