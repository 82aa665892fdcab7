"""Timed offline generate() calls on essay request sets, as `vllm bench throughput` times them, with CPU accounting.

Only `generate()` is timed; token counts come from the returned ids; total tok/s = (prompt + output tokens) /
elapsed, output tok/s = output tokens / elapsed, req/s = N / elapsed. The CPU columns count this process and its
children (vLLM's engine core), read from /proc.
"""
from __future__ import annotations

import time
from typing import Any

from harness.integrations.assets import essay_files
from harness.measuring.cpu_usage import CpuMeter, CpuUsage
from systems.base import GenerationRequest, System


def build_requests(tokenizer: Any, num: int, input_len: int, output_len: int, seed: int) -> list[GenerationRequest]:
    """`num` distinct windows of essay tokens (no shared prefixes, so no system gains from prefix caching)."""
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in essay_files())
    ids = tokenizer.encode(text, add_special_tokens=False)
    need = input_len + num * 997
    while len(ids) < need:
        ids = ids + ids
    stride = max(1, (len(ids) - input_len) // max(1, num))
    start0 = (seed * 7919) % stride
    return [GenerationRequest(request_id=f"r{i}", prompt_token_ids=ids[start0 + i * stride:][:input_len],
                              max_new_tokens=output_len, ignore_eos=True, seed=seed) for i in range(num)]


def measure(system: System, requests: list[GenerationRequest], exclude: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Time one generate() call; the CPU columns count this process and its children (vLLM's engine core) except
    the process subtrees in `exclude`."""
    system.reset_stats()
    with CpuMeter(exclude=exclude) as meter:
        t0 = time.perf_counter()
        completions = system.generate(requests)
        wall = time.perf_counter() - t0
    prompt = sum(c.prompt_tokens for c in completions)
    output = sum(len(c.token_ids) for c in completions)
    mem = system.memory_report()
    ttfts = [c.ttft for c in completions if c.ttft is not None]
    return {"wall_s": wall, "num_requests": len(completions), "prompt_tokens": prompt, "output_tokens": output,
            "total_tok_s": (prompt + output) / wall, "output_tok_s": output / wall, "req_s": len(completions) / wall,
            "device_kv_peak_bytes": mem.device_kv_peak_bytes,
            "device_kv_peak_bytes_per_request": (mem.device_kv_peak_bytes or 0) / max(1, len(completions)),
            "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None, "memory": mem.as_dict(), "mode": mem.mode,
            "execution": mem.execution,
            **cpu_columns(meter.usage)}


def cpu_columns(usage: CpuUsage | None) -> dict[str, Any]:
    return {"cores_busy": usage.cores_busy, "cpu_s": usage.cpu_s, "busy_threads": usage.busy_threads,
            "cpus_allowed": usage.cpus_allowed} if usage else {}
