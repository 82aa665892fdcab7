"""model_transfer: τ and flips on synthetic scores with known answers, profile refusal per model, the run end to end."""
import csv
import types

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from harness.experiments.model_transfer import transfer
from harness.running.config import CONF_DIR, UserError
from harness.running.driver import run
from harness.running.schema import register
from systems.policies import load_policy, policy_class

register()


def _model(retentions, n=200, noise=0):
    """Policies scoring 100 on the first round(ret * n) samples and 0 on the rest; the reference 100 everywhere
    except `noise` samples where every system scores 0 (a shared difficulty the paired bootstrap cancels)."""
    policies = [f"p{i}" for i in range(len(retentions))]
    scores = np.zeros((len(retentions), n))
    for i, r in enumerate(retentions):
        scores[i, :round(r * n)] = 100.0
    ref = np.full(n, 100.0)
    ref[n - noise:] = 0.0
    scores[:, n - noise:] = 0.0
    return transfer.ModelScores(policies, [(scores, ref, np.zeros(n))])


def test_tau_is_one_for_the_same_order_and_minus_one_reversed():
    a = transfer.draw(_model([0.9, 0.7, 0.5, 0.3]), resamples=2000)
    same = transfer.draw(_model([0.8, 0.6, 0.4, 0.2]), resamples=2000)
    reversed_ = transfer.draw(_model([0.2, 0.4, 0.6, 0.8]), resamples=2000)
    tau = transfer.tau(a, same)
    assert (tau.value, tau.low, tau.high, tau.n) == (1.0, 1.0, 1.0, 4)
    back = transfer.tau(a, reversed_)
    assert (back.value, back.low, back.high) == (-1.0, -1.0, -1.0)
    assert transfer.flips(["p0", "p1", "p2", "p3"], {"a": a, "b": same}) == []
    assert len(transfer.flips(["p0", "p1", "p2", "p3"], {"a": a, "b": reversed_})) == 6


def test_one_swapped_pair_gives_tau_two_thirds_and_one_supported_flip():
    a = transfer.draw(_model([0.9, 0.7, 0.5, 0.3]), resamples=2000)
    b = transfer.draw(_model([0.7, 0.9, 0.5, 0.3]), resamples=2000)
    tau = transfer.tau(a, b)
    assert tau.value == pytest.approx(4 / 6)                    # 5 concordant, 1 discordant of 6 pairs
    assert tau.low == pytest.approx(4 / 6) and tau.high == pytest.approx(4 / 6)   # the gaps dwarf the noise
    flips = transfer.flips(["p0", "p1", "p2", "p3"], {"a": a, "b": b})
    assert [(f.a, f.b, f.supported) for f in flips] == [("p0", "p1", True)]
    diff = flips[0].difference
    assert diff["a"].value == pytest.approx(0.2) and diff["b"].value == pytest.approx(-0.2)
    # retention is score ÷ reference on the same samples, with a percentile interval around it
    assert a.retention == pytest.approx([0.9, 0.7, 0.5, 0.3])
    est = transfer.estimate(a.retention[0], a.retention_draws[:, 0], a.n)
    assert est.low < 0.9 < est.high and est.n == 200


def test_a_close_pair_flips_without_support_and_tau_interval_is_wide():
    a = transfer.draw(_model([0.51, 0.50, 0.2], n=100), resamples=2000)
    b = transfer.draw(_model([0.50, 0.51, 0.2], n=100), resamples=2000)
    flips = transfer.flips(["p0", "p1", "p2"], {"a": a, "b": b})
    assert [(f.a, f.b, f.supported) for f in flips] == [("p0", "p1", False)]
    tau = transfer.tau(a, b)
    # p0 beats p1 on one sample only: a draw without it ties them (τ-b counts the tie), one with it keeps the order
    assert tau.value == pytest.approx(1 / 3) and tau.low == pytest.approx(1 / 3) and tau.high == pytest.approx(1.0)
    assert transfer.kendall([1, 2, 3], [1, 1, 1]) != transfer.kendall([1, 2, 3], [1, 1, 1])     # NaN: all ties


def _dims(model_name, layers=30, kv_heads=3):
    import torch
    return types.SimpleNamespace(page_size=16, num_layers=layers, num_q_heads=3 * kv_heads, num_kv_heads=kv_heads,
                                 head_dim=64, max_pages=512, device=torch.device("cpu"), dtype=torch.float32,
                                 scale=0.125, layer_windows=(None,) * layers, model_name=model_name)


def test_profiles_key_on_the_model_being_run_and_refuse_another_models():
    smol = "smollm2-135m-instruct"
    load_policy("flexicache", {}).configure(_dims(smol))           # the shipped profile of the model being run
    load_policy("lserve", {}).configure(_dims(smol))
    with pytest.raises(ValueError, match=r"no flexicache profile of model 'new-model'.*`python -m harness "
                                         r"\+exp=head_stability exp.params.ship=true model.name=new-model "
                                         r"results_dir=results/new-model`"):
        load_policy("flexicache", {}).configure(_dims("new-model"))
    with pytest.raises(ValueError, match=r"lserve: no profile of 'new-model'.*`python -m harness "
                                         r"\+exp=duo_attention exp.params.ship=true model.name=new-model "
                                         r"results_dir=results/new-model`"):
        load_policy("lserve", {}).configure(_dims("new-model"))
    # a profile named explicitly (or by another model's name) is still refused when it was made on another model
    shipped = "systems/policy_support/profiles/flexicache__smollm2-135m-instruct__needlebench_mrt.json"
    for params in ({"profile": shipped}, {"profile_model": smol}):
        with pytest.raises(ValueError, match=r"was made on model 'smollm2-135m-instruct', this run's model is "
                                             r"'other'; make one with `python -m harness \+exp=head_stability"):
            load_policy("flexicache", params).configure(_dims("other"))
    with pytest.raises(ValueError, match="was made on model 'smollm2-135m-instruct'.*exp=duo_attention"):
        load_policy("lserve", {"profile_model": smol}).configure(_dims("other"))
    # the harness asks before it runs anything
    assert policy_class("flexicache").missing_profile({}, smol) is None
    assert "model.name=new-model" in policy_class("lserve").missing_profile({}, "new-model")
    assert policy_class("lserve").missing_profile({"streaming_heads": [[0, 0]]}, "new-model") is None
    assert policy_class("quest").missing_profile({}, "new-model") is None


TOY = ["model.dtype=float32", "model.max_input_tokens=1000", "model.max_model_len=2048", "progress=false"]


def test_model_transfer_end_to_end_on_two_tiny_models(tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    models = f"[{{name:tiny-a,path:'{tiny_llama_dir}'}},{{name:tiny-b,path:'{tiny_qwen2_dir}'}}]"
    overrides = [f"exp.models={models}", f"results_dir={tmp_path}", *TOY,
                 "exp.systems=[dense,streaming,quest,flexicache]", "exp.tasks=[needlebench_srt]",
                 "exp.params.budget=32",
                 "exp.params.min_reference_score=-1", "exp.params.task_params.needlebench_srt="
                 "{lengths:[300],depths:[50],repeats:3,max_new_tokens:4}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["+exp=model_transfer", *overrides])
    out = run(cfg)
    assert len(out) == 2 * 3                                   # flexicache has no profile of either tiny model
    folder = tmp_path / "model_transfer"
    md = (folder / "summary.md").read_text()
    assert md.startswith("# model_transfer") and "**At a glance:** Kendall τ between the retention rankings" in md
    assert "tiny-a: score and retention vs `engine-dense`" in md and "tiny-b: score and retention" in md
    assert "flexicache on tiny-a" in md and "model.name=tiny-b" in md            # left out, with the command
    assert (folder / "retention_by_model.png").is_file()
    for model in ("tiny-a", "tiny-b"):                          # each model's own run and summary in its folder
        assert (folder / model / "summary.md").is_file()
    with open(folder / "retention.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["model"], r["system"]) for r in rows} == {(m, s) for m in ("tiny-a", "tiny-b")
                                                         for s in ("engine-streaming", "engine-quest")}
    assert all(r["retention_n"] == "3" for r in rows)
    # `python -m harness.report` rebuilds every model's summary and the one across models from disk
    from harness.reporting.rebuild import summarize_from_disk
    (folder / "summary.md").unlink()
    summarize_from_disk(["+exp=model_transfer", *overrides])
    assert (folder / "summary.md").read_text().startswith("# model_transfer")
    # a kind that does not compare models refuses exp.models in one line
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        bad = compose(config_name="config", overrides=["+exp=ruler", f"exp.models={models}",
                                                        f"results_dir={tmp_path}", *TOY])
    with pytest.raises(UserError, match="does not compare models: drop exp.models"):
        run(bad)
    # one model per folder: a plain run of another model into tiny-a's folder is refused before any work
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        other = compose(config_name="config", overrides=["+exp=model_transfer", *overrides, "exp.models=[]",
                                                          "exp.name=model_transfer/tiny-a", "model.name=tiny-b",
                                                          f"model.path={tiny_qwen2_dir}"])
    before = sorted(p.name for p in (folder / "tiny-a").iterdir())
    with pytest.raises(UserError, match="holds cells of model 'tiny-a', not 'tiny-b': give this model its own folder"):
        run(other)
    assert sorted(p.name for p in (folder / "tiny-a").iterdir()) == before
