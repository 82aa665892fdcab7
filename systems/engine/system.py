"""EngineSystem: the paged engine with one KV policy behind the System protocol (requests carry token ids)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from systems.base import Completion, GenerationRequest, MemoryReport, cut_at_stop
from systems.engine.engine import Engine, StepTally
from systems.engine.ops import cpu_kernels
from systems.policies import load_policy
from systems.policies.base import Policy


class EngineSystem:
    supports_forced_decoding = True     # GenerationRequest.forced_output_ids / logprob_steps are honoured
    # GenerationRequest.context_len (query-agnostic compression), shared_context and keep_prefill are honoured
    supports_shared_context = True

    def __init__(self, model_dir: str, policy_name: str, policy_params: dict | None, engine: Any,
                 dtype: str = "auto", name: str = "engine-dense", device: str | None = None,
                 max_model_len: int | None = None, policy: Policy | None = None, model_name: str | None = None):
        """`policy`: the policy already parsed from `policy_name` / `policy_params` (the harness parses a config
        once and hands the object down); None parses them here. Bad params fail before the model loads. `model_name`:
        the model's name its policy's profiles are keyed by (None: unknown, a profile is then taken as given)."""
        policy = policy if policy is not None else load_policy(policy_name, policy_params)
        from transformers import AutoTokenizer

        self.name = name
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.engine = Engine(model_dir, policy, engine, dtype=dtype, device=device, max_model_len=max_model_len,
                             model_name=model_name)
        eos = set(self.engine.model.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.engine.is_eos = lambda t: t in eos
        self.engine.decode_text = self._decode
        self.mode = policy.mode
        self.policy = policy
        self._at_budget: dict[int, Policy] = {}
        runner = self.engine.runner
        self.execution = "; ".join([
            "decode steps as fused C++ layers" if runner.fused is not None
            else f"decode steps op by op ({runner.fused_unsupported})",
            "mixed and prefill steps as fused C++ layers" if runner.mixed is not None
            else f"mixed and prefill steps op by op ({runner.mixed_unsupported})"]
            + ([f"bf16 prompt attention on {cpu_kernels.prompt_kernel_name()}"]
               if runner.device.type == "cpu" and getattr(runner.model, "dtype", None) == torch.bfloat16 else []))

    def _run(self, requests: list[GenerationRequest]) -> list[Any]:
        """Engine sequences of `requests` in order: requests that carry their own KV budget run in groups of one
        budget, each under the configured policy at that budget (Policy.at_budget), the rest under the policy as
        configured. Grouping costs only batching across budgets: decoding is batch-invariant in accuracy runs."""
        groups: dict[int | None, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.kv_budget if self.policy.has_budget() else None, []).append(i)
        if list(groups) == [None]:
            return self.engine.generate(requests)
        out: list[Any] = [None] * len(requests)
        try:
            for budget, index in groups.items():
                if budget is not None and budget not in self._at_budget:
                    self._at_budget[budget] = self.policy.at_budget(budget)
                self.engine.set_policy(self.policy if budget is None else self._at_budget[budget])
                for i, seq in zip(index, self.engine.generate([requests[i] for i in index])):
                    out[i] = seq
        finally:
            self.engine.set_policy(self.policy)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        seqs = self._run(list(requests))
        out = []
        for seq in seqs:
            req = seq.request
            text = self._decode(seq.output_ids)
            if req.stop:
                text, _ = cut_at_stop(text, req.stop)
            out.append(Completion(
                request_id=req.request_id, text=text, token_ids=seq.output_ids, prompt_tokens=seq.num_prompt_tokens,
                output_tokens=seq.num_output_tokens, arrival_time=seq.arrival_time, token_times=seq.token_times,
                finish_reason=seq.finish_reason, kv_stats=seq.kv_stats, token_logprobs=seq.token_logprobs,
                positions=self.engine.runner.probe.take(seq) if self.engine.runner.probe is not None else None,
                argmax_ids=seq.argmax_ids,
                logprobs=torch.stack(seq.logprob_rows) if seq.logprob_rows else None))
        return out

    def release_prefix(self, key: str) -> bool:
        """Let a prefix kept by keep_prefill go (now, or when its last reader finishes); False: no such key."""
        return self.engine.release_prefix(key)

    def memory_report(self) -> MemoryReport:
        kv = self.engine.kv
        return MemoryReport(
            mode=self.mode, execution=self.execution,
            device_kv_capacity_bytes=kv.device_blocks.capacity * kv.bytes_per_block,
            device_kv_peak_bytes=kv.device_blocks.peak_bytes,
            host_kv_peak_bytes=kv.host_blocks.peak_bytes,
            bytes_host_to_device=kv.bytes_host_to_device,
            bytes_device_to_host=kv.bytes_device_to_host,
            extra={"minmax_peak_bytes": self.engine.minmax_peak_bytes,
                   "minmax_allocated_bytes": kv.kmin.numel() * kv.kmin.element_size() * 2,
                   "device_kv_used_bytes": kv.device_blocks.used_bytes,
                   "host_kv_capacity_bytes": kv.host_blocks.capacity * kv.bytes_per_block,
                   "page_size": kv.page_size, "bytes_per_block": kv.bytes_per_block,
                   "preemptions": self.engine.scheduler.num_preemptions,
                   "prefixes_kept": self.engine.scheduler.prefixes.kept,
                   "prefill_steps": self.engine.steps["prefill"], "decode_steps": self.engine.steps["decode"],
                   "dtype": str(self.engine.dtype).replace("torch.", "")})

    def reset_stats(self) -> None:
        kv = self.engine.kv
        kv.device_blocks.reset_peak()
        kv.host_blocks.reset_peak()
        kv.bytes_host_to_device = kv.bytes_device_to_host = 0
        self.engine.minmax_peak_bytes = 0
        self.engine.scheduler.num_preemptions = 0
        self.engine.scheduler.prefixes.kept = 0
        self.engine.tally = StepTally()

    def close(self) -> None:
        """Free the model and the KV pools; the system cannot generate afterwards."""
        self.__dict__.pop("engine", None)
