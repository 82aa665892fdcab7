"""One decode_roofline point: a batch of synthetic caches under one policy, the model's real decode steps timed.

The model is real (its weights stream every step); the caches are synthetic: every layer of every sequence holds
`context` random keys and values, stored and handed to the policy's after-prefill hook exactly as a real prefill
would (with random queries: a fixed direction per sequence plus noise, so consecutive top-K sets overlap as they do
for stable heads). The steps are the engine's own (ModelRunner.decode_tokens: the fused CPU step, the policy's
hooks between its halves), timed whole; a second set is timed layer by layer for the split into selection,
attention and the rest. Bytes a step reads are counted, not modelled: the weights, the KV each head actually
attended to (all its tokens, or the pages its policy selected), the MinMax bounds the page scorers read.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from harness.measuring.cpu_usage import CpuMeter
from systems.engine.engine import Engine
from systems.policies.base import SeqInfo


def weight_bytes(engine: Engine) -> int:
    """Bytes of weights one decode step streams: every projection, the norms and the LM head (the embedding rows
    it looks up are counted per sequence)."""
    model = engine.model
    linears = [model.lm_head] + [m for lw in model.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    norms = [model.norm] + [t for lw in model.layers for t in (lw.ln1, lw.ln2)]
    return sum(m.weight.numel() * m.weight.element_size() for m in linears) + sum(
        t.numel() * t.element_size() for t in norms)


@torch.inference_mode()         # as the engine's prefill: policy state made while decoding is an inference tensor
def fill(engine: Engine, batch: int, context: int, total_steps: int, noise: float, gen: torch.Generator) -> None:
    """Slots 0..batch-1 hold `context` synthetic tokens in every layer, prepared by the policy as after a prefill."""
    kv, policy, spec = engine.kv, engine.policy, engine.model.spec
    hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(kv.dtype)

    for slot in range(batch):
        policy.reset(slot)
        info = SeqInfo(slot, f"r{slot}", context, context, 0, total_steps)
        direction = rand(hq, d)
        for layer in range(spec.num_layers):
            k, v = rand(context, hkv, d), rand(context, hkv, d)
            kv.store_prefill(slot, layer, k, v)
            policy.after_prefill_layer(kv, info, layer, direction + noise * rand(context, hq, d), k)
    kv.sync_copies()


def kv_bytes_read(engine: Engine, slots: torch.Tensor, layer: int, selected: torch.Tensor | None) -> int:
    """K and V bytes one layer's attention read: every token a head holds (within its window), or whole selected
    pages (per KV head, the union of its query heads' sets)."""
    kv = engine.kv
    token_bytes = 2 * kv.head_dim * kv.k_pool.element_size()
    if selected is None:
        counts = kv.num_tokens[slots, layer].long()
        window = engine.model.spec.layer_windows[layer]
        return int((counts.clamp(max=window) if window else counts).sum()) * token_bytes
    rows = selected.reshape(selected.shape[0], kv.num_kv_heads, -1)
    width = int(rows.max()) + 1 if rows.numel() else 1
    mask = torch.zeros(*rows.shape[:2], width + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(rows < 0, width, rows).long(), True)
    return int(mask[..., :width].sum()) * kv.page_size * token_bytes


def measure(engine: Engine, batch: int, context: int, steps: int, split_steps: int, warmup: int, noise: float,
            seed: int) -> dict[str, Any]:
    """Fill, warm up, time `steps` whole decode steps, then `split_steps` layer by layer; free the slots."""
    kv, policy, runner, spec = engine.kv, engine.policy, engine.runner, engine.model.spec
    gen = torch.Generator().manual_seed(seed)
    total = warmup + steps + split_steps
    kv.device_blocks.reset_peak()
    fill(engine, batch, context, total, noise, gen)
    slots = torch.arange(batch)
    done = 0

    def step(clock: Callable[[str], None] | None = None) -> float:
        nonlocal done
        done += 1
        infos = [SeqInfo(s, f"r{s}", context, context + done, done, total) for s in range(batch)]
        policy.begin_decode_step(kv, infos)
        kv.take_paused()            # CPU tier copies are synchronous: nothing is ever in flight here
        kv.allocate_decode(slots, kv.decode_blocks_needed(slots))
        ids = torch.randint(3, spec.vocab_size, (batch,), generator=gen)
        positions = torch.full((batch,), context + done - 1, dtype=torch.long)
        start = time.perf_counter()
        runner.decode_tokens(ids, positions, slots, infos, clock)
        kv.sync_copies()
        return time.perf_counter() - start

    for _ in range(warmup):
        step()
    meta0, h2d0 = kv.minmax_bytes_read, kv.bytes_host_to_device
    with CpuMeter() as meter:
        times = [step() for _ in range(steps)]
    meta, h2d = kv.minmax_bytes_read - meta0, kv.bytes_host_to_device - h2d0
    phases = {"select": 0.0, "attention": 0.0}
    kv_read, counting, layer, mark = 0, 0.0, 0, 0.0

    def clock(phase: str) -> None:
        nonlocal kv_read, counting, layer, mark
        now = time.perf_counter()
        if phase in phases:
            phases[phase] += now - mark
        if phase == "select":
            kv_read += kv_bytes_read(engine, slots, layer, runner.fused.last_selected if runner.fused
                                     else runner.last_selected)
            layer = (layer + 1) % spec.num_layers
            # counting the bytes is the benchmark's own work: neither the next phase's time nor the step's
            later = time.perf_counter()
            counting += later - now
            now = later
        mark = now

    split_total = 0.0
    for _ in range(split_steps):
        mark = time.perf_counter()
        split_total += step(clock)
    split_total -= counting
    for slot in range(batch):
        kv.free_seq(slot)
        policy.reset(slot)
    step_s = sorted(times)[len(times) // 2]
    weights = weight_bytes(engine) + batch * spec.hidden_size * kv.k_pool.element_size()
    usage = meter.usage
    return {
        "batch": batch, "context": context, "step_ms": 1e3 * step_s, "best_step_ms": 1e3 * min(times),
        "weight_bytes": weights, "kv_bytes": kv_read / split_steps, "metadata_bytes": meta / steps,
        "h2d_bytes": h2d / steps, "select_ms": 1e3 * phases["select"] / split_steps,
        "attention_ms": 1e3 * phases["attention"] / split_steps, "split_step_ms": 1e3 * split_total / split_steps,
        "device_kv_bytes": kv.device_blocks.peak_bytes, "fused": runner.fused is not None,
        "cores_busy": usage.cores_busy if usage else None, "busy_threads": usage.busy_threads if usage else None,
        "cpus_allowed": usage.cpus_allowed if usage else None}
