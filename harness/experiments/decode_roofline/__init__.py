"""Decode step time against the memory roofline, for dense and every policy (FlexiCache F7; LServe's decode claims).

A decode step of a small model reads every weight once and each sequence's KV as its policy chooses; on a CPU it
should therefore take about (bytes read) ÷ (the machine's streaming bandwidth). For each system, context and batch
size, the model's real decode steps run over synthetic caches (bench.py says how) and the summary states, per
point: the step time, the bytes it read (weights + KV the policy read + its selection metadata), the achieved GB/s
against the streaming bandwidth measured at the start of the same run, the bandwidth floor and the step's distance
to it, and the step split into selection, attention and the rest. Every point lives in one cell, so every ratio
comes from one run; a policy that needs a profile of the model runs with the split its class declares for a
profile-free run (only how many heads play each role matters for speed).
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from harness.experiments.decode_roofline.bench import measure
from harness.experiments.decode_roofline.params import Params
from harness.experiments.decode_roofline.report import reference_name, unsteady, write_summary
from harness.integrations.assets import model_dir as resolve_model_dir
from harness.measuring.bandwidth import GIB, stream_read_gbs
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.config import UserError, plain
from harness.running.experiment import Cell, Experiment, Run
from harness.running.grid import apply_budget, system_config
from harness.running.store import CellStore
from systems.engine.engine import Engine
from systems.engine.models.spec import ModelSpec
from systems.policies import load_policy, policy_class
from systems.registry import SystemConfigError, backend_of, check_system

log = logging.getLogger("kvharness")
KEY = "points"


def roofline_systems(run: Run[Params], spec: ModelSpec) -> list[DictConfig]:
    """The systems to time, with the shared budget and the parameters each policy names for a profile-free run."""
    p = run.params
    loaded = [system_config(name) for name in p.systems] or [c.system for c in run.grid]
    out = []
    for s in {s.name: copy.deepcopy(s) for s in loaded}.values():
        s.merge_with(p.system_overrides or {})
        if p.budget is not None:
            apply_budget(s, p.budget)
        cls = policy_class(s.policy)
        if cls is not None:
            s.params = {**plain(s.params), **cls.profile_free_params(spec.num_layers, spec.num_kv_heads)}
        check_system(s)
        out.append(s)
    bad = [s.name for s in out if not backend_of(s).runs_policies]
    if bad:
        raise UserError(f"decode_roofline runs the engine's decode step; remove {bad} (systems whose backend runs no "
                        "KV policy) from the systems")
    return out


def build_engine(run: Run[Params], system: DictConfig, model_dir: Path, spec: ModelSpec) -> Engine:
    """The system's engine with room for the largest point: every slot holding the longest context in both tiers."""
    p = run.params
    tokens = max(p.contexts) + p.warmup + p.steps + p.split_steps + 1
    page = int(system.engine.page_size)
    elem = torch.empty((), dtype=torch.float32 if run.cfg.model.dtype == "float32" else torch.bfloat16).element_size()
    blocks = max(p.batch_sizes) * spec.num_layers * spec.num_kv_heads * (-(-tokens // page) + 1)
    gb = blocks * 2 * page * spec.head_dim * elem / GIB * 1.05 + 0.05
    engine_cfg = {**plain(system.engine), "device_memory_gb": gb, "host_memory_gb": gb,
                  "max_num_seqs": max(p.batch_sizes)}
    policy = load_policy(system.policy, plain(system.params))
    return Engine(str(model_dir), policy, engine_cfg, dtype=run.cfg.model.dtype, max_model_len=tokens,
                  model_name=run.cfg.model.name)


class DecodeRoofline(Experiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        p = run.params
        if p.steps < 1 or p.split_steps < 1 or p.warmup < 0 or not p.batch_sizes or min(p.batch_sizes) < 1 \
                or not p.contexts or min(p.contexts) < 16:
            raise UserError("exp.params needs steps >= 1, split_steps >= 1, warmup >= 0, positive batch_sizes and "
                            "contexts >= 16")
        if p.bandwidth_gib <= 0:
            raise UserError("exp.params.bandwidth_gib must be positive (the streaming-read buffer, in GiB)")
        if not 0 <= p.host_drift < 1:
            raise UserError("exp.params.host_drift must be in [0, 1): the share a quiet host's timings may move by")

    def cells(self, run: Run[Params]) -> list[Cell]:
        p = run.params
        model_dir = Path(resolve_model_dir(run.cfg.model.path, run.cfg.model.name))
        spec = ModelSpec.from_dir(model_dir)
        try:
            systems = roofline_systems(run, spec)
        except SystemConfigError as exc:
            raise UserError(str(exc)) from None
        run.extra_systems = systems
        points = len(systems) * len(p.contexts) * len(p.batch_sizes)
        return [Cell(key=KEY, config=cell_config(run.cfg, systems=systems), label=f"decode roofline ({points} points)",
                     units=points, item=(systems, model_dir, spec))]

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        p, (systems, model_dir, spec) = run.params, cell.item
        # read before every system and at the end: a shared host's memory can get busy for minutes, and a run
        # whose reads moved says so (report.unsteady) instead of passing its slower steps off as the engine's
        samples: list[float] = []

        def sample(when: str) -> None:
            samples.append(stream_read_gbs(int(p.bandwidth_gib * GIB)))
            log.info("streaming read bandwidth %s: %.1f GB/s", when, samples[-1])

        points = []
        for system in systems:
            sample(f"before {system.name}")
            engine = build_engine(run, system, model_dir, spec)
            for context in p.contexts:
                for batch in p.batch_sizes:
                    r = measure(engine, batch, context, p.steps, p.split_steps, p.warmup, p.query_noise, p.seed)
                    r.update(system=system.name, policy=system.policy, budget=plain(system.params).get("budget"))
                    log.info("%s context %d batch %d: %.2f ms/step", system.name, context, batch, r["step_ms"])
                    points.append(r)
                    run.advance(1)
            del engine
        recheck = self._recheck(run, systems, points, model_dir, spec)
        sample("at the end")
        warning = unsteady(samples, p.host_drift, recheck)
        if warning:
            log.warning(warning)
        return {"points": points, "bandwidth_samples_gbs": samples, "recheck": recheck,
                "dtype": run.cfg.model.dtype, "model": spec.model_type, "num_layers": spec.num_layers}

    @staticmethod
    def _recheck(run: Run[Params], systems: list[DictConfig], points: list[dict], model_dir: Path,
                 spec: ModelSpec) -> dict | None:
        """The reference's first point timed again after every system: a host busy for part of the run (another
        tenant's compute as well as its memory traffic) shows as the two timings disagreeing."""
        p = run.params
        name = reference_name(p.reference, [s.name for s in systems])
        ref = next(s for s in systems if s.name == name)
        first = next((r for r in points if r["system"] == ref.name), None)
        if first is None:
            return None
        engine = build_engine(run, ref, model_dir, spec)
        again = measure(engine, first["batch"], first["context"], p.steps, p.split_steps, p.warmup, p.query_noise,
                        p.seed)
        log.info("%s context %d batch %d again: %.2f ms/step (first %.2f)", ref.name, first["context"],
                 first["batch"], again["step_ms"], first["step_ms"])
        return {"system": ref.name, "context": first["context"], "batch": first["batch"],
                "first_ms": first["step_ms"], "again_ms": again["step_ms"]}

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        stored = run.stored(KEY)
        if stored is None:
            raise UserError(f"no measured points under {run.out_dir}: run the experiment first")
        return write_summary(run, stored, cell_envs([stored]))


EXPERIMENT = DecodeRoofline()
