"""Serving metrics against hand-computed values (vLLM bench serve definitions), and against vLLM itself (slow)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.measuring.serving_stats import RequestOutput, parse_goodput, percentile_key, summarize


def outputs() -> list[RequestOutput]:
    return [
        RequestOutput(success=True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2,
                      start_time=0.0),
        RequestOutput(success=True, prompt_len=20, output_tokens=1, ttft=0.3, latency=0.3, start_time=0.5),
        RequestOutput(success=False, prompt_len=30, status=503, error="overloaded", start_time=0.6),
    ]


def test_hand_computed_metrics():
    m = summarize(outputs(), duration_s=2.0)
    assert (m["completed"], m["failed"], m["rejected"]) == (2, 1, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 5)     # a failed request adds nothing
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    assert m["request_goodput"] is None
    # TTFT over requests: [100, 300] ms; p99 interpolates linearly between them.
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(100)                            # population std
    assert m["p99_ttft_ms"] == pytest.approx(298)
    # TPOT only for output > 1: (0.2 - 0.1) / 3.
    assert m["mean_tpot_ms"] == pytest.approx(100 / 3) and m["p99_tpot_ms"] == pytest.approx(100 / 3)
    assert m["std_tpot_ms"] == pytest.approx(0)
    # ITL pooled over chunks: [20, 30, 50] ms.
    assert m["mean_itl_ms"] == pytest.approx(100 / 3) and m["median_itl_ms"] == pytest.approx(30)
    assert m["p99_itl_ms"] == pytest.approx(49.6)
    assert m["std_itl_ms"] == pytest.approx(math.sqrt(((20 - 100 / 3) ** 2 + (30 - 100 / 3) ** 2
                                                      + (50 - 100 / 3) ** 2) / 3))
    assert m["mean_e2el_ms"] == pytest.approx(250) and m["p99_e2el_ms"] == pytest.approx(299)
    # All 5 tokens land in second 0; both requests are active in second 0.
    assert m["max_output_tokens_per_s"] == 5 and m["max_concurrent_requests"] == 2


def test_goodput_needs_every_slo_and_single_token_requests_have_zero_tpot():
    assert summarize(outputs(), 2.0, goodput={"ttft": 250, "tpot": 50})["request_goodput"] == pytest.approx(0.5)
    # Only the one-token request meets tpot <= 30 ms: its TPOT counts as 0 for goodput.
    assert summarize(outputs(), 2.0, goodput="tpot:30")["request_goodput"] == pytest.approx(0.5)
    assert summarize(outputs(), 2.0, goodput={"e2el": 1000})["request_goodput"] == pytest.approx(1.0)


def test_percentiles_and_metric_selection():
    m = summarize(outputs(), 1.0, percentiles=(50, 99.9), metrics=("ttft",))
    assert percentile_key(99.9) == "p99.9" and "p99.9_ttft_ms" in m and "p50_ttft_ms" in m
    assert m["p50_ttft_ms"] == pytest.approx(200)
    assert "mean_tpot_ms" not in m and "mean_itl_ms" not in m


def test_output_token_fallbacks():
    o = [RequestOutput(success=True, prompt_len=3, ttft=0.1, latency=0.5, itl=[0.2, 0.2], generated_text="abcd")]
    assert summarize(o, 1.0)["total_output_tokens"] == 1                     # no usage, no tokenizer
    m = summarize(o, 1.0, count_tokens=len)
    assert m["total_output_tokens"] == 4 and m["mean_tpot_ms"] == pytest.approx(400 / 3)


def test_all_failed_gives_nan_not_zero():
    m = summarize([RequestOutput(status=503), RequestOutput(error="boom")], 1.0)
    assert m["completed"] == 0 and m["failed"] == 2 and m["rejected"] == 1
    assert math.isnan(m["mean_ttft_ms"]) and math.isnan(m["p99_itl_ms"])
    assert m["max_output_tokens_per_s"] == 0


@pytest.mark.parametrize("spec, needle", [
    ("ttft=500", "KEY:MS"), ({"latency": 5}, "unknown"), ({"ttft": -1}, "non-negative"), ("tpot:fast", "number"),
])
def test_bad_goodput_specs(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_goodput(spec)


def test_goodput_forms_agree():
    assert parse_goodput("ttft:500 tpot:50") == parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0,
                                                                                        "tpot": 50.0}


def test_bad_arguments():
    with pytest.raises(ValueError, match="duration"):
        summarize(outputs(), 0)
    with pytest.raises(ValueError, match="unknown"):
        summarize(outputs(), 1.0, metrics=("ttfb",))


@pytest.mark.slow
def test_matches_vllm_calculate_metrics():
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    rng = np.random.default_rng(0)
    ours, theirs, inputs = [], [], []
    for _i in range(40):
        n = int(rng.integers(1, 30))
        itl = list(rng.uniform(0.001, 0.05, n - 1))
        ttft, start = float(rng.uniform(0.01, 0.5)), float(rng.uniform(0, 5))
        ok = bool(rng.random() > 0.1)
        fields = dict(success=ok, prompt_len=int(rng.integers(5, 50)), output_tokens=n if ok else 0, ttft=ttft,
                      itl=itl, latency=ttft + sum(itl), start_time=start)
        ours.append(RequestOutput(**fields))
        theirs.append(RequestFuncOutput(**fields))
        inputs.append(SampleRequest(prompt="x", prompt_len=fields["prompt_len"], expected_output_len=n))
    slos = {"ttft": 300.0, "tpot": 30.0}
    ref, _ = serve.calculate_metrics(inputs, theirs, 7.0, None, [50, 99], slos)
    mine = summarize(ours, 7.0, goodput=slos, percentiles=(50, 99))
    for key in ("completed", "failed", "total_input", "total_output", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"):
        mkey = {"total_input": "total_input_tokens", "total_output": "total_output_tokens"}.get(key, key)
        assert mine[mkey] == pytest.approx(getattr(ref, key)), key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            assert mine[f"{stat}_{metric}_ms"] == pytest.approx(getattr(ref, f"{stat}_{metric}_ms"))
        for p, value in getattr(ref, f"percentiles_{metric}_ms"):
            assert mine[f"{percentile_key(p)}_{metric}_ms"] == pytest.approx(value)
