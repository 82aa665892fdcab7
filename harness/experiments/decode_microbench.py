"""Per-layer decode attention latency (selection + attention) vs batch size at a fixed context (FlexiCache F7, F8).

For each system of exp.params.systems (conf/system names: dense, quest, flexicache, flexicache_naive, ...; else
those of exp.systems) and each batch size, `layers` layers of
the engine's paged KV storage (systems.engine.kv_cache) is filled with `context` random tokens per sequence and the
system's policy prepares it as after a real prefill (FlexiCache offloads stable heads and frees their non-top-K
blocks). Then `steps` decode steps run exactly what the engine's attention callback runs for one layer: append the
new token, the policy's select_pages, the engine ops' sparse (or dense) paged decode attention (Triton on CUDA,
the fused C++ kernels on CPU), the policy's after_append (FlexiCache's promotions). Only select + attention + after_append are
timed (the append is the same for every system); the split is reported.

Synthetic inputs, on purpose: keys and values are N(0, 1); each sequence's decode queries are a fixed direction plus
small noise (`query_noise`), so consecutive top-K sets overlap as they do for stable heads. FlexiCache's unstable
heads are the first round(unstable_fraction · Hkv) heads of the layer, LServe's streaming heads the first
round(streaming_fraction · Hkv) (a profile says which heads they are in a real model; for latency only their number
matters, so no profile is needed). The timed steps start after `warmup` steps and span whole
rerank intervals. Every run re-measures every point, so the ratios in summary.md come from one run.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness import plots, report
from harness.assets import model_dir as resolve_model_dir
from harness.envinfo import env_record
from harness.runner import Cell, UserError, load_group
from harness.schema import SystemConfig
from harness.store import Cell as StoreCell
from systems.hardware import resolve_dtype
from systems.engine.kv_cache import TieredKVCache
from systems.engine.ops import load_ops
from systems.policies import load_policy
from systems.policies.base import DecodeStep, SeqInfo
from systems.registry import SystemConfigError, check_system

DEFAULTS = {"context": 8192, "batch_sizes": [1, 4, 16], "steps": 32, "warmup": 4, "layer": 2, "layers": 8,
            "unstable_fraction": 0.25, "streaming_fraction": 0.5, "query_noise": 0.1, "systems": [],
            "device": "auto", "seed": 0, "reference": None,
            "num_q_heads": None, "num_kv_heads": None, "head_dim": None}
GIB = 1 << 30


def model_dims(cfg: DictConfig, p: dict) -> dict[str, int]:
    """(Hq, Hkv, D) from the params when all are given, else from the model folder's config.json."""
    if all(p[k] for k in ("num_q_heads", "num_kv_heads", "head_dim")):
        return {k: int(p[k]) for k in ("num_q_heads", "num_kv_heads", "head_dim")}
    conf = json.loads((Path(resolve_model_dir(cfg.model.path)) / "config.json").read_text())
    hq = conf["num_attention_heads"]
    return {"num_q_heads": hq, "num_kv_heads": conf.get("num_key_value_heads", hq),
            "head_dim": conf.get("head_dim") or conf["hidden_size"] // hq}


def bench_systems(cfg: DictConfig, cells: list[Cell], p: dict, num_kv_heads: int) -> list[DictConfig]:
    """The systems to time: exp.params.systems (conf/system names) or those of exp.systems, with the shared budget
    and system_overrides applied, and the head roles a profile would give (FlexiCache's unstable heads, LServe's
    streaming heads) set to the first heads of the benchmarked layer, so no profile of the model is needed."""
    if p.get("systems"):
        loaded = [load_group("system", name, SystemConfig) for name in p["systems"]]
        extra = cfg.exp.params.get("system_overrides")
        for s in loaded:
            if extra:
                s.merge_with(extra)
    else:
        loaded = [c.system for c in cells]
    out, seen, layer, n_layers = [], set(), int(p["layer"]), int(p["layers"])
    for s in loaded:
        if s.name in seen:
            continue
        seen.add(s.name)
        s = copy.deepcopy(s)
        fields = {f.name for f in dataclasses.fields(importlib.import_module(f"systems.policies.{s.policy}").POLICY)}
        if p.get("budget") is not None and "budget" in fields:
            s.params["budget"] = int(p["budget"])
        for key, share in (("unstable_heads", p["unstable_fraction"]), ("streaming_heads", p["streaming_fraction"])):
            if key in fields:
                s.params[key] = [[lay, h] for lay in range(layer, layer + n_layers)
                                 for h in range(round(float(share) * num_kv_heads))]
        check_system(s)
        out.append(s)
    bad = [s.name for s in out if s.backend != "engine"]
    if bad:
        raise UserError(f"decode_microbench times the engine's ops and policies; remove {bad} from the systems")
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_point(system_cfg: DictConfig, dims: dict, batch: int, p: dict, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    """Time `steps` decode steps of `layers` layers for `batch` sequences of `context` tokens under the system's
    policy; the times returned are per layer and step."""
    first, n, steps, page = int(p["layer"]), int(p["context"]), int(p["steps"]), int(system_cfg.engine.page_size)
    layers = list(range(first, first + int(p["layers"])))
    hq, hkv, d = dims["num_q_heads"], dims["num_kv_heads"], dims["head_dim"]
    params = OmegaConf.to_container(system_cfg.params, resolve=True)
    policy = load_policy(system_cfg.policy, params)
    total = n + int(p["warmup"]) + steps + 1
    elem = torch.empty((), dtype=dtype).element_size()
    need_gb = len(layers) * batch * hkv * (-(-total // page) + 1) * 2 * page * d * elem / GIB
    kv = TieredKVCache(num_layers=layers[-1] + 1, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                       max_seqs=batch, max_model_len=total, device_memory_gb=need_gb * 1.05 + 0.01,
                       host_memory_gb=need_gb * 1.05 + 0.01, dtype=dtype, device=device, ops=load_ops(device))
    ops = kv.ops
    policy.bind(kv)
    gen = torch.Generator(device=device).manual_seed(int(p["seed"]))
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)  # noqa
    direction = rand(batch, hq, d)
    for slot in range(batch):
        policy.reset(slot)
        for layer in layers:
            k, v = rand(n, hkv, d), rand(n, hkv, d)
            q = direction[slot].expand(n, hq, d) + float(p["query_noise"]) * rand(n, hq, d)
            kv.store_prefill(slot, layer, k, v)
            policy.after_prefill_layer(kv, SeqInfo(slot, f"r{slot}", n, n, 0, steps), layer, q, k)
    kv.sync_copies()
    slots = torch.arange(batch, device=device)
    timings = {"select_s": 0.0, "attention_s": 0.0, "after_append_s": 0.0}
    pages_read = 0
    for t in range(1, int(p["warmup"]) + steps + 1):
        need = kv.decode_blocks_needed(slots)
        need[:, :first] = False                                   # only the benchmarked layers hold KV
        kv.allocate_decode(slots, need)
        seqs = [SeqInfo(s, f"r{s}", n, n + t, t, steps) for s in range(batch)]
        for layer in layers:
            kv.append_decode(slots, layer, rand(batch, hkv, d), rand(batch, hkv, d))
            q = direction + float(p["query_noise"]) * rand(batch, hq, d)
            step = DecodeStep(layer=layer, slots=slots, seqs=seqs, q=q)
            _sync(device)
            t0 = time.perf_counter()
            selected = policy.select_pages(kv, step)
            _sync(device)
            t1 = time.perf_counter()
            if selected is None:                                  # exactly the engine's attention call
                table, counts = kv.decode_tables(slots, layer)
                ops.paged_decode_attention(q, kv.k_pool, kv.v_pool, table, counts, kv.scale)
            else:
                ops.sparse_decode_attention(q, kv.k_pool, kv.v_pool, kv.block_table[slots, layer],
                                            kv.num_tokens[slots, layer], selected, kv.scale)
            _sync(device)
            t2 = time.perf_counter()
            policy.after_append(kv, step)
            kv.sync_copies()
            _sync(device)
            t3 = time.perf_counter()
            if t > int(p["warmup"]):
                timings["select_s"] += t1 - t0
                timings["attention_s"] += t2 - t1
                timings["after_append_s"] += t3 - t2
                pages_read += (int(-(-kv.num_tokens[slots, layer].long() // kv.page_size).sum()) if selected is None
                               else int((selected >= 0).sum()))
    steps *= len(layers)                                          # per layer and step from here on
    per_step = {k.replace("_s", "_ms"): 1000 * v / steps for k, v in timings.items()}
    return {"system": system_cfg.name, "policy": system_cfg.policy, "batch": batch, "context": n,
            "budget": params.get("budget"), "total_ms": sum(per_step.values()), **per_step,
            "pages_read_per_head_step": pages_read / (steps * batch * hkv), "pages_per_head": -(-n // page),
            "h2d_bytes_per_step": kv.bytes_host_to_device / ((int(p["warmup"]) + int(p["steps"])) * len(layers)),
            "layers": len(layers),
            "device_kv_bytes": kv.device_blocks.used_bytes, **dims, "dtype": str(dtype).replace("torch.", ""),
            "device": str(device)}


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    p = {**DEFAULTS, **OmegaConf.to_container(cfg.exp.params, resolve=True)}
    if p["steps"] < 1 or p["context"] < 16 or not p["batch_sizes"] or min(p["batch_sizes"]) < 1:
        raise UserError("exp.params needs steps >= 1, context >= 16 and positive batch_sizes")
    dims = model_dims(cfg, p)
    try:
        systems = bench_systems(cfg, cells, p, dims["num_kv_heads"])
    except SystemConfigError as exc:
        raise UserError(str(exc)) from None
    device = torch.device(p["device"] if p["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(cfg.model.dtype, device)
    results = []
    for system in systems:
        for batch in p["batch_sizes"]:
            with torch.inference_mode():
                r = bench_point(system, dims, int(batch), p, device, dtype)
            print(f"[run] {r['system']} batch {batch}: {r['total_ms']:.2f} ms/step (select {r['select_ms']:.2f}, "
                  f"attention {r['attention_ms']:.2f}, after_append {r['after_append_ms']:.2f})", flush=True)
            results.append(r)
    store = StoreCell(out_dir / "points")
    store.open(OmegaConf.to_yaml(OmegaConf.create({"model": cfg.model, "exp": cfg.exp, "systems": systems,
                                                   "seed": cfg.seed}), resolve=True), env_record(cfg.seed))
    store.write_metrics({"points": results})
    paths = write_summary(cfg, results, p, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return results


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else math.nan


def write_summary(cfg, results: list[dict], p: dict, out_dir: Path) -> dict[str, str]:
    systems = list(dict.fromkeys(r["system"] for r in results))
    at = {(r["system"], r["batch"]): r for r in results}
    batches = sorted({r["batch"] for r in results})
    ref = p["reference"] or next((s for s in systems if at[(s, batches[0])]["policy"] == "dense"), systems[0])
    naive = next((s for s in systems if "naive" in s), None)
    aware = next((s for s in systems if at[(s, batches[0])]["policy"] == "flexicache" and s != naive), None)
    big = batches[-1]
    glance = f"**At a glance:** per-layer decode attention at {p['context']} tokens, batch {big}: " + ", ".join(
        f"{ref} ÷ {s} = {_ratio(at[(ref, big)]['total_ms'], at[(s, big)]['total_ms']):.2f}×"
        for s in systems if s != ref)
    if naive and aware:
        glance += f"; stability-aware is {_ratio(at[(naive, big)]['total_ms'], at[(aware, big)]['total_ms']):.2f}× " \
                  f"faster than naive"
    glance += " (one run, ratios > 1 = faster than the reference)."
    header = ["system", "batch", "select ms", "attention ms", "after_append ms", "total ms", f"{ref} ÷ system",
              "pages read / head", "H2D KiB / step"]
    rows = [[r["system"], r["batch"], r["select_ms"], r["attention_ms"], r["after_append_ms"], r["total_ms"],
             _ratio(at[(ref, r["batch"])]["total_ms"], r["total_ms"]), r["pages_read_per_head_step"],
             r["h2d_bytes_per_step"] / 1024] for r in results]
    r0 = results[0]
    parts = [f"# {cfg.exp.name}", "", glance, "", report.md_table(header, rows, 2), "",
             f"{r0['layers']} distinct layers timed per step (a real step's dense KV outgrows the CPU's last-level "
             "cache; one layer alone would sit in it), "
             f"{r0['num_q_heads']} query / {r0['num_kv_heads']} KV heads, head_dim {r0['head_dim']}, "
             f"{r0['dtype']} on {r0['device']}, {p['context']} tokens per sequence ({r0['pages_per_head']} pages per "
             f"head), {p['steps']} timed decode steps after {p['warmup']}; times are per layer and decode step. "
             "select = the policy's page selection; attention = paged decode attention over the selected "
             "pages, read in place (all pages for dense); after_append = the policy's post-attention work (FlexiCache's host → device promotions).",
             "", f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv(
        [{**r, "speedup_vs_reference": _ratio(at[(ref, r["batch"])]["total_ms"], r["total_ms"]), "reference": ref}
         for r in results]))
    paths = {"md": str(md), "csv": str(csv_path)}
    paths["png_latency"] = plots.line_plot(
        out_dir / "latency_vs_batch.png", {s: [(b, at[(s, b)]["total_ms"]) for b in batches] for s in systems},
        xlabel="batch size (sequences)", ylabel="decode attention per layer and step (ms)", logx=True,
        title=f"Decode attention latency at {p['context']} tokens (selection + attention)")
    paths["png_speedup"] = plots.line_plot(
        out_dir / "speedup_vs_batch.png",
        {f"{ref} ÷ {s}": [(b, _ratio(at[(ref, b)]["total_ms"], at[(s, b)]["total_ms"])) for b in batches]
         for s in systems if s != ref}, xlabel="batch size (sequences)", ylabel=f"speedup over {ref} (×)",
        logx=True, title="Decode attention speedup over dense")
    return paths
