"""tracking=mlflow: every cell that runs and the summary land in a real local MLflow store, read back with MLflow's
own client; a bad backend is a one-line error before any work."""
import pytest

from harness.running.config import UserError, compose


def _overrides(tiny_llama_dir, tmp_path, *extra):
    return ["+exp=accuracy_retention", "exp.systems=[dense,streaming]", "exp.tasks=[needlebench_srt]",
            "exp.params.budget=64", "exp.params.fidelity={steps:4,gold:false}",
            "exp.params.task_params={needlebench_srt:{lengths:[300],depths:[50],max_new_tokens:4}}",
            f"model.path={tiny_llama_dir}", "model.dtype=float32", "model.max_input_tokens=1000",
            "model.max_model_len=2048", "progress=false", f"results_dir={tmp_path / 'results'}", *extra]


def test_mlflow_store_holds_every_cell_and_the_summary(tiny_llama_dir, tmp_path):
    pytest.importorskip("mlflow", reason="run `make setup` (requirements/tracking.txt)")
    from mlflow.tracking import MlflowClient

    from harness.running.driver import run

    store = (tmp_path / "mlruns").as_uri()
    run(compose(_overrides(tiny_llama_dir, tmp_path, "tracking=mlflow", f"tracking.uri={store}")))
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("kvharness/accuracy_retention")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    cells = [r for r in runs.values() if r.data.tags["kvharness.kind"] == "cell"]
    assert {r.data.tags["kvharness.system"] for r in cells} == {"engine-dense", "engine-streaming"}
    streaming = next(r for r in cells if r.data.tags["kvharness.system"] == "engine-streaming")
    assert streaming.data.params["system.params.budget"] == "64" and streaming.data.params["task.name"]
    assert streaming.data.metrics["n"] > 0 and "summary.score" in streaming.data.metrics
    assert {a.path for a in client.list_artifacts(streaming.info.run_id)} >= {"config.yaml", "env.json",
                                                                               "metrics.json"}
    summary = runs["summary"]
    assert summary.data.params["budget.tokens"] == "64"
    assert "engine-streaming/needlebench_srt/fid_top1" in summary.data.metrics
    assert "engine-streaming/needlebench_srt/fid_top1_n" in summary.data.metrics
    files = {a.path for a in client.list_artifacts(summary.info.run_id)}
    assert {"summary.md", "results.json", "scores.csv", "fidelity.png", "samples"} <= files
    # a rerun finds every cell on disk: only the summary is logged again
    run(compose(_overrides(tiny_llama_dir, tmp_path, "tracking=mlflow", f"tracking.uri={store}")))
    again = client.search_runs([exp.experiment_id])
    assert len(again) == len(runs) + 1 and sum(r.info.run_name == "summary" for r in again) == 2


def test_unknown_tracking_backend_is_one_line(tiny_llama_dir, tmp_path):
    from harness.running.driver import run

    cfg = compose(_overrides(tiny_llama_dir, tmp_path, "tracking=mlflow"))
    cfg.tracking.backend = "wandb"
    with pytest.raises(UserError, match="tracking='wandb': use tracking=mlflow"):
        run(cfg)
