"""online_sweep: parameter checks before any server starts, the summary/plots it writes, and a tiny end-to-end run."""
from __future__ import annotations

import csv
import os
import re

import numpy as np
import pytest
from omegaconf import OmegaConf

from harness.experiments import online_sweep
from harness.measuring.serving_stats import RequestOutput, summarize
from harness.running.config import UserError


def fake(params: dict, backend: str = "engine", max_model_len: int = 2048):
    cfg = OmegaConf.create({"exp": {"name": "online_sweep", "kind": "online_sweep", "params": params}, "seed": 0,
                            "model": {"max_model_len": max_model_len}})
    cell = OmegaConf.create({"system": {"name": f"sys-{backend}", "backend": backend}})
    return cfg, [cell]


def checked(cfg, cells):
    """Parse then check, as the runner does before any server starts."""
    from harness.running.params import ParamsError, parse
    try:
        p = parse(cfg, online_sweep.Params)
    except ParamsError as exc:
        raise UserError(str(exc)) from None
    online_sweep.check(cfg, cells, p)
    return p


@pytest.mark.parametrize("params, backend, needle", [
    ({"ratez": [1]}, "engine", "unknown key"),
    ({"rates": [0]}, "engine", "rate"),
    ({"rates": []}, "engine", "empty"),
    ({"rates": ["fast"]}, "engine", "fast"),
    ({"process": "poisson", "burstiness": 0.5}, "engine", "process=gamma"),
    ({"process": "zipf"}, "engine", "unknown"),
    ({"goodput": {"latency": 5}}, "engine", "goodput SLO key"),
    ({"num_prompts": 0}, "engine", "num_prompts"),
    ({"input_len": 2000, "output_len": 100}, "engine", "max_model_len"),
    ({"endpoint": "chat"}, "engine", "completions"),
    ({}, "hf", "no HTTP server"),
])
def test_bad_sweep_settings_fail_before_any_server(params, backend, needle):
    cfg, cells = fake(params, backend)
    with pytest.raises(UserError, match=needle):
        checked(cfg, cells)


def test_defaults_pass_and_rates_become_floats():
    cfg, cells = fake({"rates": [1, 2]})
    p = checked(cfg, cells)
    assert p.rates == [1.0, 2.0] and p.num_prompts == online_sweep.Params().num_prompts


def test_summary_has_vllm_keys_per_system_and_rate_and_two_plots(tmp_path):
    cfg, cells = fake({})
    cfg.model.dtype = "bfloat16"
    p = checked(cfg, cells)
    rows = []
    for system, tpot in (("a", 0.01), ("b", 0.02)):
        for rate in (1.0, 2.0):
            outs = [RequestOutput(success=True, prompt_len=8, output_tokens=5, ttft=0.1 * rate, itl=[tpot] * 4,
                                  latency=0.1 * rate + 4 * tpot, start_time=i) for i in range(3)]
            rows.append({"system": system, "request_rate": rate, "burstiness": 1.0, "num_prompts": 3,
                         "input_len": 8, "output_len": 5, **summarize(outs, 3.0)})
    from harness.running.experiment import Run
    from harness.running.workspace import Workspace
    paths = online_sweep.write_summary(Run(cfg, p, [], tmp_path, Workspace(cfg)), rows, [])
    table = list(csv.DictReader(open(paths["csv_rates"])))
    assert [(r["system"], float(r["request_rate"])) for r in table] == [("a", 1.0), ("a", 2.0), ("b", 1.0),
                                                                         ("b", 2.0)]
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "completed",
                "failed", "request_throughput", "output_throughput"):
        assert key in table[0]
    assert float(table[2]["mean_tpot_ms"]) == pytest.approx(20.0)
    md = open(paths["md"]).read()
    assert "At a glance" in md and "at 2 req/s" in md
    for key in ("tpot_png", "ttft_png"):
        assert open(paths[key], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tiny_end_to_end_sweep_through_the_engine_server(tiny_llama_dir, tmp_path):
    """The real path: Hydra config -> engine server subprocess -> streamed Poisson load -> summary."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "harness", "+exp=online_sweep", "exp.systems=[dense]",
           f"model.path={tiny_llama_dir}", "model.max_model_len=2048", "model.max_input_tokens=1000",
           "exp.params.rates=[4,8]", "exp.params.num_prompts=4", "exp.params.input_len=64",
           "exp.params.output_len=8", f"results_dir={tmp_path}", "progress=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = list(csv.DictReader(open(tmp_path / "online_sweep" / "rates.csv")))
    # one row per client (the harness's and `vllm bench serve`) and rate, each client serving every request
    # (the sweep's rounds repeat each pair)
    pairs = [(r["client"], float(r["request_rate"])) for r in table]
    assert set(pairs) == {(r["client"], rate) for r in table for rate in (4.0, 8.0)}
    assert len({r["client"] for r in table}) == 2 and len({pairs.count(x) for x in pairs}) == 1
    assert all(int(r["completed"]) == 4 for r in table)
    assert all(float(r["mean_tpot_ms"]) > 0 and float(r["mean_ttft_ms"]) > 0 for r in table)
    # the server's step tallies: every decode token of the harness client's 4 requests (all but each one's first,
    # which its prompt's last chunk makes), counted once; `vllm bench serve` sends a test request of its own first
    for r in table:
        rows = int(float(r["decode_rows"]))
        assert rows == 4 * 7 if r["client"] == "harness client" else rows >= 4 * 7
        assert int(float(r["decode_steps"])) + int(float(r["mixed_steps"])) > 0
    md = (tmp_path / "online_sweep" / "summary.md").read_text()
    split = md.split("Where the engine servers' decode rows ran", 1)[1]
    assert sum(line.startswith("| engine-dense | 4.0 |") and "| 28 |" in line for line in split.splitlines()) == 3
    # A rerun finds every rate on disk and starts no server.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "starting its server" not in again.stdout + again.stderr


def test_focus_line_states_the_tpot_ratio_at_the_highest_sustained_rate_or_says_none_is():
    from harness.experiments.online_sweep import focus_line

    def row(system, rate, tpot, duration, e2el=20_000.0):
        return {"system": system, "request_rate": rate, "mean_tpot_ms": tpot, "completed": 16, "num_prompts": 16,
                "duration": duration, "mean_e2el_ms": e2el}
    # 16 requests at 0.1 req/s: the last arrives at 160 s; with 20 s of service a queue-free run ends at 180 s
    rows = [row("dense", 0.1, 150.0, 185.0), row("dense", 0.2, 300.0, 150.0), row("flexi", 0.1, 100.0, 182.0),
            row("flexi", 0.2, 120.0, 105.0), row("vllm", 0.1, 75.0, 181.0), row("vllm", 0.2, 90.0, 104.0)]
    line = focus_line(rows, "flexi", ["dense", "vllm"])
    assert line.startswith("at 0.1 req/s, the highest rate `dense` sustains") and "0.67× `dense`'s (150 ms)" in line
    assert "1.33× `vllm`'s (75 ms)" in line
    # completed / duration < 0.9 x rate here (16 / 185 s = 0.086 < 0.09), yet the 0.1 run ended on time
    assert 16 / 185.0 < 0.9 * 0.1
    none = focus_line([{**r, "duration": 400.0} for r in rows], "flexi", ["dense", "vllm"])
    assert "`dense` sustains none of the rates" in none and "at the lowest, 0.1 req/s" in none
    assert "0.67× `dense`" in none
    failed = focus_line([{**r, "completed": 15} if r["system"] == "dense" else r for r in rows], "flexi",
                        ["dense", "vllm"])
    assert "`dense` sustains none" in failed
    # a system with no completed request at that rate (0 or NaN TPOT) is left out of the ratios, not divided by
    empty = focus_line([{**r, "mean_tpot_ms": 0.0} if r["system"] == "vllm" else r for r in rows], "flexi",
                       ["dense", "vllm"])
    assert "0.67× `dense`'s (150 ms)" in empty and "`vllm`" not in empty.split("is ", 1)[1]


def test_versus_lines_name_each_ratio_and_compare_the_reference_with_the_rest():
    """Each rate's line says which TPOT is divided by which: the focus against every other system, and the first of
    `versus` (engine-dense) against the rest (vLLM), so a policy-focused sweep still states the engine's ratio."""
    from harness.experiments.online_sweep.report import versus_lines

    def row(system, tpot, client="harness client"):
        return {"system": system, "request_rate": 0.2, "mean_tpot_ms": tpot, "mean_itl_ms": tpot,
                "cores_busy": 1.5, "client": client}
    rows = [row("flexi", 60.0), row("dense", 40.0), row("vllm", 80.0), row("dense", 44.0, "vllm bench serve"),
            row("flexi", 66.0, "vllm bench serve")]
    harness, bench = versus_lines(rows, "flexi", ["dense", "vllm"])
    assert harness.startswith("harness client, 0.2 req/s: mean TPOT / ITL `flexi` 60.0 / 60.0 ms")
    assert "(TPOT ratios: `flexi` ÷ `dense` 1.50×, `flexi` ÷ `vllm` 0.75×, `dense` ÷ `vllm` 0.50×)" in harness
    # a system missing from a client's rows drops only the ratios it is part of
    assert bench.endswith("(TPOT ratios: `flexi` ÷ `dense` 1.50×)")
    # a cell where no request completed (NaN or 0 TPOT) takes part in no ratio
    # with the requests' TPOTs kept, each ratio carries its interval (each server's requests resampled alone)
    rng = np.random.default_rng(1)
    kept = [{**row("dense", 0.0), "request_tpots_ms": list(40 + 8 * rng.standard_normal(48))},
            {**row("vllm", 0.0), "request_tpots_ms": list(80 + 8 * rng.standard_normal(48))}]
    for r in kept:
        r["mean_tpot_ms"] = r["mean_itl_ms"] = float(np.mean(r["request_tpots_ms"]))
    line, = versus_lines(kept, "dense", ["vllm"])
    value, low, high = (float(x) for x in re.search(r"÷ `vllm` ([\d.]+)× \[([\d.]+), ([\d.]+)\]", line).groups())
    assert low < value < high and 0.4 < low and high < 0.6
    failed = versus_lines([row("flexi", 60.0), row("dense", float("nan")), row("vllm", 0.0)], "flexi",
                          ["dense", "vllm"])
    assert failed == ["harness client, 0.2 req/s: mean TPOT / ITL `flexi` 60.0 / 60.0 ms on 1.50 cores; "
                      "`dense` — / — ms on 1.50 cores; `vllm` 0.0 / 0.0 ms on 1.50 cores"]


def test_step_split_says_where_decode_rows_ran_and_what_each_kind_of_step_cost():
    from harness.experiments.online_sweep.rates import step_split
    from harness.experiments.online_sweep.report import step_line

    tally = {"decode_steps": 100, "decode_rows": 300, "decode_s": 3.0, "mixed_steps": 10, "mixed_rows": 20,
             "mixed_s": 5.0, "prompt_steps": 2, "prompt_s": 1.0}
    split = step_split(tally)
    assert split == {"decode_rows": 320, "beside_prompt_share": 20 / 320, "mixed_steps": 10,
                     "mixed_step_ms": 500.0, "mixed_rows_per_step": 2.0, "decode_steps": 100,
                     "decode_step_ms": 30.0, "decode_rows_per_step": 3.0, "prompt_steps": 2, "prompt_step_ms": 500.0}
    assert step_split(None) == {}                                     # vLLM: no tallies, no columns
    idle = step_split({**tally, "decode_steps": 0, "decode_rows": 0, "mixed_steps": 0, "mixed_rows": 0})
    assert idle["beside_prompt_share"] is None and idle["mixed_step_ms"] is None
    rows = [{"system": "flexi", "request_rate": 0.3, **split}, {"system": "dense", "request_rate": 0.3,
            **step_split({**tally, "mixed_steps": 5, "mixed_rows": 5, "mixed_s": 2.5})},
            {"system": "vllm", "request_rate": 0.3}, {"system": "flexi", "request_rate": 0.1, **split}]
    line = step_line(rows, "flexi", ["dense", "vllm"])
    assert line.startswith("where the decode rows ran at 0.3 req/s (harness client; a row waits for the prompt "
                           "chunk its step runs beside): `flexi` 6 % of its decode rows beside a prompt chunk "
                           "(500.0 ms per such step, 2.0 rows; 30.0 ms per decode-only step, 3.0 rows); `dense` 2 %")
    assert "`vllm`" not in line
    assert step_line([{"system": "vllm", "request_rate": 0.3}], "flexi", ["vllm"]) is None


def test_rounds_pool_their_step_tallies_before_the_split():
    """Over rounds the split is taken of the summed tallies (a share of all rows, ms per step over all steps), not an
    average of each round's ratios; a round without a tally leaves the pooled split empty."""
    from harness.experiments.online_sweep.rates import step_split
    from harness.experiments.online_sweep.report import pooled

    def row(round_, tally):
        return {"system": "dense", "client": "harness client", "request_rate": 0.3, "round": round_,
                "completed": 4, "duration": 10.0, "steps": tally, **step_split(tally)}
    a = {"decode_steps": 10, "decode_rows": 10, "decode_s": 1.0, "mixed_steps": 1, "mixed_rows": 10, "mixed_s": 0.5,
         "prompt_steps": 0, "prompt_s": 0.0}
    b = {**a, "decode_steps": 30, "decode_rows": 90, "decode_s": 0.9, "mixed_rows": 0, "mixed_steps": 0,
         "mixed_s": 0.0}
    (both,) = pooled([row(1, a), row(2, b)])
    assert both["decode_rows"] == 110 and both["beside_prompt_share"] == 10 / 110
    assert both["decode_step_ms"] == 1.9 / 40 * 1e3 and both["mixed_step_ms"] == 500.0
    (partial,) = pooled([row(1, a), {**row(2, None), "steps": None}])
    assert partial["decode_rows"] is None and partial["beside_prompt_share"] is None


@pytest.mark.slow
def test_vllm_bench_client_measures_the_engine_server_beside_the_harness_client(tiny_llama_dir, tmp_path):
    """`vllm bench serve` runs against the engine's server at the same rate as the harness's client; both land in
    the summary with a client column and the agreement table."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    cmd = [sys.executable, "-m", "harness", "+exp=online_sweep", "exp.systems=[dense]",
           f"model.path={tiny_llama_dir}", "model.max_model_len=2048", "model.max_input_tokens=1000",
           "exp.params.rates=[4]", "exp.params.num_prompts=4", "exp.params.input_len=64", "exp.params.output_len=8",
           "exp.params.clients=[harness,vllm_bench]", "exp.params.repeats=2", f"results_dir={tmp_path}",
           "progress=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = list(csv.DictReader(open(tmp_path / "online_sweep" / "rates.csv")))
    assert sorted((r["client"], r["round"]) for r in table) == [("harness client", "1"), ("harness client", "2"),
                                                                ("vllm bench serve", "1"), ("vllm bench serve", "2")]
    assert all(int(r["completed"]) == 4 and float(r["mean_tpot_ms"]) > 0 for r in table)
    assert all(0 < float(r["cores_busy"]) <= (os.cpu_count() or 1) + 0.05 for r in table)
    md = (tmp_path / "online_sweep" / "summary.md").read_text()
    assert "Do the two clients agree?" in md and "n=2 rounds" in md
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)      # every round on disk: no server
    assert again.returncode == 0 and "starting its server" not in again.stdout + again.stderr


def test_client_agreement_compares_mean_tpots_with_an_interval():
    from harness.experiments.online_sweep.report import client_agreement

    rows = [{"system": "s", "request_rate": 1.0, "client": "harness client", "request_tpots_ms": [10.0, 11, 12, 13]},
            {"system": "s", "request_rate": 1.0, "client": "vllm bench serve", "request_tpots_ms": [30.0, 31, 32, 33]},
            {"system": "t", "request_rate": 1.0, "client": "harness client", "request_tpots_ms": [10.0, 20, 30]}]
    (row,) = client_agreement(rows)
    assert row[:2] == ["s", 1.0] and row[-1] == "no" and row[6].startswith("-20.0 [")


def test_repeated_rounds_pool_per_client_and_judge_agreement_against_the_run_to_run_spread():
    """Two rounds per client: the lines use the mean over rounds, a rate counts as completed only when every round
    completed it, and the clients' difference is judged round by round. The same 3 ms gap between the clients is a
    disagreement when it repeats exactly in both rounds, and within the noise when the rounds' gaps differ."""
    from harness.experiments.online_sweep.report import client_agreement, pooled

    def row(client, round_, tpots, completed=4, cores=1.5):
        return {"system": "s", "request_rate": 2.0, "client": client, "round": round_, "request_tpots_ms": tpots,
                "mean_tpot_ms": sum(tpots) / len(tpots) if tpots else 0.0, "completed": completed,
                "duration": 5.0 + round_, "cores_busy": cores}

    steady = [row("harness client", 1, [50.0, 51, 52, 53]), row("vllm bench serve", 1, [53.0, 54, 55, 56]),
              row("harness client", 2, [50.0, 51, 52, 53], completed=3, cores=1.7),
              row("vllm bench serve", 2, [53.0, 54, 55, 56])]
    (h, v) = pooled(steady)
    assert (h["rounds"], h["completed"], h["duration"]) == (2, 3, 7.0)
    assert h["cores_busy"] == pytest.approx(1.6) and h["mean_tpot_ms"] == pytest.approx(51.5)
    assert len(h["request_tpots_ms"]) == 8 and h["round_tpots"][1] == [50.0, 51, 52, 53]
    (agree,) = client_agreement(pooled(steady))
    assert agree[3] == "51.5 / 51.5" and agree[6] == "-3.0 [-3.0, -3.0] n=2 rounds" and agree[-1] == "no"
    drifting = [*steady[:2], row("harness client", 2, [60.0, 61, 62, 63]), steady[3]]
    (agree,) = client_agreement(pooled(drifting))
    assert agree[3] == "51.5 / 61.5" and agree[6].startswith("2.0 [") and agree[-1] == "yes"
    # a round that completed nothing: no mean TPOT of 0 pulls the pooled figure down, and that round is not paired
    empty = [*steady[:3], row("vllm bench serve", 2, [], completed=0)]
    (h, v) = pooled(empty)
    assert v["mean_tpot_ms"] is None and v["completed"] == 0
    (agree,) = client_agreement(pooled(empty))
    assert agree[5] == "54.5 / —" and agree[6].endswith("n=4 requests")


def test_blocked_difference_is_a_t_interval_over_the_blocks_differences():
    from harness.reporting import uncertainty

    e = uncertainty.blocked_difference([10.0, 12.0, 14.0], [9.0, 10.0, 11.0])     # differences 1, 2, 3
    assert (e.value, e.n) == (2.0, 3)
    assert e.high - 2.0 == pytest.approx(4.302653 * 1.0 / 3 ** 0.5, rel=1e-5) and e.low < 0 < e.high
    one = uncertainty.blocked_difference([10.0], [9.0])
    assert one.value == 1.0 and one.fmt(1) == "1.0 [—] n=1"
    with pytest.raises(ValueError):
        uncertainty.blocked_difference([1.0, 2.0], [1.0])


def test_in_flight_span_runs_from_the_first_request_sent_to_the_last_response():
    from harness.experiments.online_sweep.rates import in_flight, measurements

    detail = {"start_times": [10.0, 10.5, 11.0], "latencies": [2.0, 3.0, 0.0], "errors": ["", "", "timeout"]}
    assert in_flight({}, detail) == (10.0, 13.5)         # the failed third request ends nothing
    # `vllm bench serve` keeps its latencies in the summary
    assert in_flight({"latencies": [1.0, 1.0]}, {"start_times": [5.0, 6.0]}) == (5.0, 7.0)
    assert in_flight({}, {"start_times": [], "latencies": []}) is None
    p = online_sweep.Params(rates=[1.0, 2.0], repeats=2, clients=["harness", "vllm_bench"])
    assert measurements(p)[:4] == [(1.0, 1, "harness"), (1.0, 1, "vllm_bench"), (1.0, 2, "harness"),
                                   (1.0, 2, "vllm_bench")]
