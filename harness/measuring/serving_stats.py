"""Online serving metrics as `vllm bench serve` computes them: TTFT, TPOT, ITL, E2EL, throughput, goodput.

Definitions (vllm/benchmarks/serve.py `calculate_metrics`, vllm 0.32):
- TTFT = first token-carrying SSE chunk - request start; E2EL = last token-carrying chunk - start.
- TPOT per request = (E2EL - TTFT) / (output_tokens - 1), only for output_tokens > 1; stats over requests.
  For goodput a request with output_tokens <= 1 has TPOT 0.
- ITL = gaps between consecutive token-carrying chunks, pooled over all requests into one list.
- output_tokens = usage.completion_tokens; when the server sent none, re-tokenize the text (1 without a tokenizer).
- mean/median/std (population)/percentile (linear) via numpy, in ms; keys mean_<m>_ms, median_<m>_ms,
  std_<m>_ms, p<P>_<m>_ms.
- A request is good when every given SLO (ttft, tpot, e2el in ms) holds with `metric <= SLO`.

One deliberate difference: a metric with no samples (every request failed) is NaN here, where vLLM prints 0,
so a dead cell never looks fast in a table or a plot.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestOutput:
    """What the client measured for one streamed request (the fields of vLLM's RequestFuncOutput it uses)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0          # usage.completion_tokens; 0 = the server did not say
    ttft: float = 0.0               # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0            # E2EL, seconds
    start_time: float = 0.0         # perf_counter() just before the POST
    generated_text: str = ""
    error: str = ""
    status: int | None = None       # HTTP status; 429/503 mean the server turned the request away


def parse_goodput(spec: Mapping[str, float] | str | Sequence[str] | None) -> dict[str, float]:
    """SLOs in ms from a mapping or vLLM's `ttft:500 tpot:50` form; unknown keys and negatives are errors."""
    if not spec:
        return {}
    if isinstance(spec, str):
        spec = spec.split()
    if not isinstance(spec, Mapping):
        pairs: dict[str, Any] = {}
        for item in spec:
            key, sep, value = str(item).partition(":")
            if not sep:
                raise ValueError(f"goodput SLO {item!r} is not KEY:MS; write e.g. ttft:500 tpot:50")
            pairs[key] = value
        spec = pairs
    out = {}
    items: Mapping[str, Any] = spec
    for key, value in items.items():
        if key not in SLO_KEYS:
            raise ValueError(f"goodput SLO key {key!r} unknown; use any of {list(SLO_KEYS)} (values in ms)")
        try:
            ms = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"goodput SLO {key}={value!r} is not a number of milliseconds") from None
        if ms < 0 or math.isnan(ms):
            raise ValueError(f"goodput SLO {key}={ms} must be a non-negative number of milliseconds")
        out[key] = ms
    return out


def percentile_key(p: float) -> str:
    """vLLM's naming: p99, p99.9."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    if not values_s:
        nan = float("nan")
        return {f"mean_{name}_ms": nan, f"median_{name}_ms": nan, f"std_{name}_ms": nan,
                **{f"{percentile_key(p)}_{name}_ms": nan for p in percentiles}}
    arr = np.asarray(values_s, dtype=np.float64)
    out = {f"mean_{name}_ms": float(np.mean(arr)) * 1000, f"median_{name}_ms": float(np.median(arr)) * 1000,
           f"std_{name}_ms": float(np.std(arr)) * 1000}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p)) * 1000
    return out


def _peaks(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s and max_concurrent_requests: per-second buckets from each token's time."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    end = max(o.start_time + o.latency for o in ok)
    buckets = int(np.ceil(end - t0)) + 1
    tokens, active = np.zeros(buckets), np.zeros(buckets)
    for o in ok:
        times = np.cumsum([o.start_time + o.ttft, *o.itl])
        for t in times:
            b = int(t - t0)
            if 0 <= b < buckets:
                tokens[b] += 1
        active[int(o.start_time - t0):int(o.start_time + o.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def summarize(outputs: Sequence[RequestOutput], duration_s: float, *,
              goodput: Mapping[str, float] | None = None, percentiles: Sequence[float] = (99,),
              metrics: Sequence[str] = METRICS,
              count_tokens: Callable[[str], int] | None = None) -> dict[str, float | int | None]:
    """The result keys of `vllm bench serve --save-result` (durations in s, latencies in ms)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be positive")
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise ValueError(f"metrics {unknown} unknown; choose from {list(METRICS)}")
    slos = parse_goodput(goodput)
    output_lens, ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], [], []
    total_input = completed = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or (count_tokens(o.generated_text) if count_tokens else 1)
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (o.latency - o.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    good = None
    if slos:
        series = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        keys = list(slos)
        good = sum(all(v <= slos[k] / 1000 for k, v in zip(keys, row))
                   for row in zip(*(series[k] for k in keys)))
    total_output = sum(output_lens)
    peak_tokens, peak_concurrency = _peaks(outputs)
    result: dict[str, float | int | None] = {
        "duration": duration_s, "completed": completed, "failed": len(outputs) - completed,
        "rejected": sum(1 for o in outputs if o.status in (429, 503)),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_concurrency,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in metrics:
        result.update(_stats(name, series[name], percentiles))
    return result
