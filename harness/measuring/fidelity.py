"""Teacher-forced fidelity: how closely a KV policy follows the reference system's next-token distributions.

Task scores are coarse (a needle is found or not), so policies separate only with hundreds of samples. Fidelity is
continuous: the reference's greedy output is fed through the policy token by token (teacher forcing; the policy
acts exactly as while generating: it evicts, reranks, offloads and promotes), and at each of the first `steps`
output positions the policy's next-token distribution q is compared with the reference's p:

- top-1 agreement = the share of positions where argmax q is the reference's token;
- KL = KL(p ‖ q) = Σ_v p_v (log p_v − log q_v) over the full vocabulary, in nats, averaged over positions;
- Δ gold log-likelihood (tasks with one gold answer) = log q(gold answer | prompt) − log p(gold answer | prompt),
  both by teacher forcing the tokenized answer after the prompt, in nats per answer.

Per sample these are stored in predictions.jsonl (`fid_top1`, `fid_kl`, `fid_steps`, `gold_loglik`); summaries
average them over samples with bootstrap intervals. The reference's full log-probabilities (`steps` × vocab per
sample) are written by the reference cell into `<reference cell>/reference_logprobs/`, where every policy cell
of the same task reads them; a policy whose greedy output equals the reference's over those positions already has
its distributions from generation, so only diverging samples pay for a forced pass.

They are stored exactly as the system returned them (fp32: 32 steps × 49,152 entries = 6.3 MB per sample for
SmolLM2), not rounded to fp16: rounding put a floor of about 8e-5 nats under every KL, so a policy identical to the
reference could not be told from a slightly different one. Stored exactly, the reference against itself gives
KL = 0.0 and top-1 agreement 1.0, bit for bit. Files written in fp16 by earlier versions still load.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from systems.base import Completion, GenerationRequest, System

FOLDER = "reference_logprobs"


@dataclass
class FidelityPlan:
    """What one accuracy cell does for fidelity: write the reference's log-probabilities, or compare with them."""

    role: str                       # "reference" | "policy"
    steps: int                      # reference output positions compared
    gold: bool                      # also the gold answer's log-likelihood
    reference_dir: Path             # the reference cell's folder (this cell's own when role == "reference")
    reference_rows: dict[str, dict] | None = None   # id -> the reference's prediction row (policy role)

    def store(self) -> Path:
        return self.reference_dir / FOLDER


def _path(folder: Path, sample_id: str) -> Path:
    digest = hashlib.sha1(sample_id.encode()).hexdigest()[:16]     # ids may hold any character
    return folder / f"{digest}.pt"


def save_reference(folder: Path, sample_id: str, token_ids: Sequence[int], logprobs: torch.Tensor) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = _path(folder, sample_id)
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # two runs may write the same reference
    # exact, never rounded (see the module docstring); contiguous, so a slice does not drag its whole storage along
    torch.save({"id": sample_id, "ids": list(token_ids), "logprobs": logprobs.detach().cpu().contiguous().clone()},
               tmp)
    tmp.replace(path)


class ReferenceFileError(ValueError):
    """A stored reference log-prob file that cannot be read; the message names the file."""


def reference_file_problem(path: Path) -> str | None:
    """Why a stored reference file cannot be used, or None. Memory-mapped, so only its structure is read (a file
    cut short has lost its zip directory and fails here), not its 6 MB of numbers."""
    try:
        try:
            data = torch.load(path, weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            data = torch.load(path, weights_only=True)   # an old-format file cannot be mapped: read it whole
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a damaged archive
        return f"unreadable ({_first_line(exc)})"
    if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not isinstance(data.get("ids"), list):
        return "not a reference record (id, ids, logprobs)"
    lp = data.get("logprobs")
    if not isinstance(lp, torch.Tensor) or lp.dim() != 2:
        return "its logprobs are not a steps x vocabulary tensor"
    return None


def reference_problems(folder: Path) -> list[str]:
    """`reference_logprobs/<file>: <why>` for each damaged file in a reference cell's folder of log-probs."""
    return [f"{FOLDER}/{path.name}: {why}" for path in sorted(Path(folder).glob("*.pt"))
            if (why := reference_file_problem(path))]


def load_reference(folder: Path, sample_id: str) -> dict | None:
    path = _path(folder, sample_id)
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - checked before the run: damaged since, from outside the harness
        raise ReferenceFileError(f"{path}: unreadable ({_first_line(exc)}); rerun the experiment to recompute its "
                                 f"reference cell {folder.parent.name}") from None
    return data if isinstance(data, dict) and data.get("id") == sample_id else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return type(exc).__name__ + (f": {text[0].split('. ')[0][:120]}" if text else "")


def compare(ref_ids: Sequence[int], ref_logprobs: torch.Tensor, argmax_ids: Sequence[int],
            logprobs: torch.Tensor) -> dict[str, float]:
    """Fidelity of one sample from the policy's distributions along the reference tokens (first m positions)."""
    m = min(len(ref_ids), ref_logprobs.shape[0], logprobs.shape[0], len(argmax_ids))
    if m == 0:
        return {}
    p_log = ref_logprobs[:m].float()
    q_log = logprobs[:m].float()
    # equal entries add exactly 0 (also where both are -inf, which would otherwise be nan), and so do p = 0 entries
    diff = torch.where(p_log == q_log, torch.zeros_like(p_log), p_log - q_log)
    terms = torch.where(p_log == float("-inf"), torch.zeros_like(p_log), p_log.exp() * diff)
    kl = terms.sum(-1).clamp(min=0.0)        # rounding in the sum can leave a tiny negative for near-equal rows
    agree = [int(a) == int(r) for a, r in zip(argmax_ids[:m], ref_ids[:m])]
    return {"fid_top1": sum(agree) / m, "fid_kl": float(kl.mean()), "fid_steps": m}


def reference_rows_of(rows: Sequence[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in rows if r.get("output_ids")}


def forced_requests(items: Sequence[tuple[str, list[int], list[int]]], steps: int) -> list[GenerationRequest]:
    """(request id, prompt ids, forced ids) -> teacher-forced requests keeping the first `steps` distributions."""
    return [GenerationRequest(request_id=rid, prompt_token_ids=prompt, max_new_tokens=len(forced),
                              forced_output_ids=tuple(forced), logprob_steps=steps, ignore_eos=True)
            for rid, prompt, forced in items]


def gold_ids(tokenizer: Any, answers: Sequence[str], max_tokens: int = 256) -> list[int] | None:
    """The single gold answer as the tokens a model would write after the prompt (None: no single answer)."""
    if len(answers) != 1 or not str(answers[0]).strip():
        return None
    ids = tokenizer.encode(str(answers[0]), add_special_tokens=False)[:max_tokens]
    return ids or None


def run_batch(plan: FidelityPlan, system: System, tokenizer: Any, samples: Sequence, prompts: Sequence[list[int]],
              completions: Sequence[Completion], fields: Sequence[dict[str, Any]] | None = None) -> list[dict]:
    """Fidelity fields for one generated batch (one dict per sample, in order); forced passes where needed, each
    with the GenerationRequest fields its sample's generation had (`fields`, per sample: its KV budget, its
    context_len), so the policy acts on the prompt exactly as it did while generating."""
    out: list[dict] = [{} for _ in samples]

    def at_budget(reqs: list[GenerationRequest], index: Sequence[int]) -> list[GenerationRequest]:
        return [dataclasses.replace(r, **fields[i]) for r, i in zip(reqs, index)] if fields else reqs
    if plan.role == "reference":
        for i, (s, c) in enumerate(zip(samples, completions)):
            if c.logprobs is not None:
                save_reference(plan.store(), s.id, c.token_ids[:plan.steps], c.logprobs[:plan.steps])
                out[i] = {"fid_top1": 1.0, "fid_kl": 0.0, "fid_steps": min(plan.steps, len(c.token_ids))}
    else:
        diverged = []
        for i, (s, c) in enumerate(zip(samples, completions)):
            ref = load_reference(plan.store(), s.id)
            if ref is None:
                continue
            m = len(ref["ids"])
            if c.logprobs is not None and list(c.token_ids[:m]) == list(ref["ids"]) and c.logprobs.shape[0] >= m:
                out[i] = compare(ref["ids"], ref["logprobs"], c.argmax_ids, c.logprobs)
            else:
                diverged.append((i, ref))
        if diverged:
            reqs = at_budget(forced_requests([(f"{samples[i].id}#fidelity", prompts[i], ref["ids"])
                                              for i, ref in diverged], plan.steps), [i for i, _ in diverged])
            for (i, ref), c in zip(diverged, system.generate(reqs)):
                out[i] = compare(ref["ids"], ref["logprobs"], c.argmax_ids, c.logprobs)
                _count_reuse(out[i], c)
    if plan.gold:
        golds = [(i, g) for i, s in enumerate(samples) if (g := gold_ids(tokenizer, s.answers))]
        if golds:
            reqs = at_budget(forced_requests([(f"{samples[i].id}#gold", prompts[i], g) for i, g in golds], 0),
                             [i for i, _ in golds])
            for (i, g), c in zip(golds, system.generate(reqs)):
                out[i].update(gold_loglik=float(sum(c.token_logprobs)), gold_tokens=len(g))
                _count_reuse(out[i], c)
    return out


def _count_reuse(fields: dict, completion: Completion) -> None:
    """`fid_reused_prefills`: the sample's forced passes that read a kept prefill (fields' shared_context) instead
    of prefilling the prompt again."""
    if (completion.kv_stats or {}).get("forked_prefix"):
        fields["fid_reused_prefills"] = fields.get("fid_reused_prefills", 0) + 1


def supports_forcing(system: object) -> bool:
    return bool(getattr(system, "supports_forced_decoding", False))


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
