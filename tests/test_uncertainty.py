"""Bootstrap intervals (harness.reporting.uncertainty) and the accuracy tables built on them (accuracy/data.py)."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from harness.experiments.accuracy.data import AccuracyData
from harness.reporting import uncertainty as unc


def test_mean_interval_is_scipys_percentile_bootstrap_and_seeded():
    x = np.random.default_rng(1).integers(0, 2, 120) * 100.0
    e = unc.mean(x)
    ref = stats.bootstrap((x,), np.mean, n_resamples=unc.N_RESAMPLES, method="percentile",
                          random_state=np.random.default_rng(unc.SEED)).confidence_interval
    assert (e.low, e.high) == pytest.approx((ref.low, ref.high))
    assert e == unc.mean(x) and e.n == 120 and e.low < e.value < e.high


def test_format_names_interval_and_n():
    assert unc.Estimate(0.8234, 0.71, 0.93, 120).fmt() == "0.82 [0.71, 0.93] n=120"
    assert unc.Estimate(0.8, math.nan, math.nan, 1).fmt() == "0.80 [—] n=1"
    assert unc.NAN.fmt() == "—"


def test_retention_is_chance_corrected_and_paired():
    rng = np.random.default_rng(2)
    difficulty = rng.uniform(20, 80, 200)                     # shared per-sample difficulty
    ref = difficulty + rng.normal(0, 3, 200)
    pol = 0.8 * difficulty + rng.normal(0, 3, 200)
    chance = np.full(200, 10.0)
    e = unc.retention(pol, ref, chance)
    assert e.value == pytest.approx((pol.mean() - 10) / (ref.mean() - 10))
    assert e.low < e.value < e.high
    # unpaired: resample the two systems independently; pairing must give a much narrower interval
    unpaired = stats.bootstrap((pol, ref), lambda a, b, axis: (a.mean(axis) - 10) / (b.mean(axis) - 10),
                               paired=False, n_resamples=2000, method="percentile",
                               random_state=np.random.default_rng(0)).confidence_interval
    assert (e.high - e.low) < 0.5 * (unpaired.high - unpaired.low)


def test_single_unit_stratified_agrees_with_scipy_paired():
    rng = np.random.default_rng(3)
    p, r = rng.integers(0, 2, 150) * 100.0, rng.integers(0, 2, 150) * 100.0
    e = unc.retention(p, r)
    ref = stats.bootstrap((p, r), lambda a, b, axis: a.mean(axis) / b.mean(axis), paired=True,
                          n_resamples=unc.N_RESAMPLES, method="percentile",
                          random_state=np.random.default_rng(9)).confidence_interval
    assert e.low == pytest.approx(ref.low, abs=0.03) and e.high == pytest.approx(ref.high, abs=0.03)


def test_difference_excludes_zero_only_when_supported():
    rng = np.random.default_rng(4)
    base = rng.integers(0, 2, 100) * 100.0
    better = np.maximum(base, rng.integers(0, 2, 100) * 100.0)      # never worse, often better
    assert unc.difference(better, base).excludes(0)
    noisy = np.where(rng.random(100) < 0.05, 100 - base, base)      # 5 % flipped either way
    assert not unc.difference(noisy, base).excludes(0)


def _cells(*pairs, family="needlebench"):
    return [SimpleNamespace(key=f"c{i}", task=SimpleNamespace(name=task, family=family))
            for i, (_, task) in enumerate(pairs)]


def test_unpaired_ratio_resamples_each_sample_on_its_own():
    rng = np.random.default_rng(3)
    a, b = 50 + 5 * rng.standard_normal(40), 100 + 5 * rng.standard_normal(30)
    est = unc.unpaired_ratio(a, b)
    assert est.value == pytest.approx(a.mean() / b.mean()) and est.n == 30
    ref = stats.bootstrap((a, b), lambda p, q, axis: p.mean(axis) / q.mean(axis), paired=False, vectorized=True,
                          n_resamples=unc.N_RESAMPLES, method="percentile", random_state=np.random.default_rng(0))
    assert (est.low, est.high) == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high))
    assert est.low < est.value < est.high and 0.45 < est.low and est.high < 0.55       # about 0.5 by construction
    assert math.isnan(unc.unpaired_ratio(a, [0.0, 0.0]).value)                # no division by a zero mean
    assert math.isnan(unc.unpaired_ratio([1.0], [2.0]).low)                   # one request: no interval


def test_accuracy_data_units_retention_ranking_and_flags():
    rng = np.random.default_rng(5)
    n = 80
    ref = (rng.random(n) < 0.8) * 100.0
    strong = np.where(rng.random(n) < 0.95, ref, 100 - ref)          # close to the reference
    weak = np.where(rng.random(n) < 0.5, 0.0, ref)                   # loses half of what the reference finds
    def rows(scores, ds=("a", "b")):
        return [{"id": f"s{i}", "score": float(v), "meta": {"dataset": ds[i % 2]}, "fid_top1": float(v > 0)}
                for i, v in enumerate(scores)]
    cells = _cells(("dense", "t"), ("strong", "t"), ("weak", "t"), ("dense", "z"), family="longbench")
    by_cell = {"c0": rows(ref), "c1": rows(strong), "c2": rows(weak),
               "c3": [{"id": f"z{i}", "score": 0.0, "meta": {}} for i in range(10)]}
    data = AccuracyData(cells, ["dense", "strong", "weak", "dense"], by_cell)
    assert data.units == ["t/a", "t/b", "z"]                   # a dataset per unit; z is flagged (reference 0)
    assert data.flagged("dense") == ["z"] and data.usable("dense") == ["t/a", "t/b"]
    assert data.retention("strong", "t/a", "dense").n == n // 2
    ranking = data.ranking("dense")
    assert ranking.startswith("strong ") and " > weak " in ranking
    macro = data.macro_retention("weak", "dense")
    assert macro.n == n and macro.high < 0.8
    md, csv = data.pairwise_table("dense")
    assert csv[0]["verdict"] == "strong keeps more"
    top1 = data.fidelity_pairwise("fid_top1", "dense")
    assert [(r["system"], r["other"], r["verdict"]) for r in top1] == [("strong", "weak", "strong higher")]


def test_device_kv_is_resident_pages_times_page_size_per_layer_and_head():
    from omegaconf import OmegaConf
    cell = SimpleNamespace(key="c0", task=SimpleNamespace(name="t", family="needlebench"),
                           system=OmegaConf.create({"engine": {"page_size": 16}}))
    rows = [{"id": f"s{i}", "score": 100.0, "meta": {},
             "kv_stats": {"kept_tokens": [[100, 100], [100, 100]], "device_pages": pages}}
            for i, pages in enumerate((28, 36))]
    kv = AccuracyData([cell], ["snap"], {"c0": rows}).device_kv("snap")
    assert kv.value == (28 + 36) * 16 / 4 / 2 and kv.n == 2
    # HF and vLLM cells carry an engine block too, but their rows report no kv_stats: no device KV to show
    hf_rows = [{**r, "kv_stats": {}} for r in rows]
    assert AccuracyData([cell], ["hf"], {"c0": hf_rows}).device_kv("hf").n == 0


def test_ranking_says_indistinguishable_inside_the_noise():
    rng = np.random.default_rng(6)
    ref = (rng.random(40) < 0.7) * 100.0
    a = np.where(rng.random(40) < 0.9, ref, 100 - ref)
    b = np.where(rng.random(40) < 0.9, ref, 100 - ref)
    cells = _cells(("dense", "t"), ("a", "t"), ("b", "t"))
    by_cell = {f"c{i}": [{"id": f"s{j}", "score": float(v), "meta": {}} for j, v in enumerate(x)]
               for i, x in enumerate((ref, a, b))}
    data = AccuracyData(cells, ["dense", "a", "b"], by_cell)
    assert " ≈ " in data.ranking("dense") and " > " not in data.ranking("dense")


def test_task_units_follow_what_the_benchmark_reports():
    """RULER reports one number per length (the mean over its tasks), so its tasks are not separate units."""
    rows = [{"id": f"{t}-{L}-{i}", "score": 100.0, "meta": {"ruler_task": t, "length": L}}
            for t in ("niah_single_1", "vt") for L in (1024, 2048) for i in range(3)]
    data = AccuracyData(_cells(("dense", "ruler"), family="ruler"), ["dense"], {"c0": rows})
    assert data.units == ["ruler/1024", "ruler/2048"] and data.n("dense", "ruler/1024") == 6
    one_length = [r for r in rows if r["meta"]["length"] == 1024]
    data = AccuracyData(_cells(("dense", "ruler"), family="ruler"), ["dense"], {"c0": one_length})
    assert data.units == ["ruler"]
