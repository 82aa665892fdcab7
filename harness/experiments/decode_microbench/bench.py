"""One decode_microbench point: synthetic paged KV for a system's policy, its decode steps timed by phase."""
from __future__ import annotations

import time
from typing import Any

import torch
from omegaconf import DictConfig

from harness.experiments.decode_microbench.params import Params
from harness.measuring.cpu_usage import CpuMeter
from harness.running.config import plain
from systems.engine.kv_cache import TieredKVCache
from systems.engine.model_runner import ModelRunner
from systems.engine.ops import load_ops
from systems.policies import load_policy
from systems.policies.base import SeqInfo

GIB = 1 << 30


def bench_point(system_cfg: DictConfig, dims: dict, batch: int, p: Params, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    """Time `steps` decode steps of `layers` layers for `batch` sequences of `context` tokens; per layer and step."""
    first, n, page = p.layer, p.context, int(system_cfg.engine.page_size)
    layers = list(range(first, first + p.layers))
    hq, hkv, d = dims["num_q_heads"], dims["num_kv_heads"], dims["head_dim"]
    policy = load_policy(system_cfg.policy, plain(system_cfg.params))
    total = n + p.warmup + p.steps + 1
    elem = torch.empty((), dtype=dtype).element_size()
    need_gb = len(layers) * batch * hkv * (-(-total // page) + 1) * 2 * page * d * elem / GIB
    kv = TieredKVCache(num_layers=layers[-1] + 1, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                       max_seqs=batch, max_model_len=total, device_memory_gb=need_gb * 1.05 + 0.01,
                       host_memory_gb=need_gb * 1.05 + 0.01, dtype=dtype, device=device, ops=load_ops(device))
    policy.bind(kv)
    runner = ModelRunner(None, kv, policy, kv.ops)
    gen = torch.Generator(device=device).manual_seed(p.seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)  # noqa
    direction = rand(batch, hq, d)
    for slot in range(batch):
        policy.reset(slot)
        for layer in layers:
            k, v = rand(n, hkv, d), rand(n, hkv, d)
            q = direction[slot].expand(n, hq, d) + p.query_noise * rand(n, hq, d)
            kv.store_prefill(slot, layer, k, v)
            policy.after_prefill_layer(kv, SeqInfo(slot, f"r{slot}", n, n, 0, p.steps), layer, q, k)
    kv.sync_copies()
    slots = torch.arange(batch, device=device)
    timings = {"select": 0.0, "attention": 0.0, "after_append": 0.0}
    pages_read, started, phase_s = 0, [0.0], {}

    def clock(phase: str) -> None:                     # the engine's phase marks, with the device synced
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phase_s[phase] = now - started[0]
        started[0] = now
    with CpuMeter() as meter:                          # the threads the timed steps actually kept busy
        for t in range(1, p.warmup + p.steps + 1):
            need = kv.decode_blocks_needed(slots)
            need[:, :first] = False                        # only the benchmarked layers hold KV
            kv.allocate_decode(slots, need)
            seqs = [SeqInfo(s, f"r{s}", n, n + t, t, p.steps) for s in range(batch)]
            for layer in layers:
                q = direction + p.query_noise * rand(batch, hq, d)
                started[0] = time.perf_counter()
                with torch.inference_mode():
                    runner.decode_layer(layer, q, rand(batch, hkv, d), rand(batch, hkv, d), slots, seqs, clock)
                kv.sync_copies()
                if t > p.warmup:
                    for phase in timings:
                        timings[phase] += phase_s[phase]
                    sel = runner.last_selected
                    pages_read += (int(-(-kv.num_tokens[slots, layer].long() // page).sum()) if sel is None
                                   else _pages_read(sel, hkv, n + t + 1))
    per_step = {f"{k}_ms": 1000 * v / (p.steps * len(layers)) for k, v in timings.items()}
    params = plain(system_cfg.params)
    return {"system": system_cfg.name, "policy": system_cfg.policy, "batch": batch, "context": n,
            "budget": params.get("budget"), "granularity": params.get("granularity"),
            "total_ms": sum(per_step.values()), **per_step,
            "pages_read_per_head_step": pages_read / (p.steps * len(layers) * batch * hkv),
            "pages_per_head": -(-n // page), "layers": len(layers),
            "h2d_bytes_per_step": kv.bytes_host_to_device / ((p.warmup + p.steps) * len(layers)),
            "device_kv_bytes": kv.device_blocks.used_bytes, **dims, "dtype": str(dtype).replace("torch.", ""),
            "device": str(device), "cores_busy": meter.usage.cores_busy if meter.usage else None,
            "busy_threads": meter.usage.busy_threads if meter.usage else None,
            "cpus_allowed": meter.usage.cpus_allowed if meter.usage else None}


def _pages_read(selected: torch.Tensor, hkv: int, tokens: int) -> int:
    """Pages a step reads from memory: per KV head, the union of its rows' sets (per-query-head sets share pages)."""
    rows = selected.view(selected.shape[0], hkv, -1)
    width = int(rows.max()) + 1 if rows.numel() else 1
    mask = torch.zeros(*rows.shape[:2], width + 1, dtype=torch.bool, device=rows.device)
    mask.scatter_(-1, torch.where(rows < 0, width, rows), True)
    return int(mask[..., :width].sum())
