"""DuoAttention-style gates for LServe's head split: one learned gate per KV head, written as an LServe profile.

The method (mit-han-lab/duo-attention, duo_attn/train.py): the frozen model runs every attention head as a mix of
full and streaming (sink + recent) attention, `(1 − α) · streaming + α · full` per query head before o_proj, with
α a trainable gate per KV head shared by its query group, clamped to [0, 1] and initialised at 1. The full-attention
term is the teacher's: a full-attention forward of the same input. Only the gates learn, to keep the student's
final hidden states (after the last RMSNorm) close to the teacher's at the answer positions of synthetic
multi-passkey retrieval samples (mean over positions of the mean squared error over hidden dims), plus 0.05 × the
mean gate (an L1 push toward streaming). AdamW, lr 0.02, no weight decay; LambdaLR with a linear warm-up over the
first N/5 steps and a linear decay over the last N/5, floored at 0.1; gates clamped before every step.
Samples (duo_attn/data.py): passkeys of NATO-alphabet words, "Remeber this sequence of words, it's the {ordinal}
passkey to the vault: " at sorted random depths in 5–95 % of a haystack, the book prompt, and the QA block (every
question with its passkey) as the loss span; haystack lengths on a linspace.
Scaled to 2 CPU cores (each a recorded parameter): haystacks from the installed essays instead of BookSum, shorter
contexts and passkeys, fewer steps, a fixed pool of samples whose teacher states (per-layer full-attention outputs
and final hidden states) are computed once, and fp32 gates and model. The streaming window is the one LServe's
streaming heads use (sink 128 + local 256). The gates become LServe's `head_scores`; LServe streams the heads below
its sparsity quantile, as DuoAttention and LServe split them.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass

import torch

from harness.experiments.duo_attention.gates import NATO as NATO  # re-exports: tests read them from this module
from harness.experiments.duo_attention.gates import build_pool, train_gates
from harness.experiments.duo_attention.gates import lr_factor as lr_factor
from harness.experiments.duo_attention.gates import sample_ids as sample_ids
from harness.experiments.duo_attention.gates import streaming_mask as streaming_mask
from harness.integrations.assets import model_dir as resolve_model_dir
from harness.reporting import plots
from harness.running.cells import cell_config
from harness.running.config import UserError
from harness.running.experiment import Cell, Experiment, Run
from harness.running.params import GridParams
from harness.running.store import CellStore
from systems.policies import policy_class
from systems.policy_support import profiles
from tasks import ruler_data

log = logging.getLogger("kvharness")
POLICY = "lserve"       # the policy whose streaming heads the gates choose (its profile_schema checks the file)


@dataclass
class Params(GridParams):
    steps: int = 150
    lr: float = 0.02
    reg_weight: float = 0.05
    sink_tokens: int = 128
    recent_tokens: int = 256
    context_min: int = 1000
    context_max: int = 1792
    lengths: int = 8
    pool: int = 16
    passkeys: int = 5
    passkey_words: int = 16
    sparsity: float = 0.5
    seed: int = 42
    ship: bool = False
    profile_task: str = "duo_attention"


TRAINING = ("steps", "lr", "reg_weight", "sink_tokens", "recent_tokens", "context_min", "context_max", "lengths",
            "pool", "passkeys", "passkey_words", "seed")
DEFAULTS = {k: getattr(Params(), k) for k in TRAINING}


def cell_key(run: Run[Params]) -> str:
    return f"duo_gates__{run.cfg.model.name}__steps{run.params.steps}"


class DuoAttention(Experiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        p = run.params
        if p.context_min <= p.sink_tokens + p.recent_tokens:
            raise UserError("exp.params.context_min must exceed sink_tokens + recent_tokens: the streaming branch "
                            "would still see the needles")

    def cells(self, run: Run[Params]) -> list[Cell]:
        p = dataclasses.asdict(run.params)
        return [Cell(key=cell_key(run), config=cell_config(run.cfg, gates={k: p[k] for k in TRAINING}),
                     label=f"gate training ({p['steps']} steps)", units=p["steps"])]

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        from systems.engine.models.llama import LlamaModel

        p = dataclasses.asdict(run.params)
        tokenizer = run.workspace.tokenizer
        model = LlamaModel(run.workspace.model_dir, torch.float32, torch.device("cpu"), autograd=True)   # gates learn
        rng = random.Random(p["seed"])
        haystack = tokenizer.encode(" ".join(ruler_data.essay_words()), add_special_tokens=False)
        lengths = [int(p["context_min"] + i * (p["context_max"] - p["context_min"]) / max(1, p["lengths"] - 1))
                   for i in range(p["lengths"])]
        started = time.perf_counter()
        pool = build_pool(model, tokenizer, haystack, lengths, p, rng)
        teacher_s = time.perf_counter() - started
        trained = time.perf_counter()

        def on_step(entry: dict) -> None:
            run.advance(1)
            done = entry["step"] + 1
            if done % 10 == 0 or done == p["steps"]:
                spent = time.perf_counter() - trained
                log.info("gate training: step %d/%d, distillation loss %.4f, mean gate %.3f, %.0f s so far, about "
                         "%.0f s left", done, p["steps"], entry["distill"], entry["mean_gate"], spent,
                         spent / done * (p["steps"] - done))

        gates, history = train_gates(model, pool, p, rng, on_step)
        return {"gates": gates.tolist(), "history": history, "teacher_seconds": teacher_s,
                "train_seconds": time.perf_counter() - started - teacher_s, "lengths": lengths,
                "sample_tokens": [len(x) for x, *_ in pool]}

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        """The summary and the profile file beside it (with ship=true also the shipped LServe profile), from the
        trained gates on disk."""
        from systems.engine.models.llama import ModelSpec

        p = dataclasses.asdict(run.params)
        metrics = run.stored(cell_key(run))
        if metrics is None:
            raise UserError(f"no trained gates under {run.out_dir}: run +exp=duo_attention first")
        spec = ModelSpec.from_dir(resolve_model_dir(run.cfg.model.path, run.cfg.model.name))
        profile = {"kind": POLICY, "model": run.cfg.model.name, "task": p["profile_task"],
                   "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_scores": metrics["gates"],
                   "proxy": "DuoAttention gates: per KV head, the learned weight of full over streaming attention "
                            f"(sink {p['sink_tokens']} + recent {p['recent_tokens']}); high = retrieval head",
                   "training": {k: p[k] for k in TRAINING},
                   "train_seconds": metrics["train_seconds"], "teacher_seconds": metrics["teacher_seconds"]}
        schema = policy_class(POLICY).profile_schema       # type: ignore[union-attr]
        profiles.save_profile(run.out_dir / "profile_lserve.json", profile, schema)
        if p["ship"]:
            profiles.save_profile(profiles.profile_path(POLICY, run.cfg.model.name, p["profile_task"]), profile,
                                  schema)
        managed = [layer for layer, window in enumerate(spec.layer_windows) if window is None] \
            or list(range(spec.num_layers))
        return write_summary(run, metrics, p, managed)


def write_summary(run: Run[Params], metrics: dict, p: dict, managed: list[int]) -> dict[str, str]:
    """`managed`: the layers LServe acts on (a hybrid model's full-attention layers; its sliding-window layers are
    left to their window), over which its sparsity quantile splits the heads, as the policy does."""
    from systems.policies.lserve import streaming_split

    out_dir = run.out_dir
    gates = torch.tensor(metrics["gates"])
    streaming = streaming_split(gates, p["sparsity"], managed)
    per_layer = [sum(1 for layer, _ in streaming if layer == i) if i in managed else "(window)"
                 for i in range(gates.shape[0])]
    over = "" if len(managed) == gates.shape[0] else f" of the {len(managed) * gates.shape[1]} on its full-attention " \
        f"layers {', '.join(map(str, managed))}"
    hist = metrics["history"]
    summary = run.summary(envs=[metrics["_env"]] if metrics.get("_env") else None)
    summary.glance(f"{gates.numel()} gates trained for {p['steps']} steps in {metrics['train_seconds'] / 60:.0f} min "
                   f"(+ {metrics['teacher_seconds'] / 60:.1f} min of teacher states); mean gate "
                   f"{float(gates.mean()):.2f}, {int((gates < 0.01).sum())} below 0.01 and "
                   f"{int((gates > 0.99).sum())} above 0.99; at sparsity {p['sparsity']} LServe streams "
                   f"{len(streaming)} heads{over}; distillation loss {hist[0]['distill']:.4f} → "
                   f"{hist[-1]['distill']:.4f}.")
    summary.section("Training settings (DuoAttention's, scaled to 2 CPU cores)").table(
        ["setting", "value"], [[k, str(p[k])] for k in (*TRAINING, "sparsity")]
        + [["haystack lengths (tokens)", ", ".join(map(str, metrics["lengths"]))],
           ["sample tokens (pool)", f"{min(metrics['sample_tokens'])}–{max(metrics['sample_tokens'])}"]])
    summary.section("Gates per layer (KV heads) and LServe's streaming heads").table(
        ["layer", *[f"head {h}" for h in range(gates.shape[1])], "streaming heads"],
        [[i, *[f"{float(g):.3f}" for g in row], per_layer[i]] for i, row in enumerate(gates)])
    n = f"n = {p['pool']} training samples × {p['steps']} steps"
    summary.image("png_gates", plots.heatmap(
        out_dir / "gates.png", gates.T.tolist(), [f"KV head {h}" for h in range(gates.shape[1])],
        list(range(gates.shape[0])), xlabel="layer", ylabel="KV head", title="DuoAttention gates (1 = full)",
        colorbar="gate α", vmin=0.0, vmax=1.0, digits=2, cmap="viridis",
        note=summary.figure_note(n)), "gates")
    summary.image("png_loss", plots.line_plot(
        out_dir / "training.png", {"distillation loss": [(h["step"], h["distill"]) for h in hist],
                                   "mean gate": [(h["step"], h["mean_gate"]) for h in hist]},
        "step", "value", "Gate training", logy=True, note=summary.figure_note(n)), "training")
    summary.csv([{"layer": i, "head": h, "gate": float(gates[i, h]), "streaming": (i, h) in streaming}
                 for i in range(gates.shape[0]) for h in range(gates.shape[1])], "gates")
    summary.took(metrics["train_seconds"] + metrics["teacher_seconds"], "teacher states + training")
    return summary.write(out_dir)


EXPERIMENT = DuoAttention()
