"""Dense HF transformers reference system: batched greedy (or sampled) generate with per-token timestamps."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from systems.base import Completion, GenerationRequest, MemoryReport, cut_at_stop
from systems.hardware import resolve_dtype


class _StepClock:
    """A stopping criterion that stamps each decoding step and ends rows at EOS or a stop string."""

    def __init__(self, tokenizer: Any, requests: Sequence[GenerationRequest], prompt_width: int, eos_ids: set[int]):
        self.tokenizer, self.requests, self.width, self.eos = tokenizer, requests, prompt_width, eos_ids
        self.times: list[list[float]] = [[] for _ in requests]
        self.done = [False] * len(requests)
        self.reason = ["length"] * len(requests)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        now = time.perf_counter()
        for i, req in enumerate(self.requests):
            if self.done[i]:
                continue
            self.times[i].append(now)
            new = input_ids[i, self.width:]
            if not req.ignore_eos and int(new[-1]) in self.eos:
                self.done[i], self.reason[i] = True, "eos"
            elif req.stop and cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), req.stop)[1]:
                self.done[i], self.reason[i] = True, "stop"
            elif len(new) >= req.max_new_tokens:
                self.done[i] = True
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


class HFSystem:
    """transformers `generate` over left-padded batches; dense KV, so memory is the full cache."""

    supports_forced_decoding = True

    def __init__(self, model_dir: str, dtype: str = "auto", name: str = "hf", device: str = "cpu",
                 batch_size: int = 8):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name, self.device, self.batch_size = name, device, batch_size
        self.dtype = resolve_dtype(dtype, device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(device).eval()
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(
            iter(self.eos_ids), 0)
        self.reset_stats()

    def reset_stats(self) -> None:
        self._peak_kv = 0

    def memory_report(self) -> MemoryReport:
        return MemoryReport(mode="physical", execution="transformers generate()", device_kv_peak_bytes=self._peak_kv,
                            extra={"note": "dense HF cache of the padded batch: rows x padded length"})

    def close(self) -> None:
        self.model = None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        forced = [r for r in requests if r.forced_output_ids is not None]
        if forced and len(forced) != len(requests):
            raise ValueError("HFSystem: send forced and free requests in separate generate() calls")
        if forced:
            return [self._force(r) for r in requests]
        out: list[Completion] = []
        for start in range(0, len(requests), self.batch_size):
            out.extend(self._generate_batch(requests[start:start + self.batch_size]))
        return out

    @torch.inference_mode()
    def _force(self, r: GenerationRequest) -> Completion:
        """Teacher forcing on a dense model is one forward over prompt + forced tokens (no KV policy to act)."""
        arrival = time.perf_counter()
        assert r.forced_output_ids is not None
        forced = [int(t) for t in r.forced_output_ids[:r.max_new_tokens]]
        ids = torch.tensor([list(r.prompt_token_ids) + forced], device=self.device)
        logits = self.model(ids).logits[0, len(r.prompt_token_ids) - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        now = time.perf_counter()
        return Completion(
            request_id=r.request_id, text=self.tokenizer.decode(forced, skip_special_tokens=True), token_ids=forced,
            prompt_tokens=len(r.prompt_token_ids), output_tokens=len(forced), arrival_time=r.arrival_time or arrival,
            token_times=[now] * len(forced),
            token_logprobs=logp.gather(1, torch.tensor(forced)[:, None])[:, 0].tolist(),
            argmax_ids=logits.argmax(-1).tolist(), logprobs=logp[:r.logprob_steps].cpu() if r.logprob_steps else None)

    @torch.inference_mode()
    def _generate_batch(self, reqs: Sequence[GenerationRequest]) -> list[Completion]:
        arrival = time.perf_counter()
        width = max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        sampled = reqs[0].temperature > 0
        if any((r.temperature > 0) != sampled or r.temperature != reqs[0].temperature or r.top_p != reqs[0].top_p
               for r in reqs):
            raise ValueError("HFSystem batches need one shared temperature/top_p; send mixed requests separately")
        clock = _StepClock(self.tokenizer, reqs, width, self.eos_ids)
        if sampled:
            torch.manual_seed(reqs[0].seed)
        kwargs = dict(do_sample=True, temperature=reqs[0].temperature, top_p=reqs[0].top_p) if sampled else dict(
            do_sample=False, temperature=None, top_p=None, top_k=None)
        want_logprobs = max(r.logprob_steps for r in reqs)
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            max_new_tokens=max(r.max_new_tokens for r in reqs), stopping_criteria=[clock],
            pad_token_id=self.pad_id, eos_token_id=None,  # EOS is handled per row by the clock (ignore_eos)
            output_logits=bool(want_logprobs), return_dict_in_generate=True, **kwargs)
        gen = out.sequences
        step_logp = (torch.log_softmax(torch.stack(out.logits, 1).float(), -1) if want_logprobs else None)
        self._peak_kv = max(self._peak_kv, gen.shape[0] * (gen.shape[1] - 1) * self.kv_bytes_per_token)
        results = []
        for i, r in enumerate(reqs):
            n = len(clock.times[i])
            toks = [int(t) for t in gen[i, width:width + n]]
            text = self.tokenizer.decode(toks[:-1] if clock.reason[i] == "eos" else toks, skip_special_tokens=True)
            text, _ = cut_at_stop(text, r.stop)
            extra: dict[str, Any] = {}
            if r.logprob_steps and step_logp is not None:
                lp = step_logp[i, :n]
                extra = dict(token_logprobs=lp.gather(1, torch.tensor(toks)[:, None])[:, 0].tolist(),
                             argmax_ids=lp.argmax(-1).tolist(), logprobs=lp[:r.logprob_steps].cpu())
            results.append(Completion(
                request_id=r.request_id, text=text, token_ids=toks, prompt_tokens=len(r.prompt_token_ids),
                output_tokens=n, arrival_time=r.arrival_time or arrival, token_times=clock.times[i],
                finish_reason=clock.reason[i], **extra))
        return results
