"""The engine loop: add requests (at their arrival time), step the scheduler and model, finish sequences."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from systems.base import GenerationRequest, cut_at_stop
from systems.engine.config import EngineConfig
from systems.engine.kv_cache import TieredKVCache
from systems.engine.model_runner import ModelRunner
from systems.engine.models.llama import LlamaModel
from systems.engine.ops import load_ops
from systems.engine.sampler import sample
from systems.engine.scheduler import Scheduler
from systems.engine.sequence import Sequence, Status
from systems.hardware import resolve_dtype
from systems.policies.base import Policy


class Engine:
    """Owns model, KV storage, scheduler and policy; `generate` or `add_request` + `step` drive it."""

    def __init__(self, model_dir: str, policy: Policy, engine_cfg: Any, dtype: str = "auto",
                 device: str | None = None, max_model_len: int | None = None,
                 is_eos: Callable[[int], bool] | None = None):
        self.config = cfg = EngineConfig.coerce(engine_cfg)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cfg.threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = LlamaModel(model_dir, self.dtype, self.device)
        spec = self.model.spec
        self.max_model_len = max_model_len or spec.max_position_embeddings
        self.ops = load_ops(self.device)
        self.kv = TieredKVCache(
            num_layers=spec.num_layers, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, page_size=cfg.page_size, max_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len, device_memory_gb=cfg.device_memory_gb,
            host_memory_gb=cfg.host_memory_gb, dtype=self.dtype, device=self.device, ops=self.ops,
            scale=spec.attn_scale)
        self.policy = policy
        policy.bind(self.kv)
        # batch-invariant mode never mixes prefill and decode rows in one forward (a row's matmul shape would then
        # depend on its neighbours), so it prefills whole prompts
        self.scheduler = Scheduler(self.kv, policy, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   chunked_prefill=cfg.chunked_prefill and not cfg.batch_invariant)
        self.runner = ModelRunner(self.model, self.kv, policy, self.ops, batch_invariant=cfg.batch_invariant,
                                  fused=cfg.fused_decode)
        eos = set(spec.eos_token_ids)
        self.is_eos = is_eos or (lambda t: t in eos)
        self.decode_text: Callable[[list[int]], str] = lambda ids: ""
        self._order = 0
        self.minmax_peak_bytes = 0
        self.steps = {"prefill": 0, "decode": 0}

    def add_request(self, request: GenerationRequest, arrival_time: float | None = None) -> Sequence:
        total = len(request.prompt_token_ids) + request.max_new_tokens
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id}: empty prompt")
        forced = request.forced_output_ids
        if forced is not None and not 0 < request.max_new_tokens <= len(forced):
            raise ValueError(f"request {request.request_id}: max_new_tokens={request.max_new_tokens} must be in "
                             f"[1, {len(forced)}], the number of forced output tokens")
        if total > self.max_model_len:
            raise ValueError(f"request {request.request_id}: prompt + max_new_tokens = {total} exceeds the "
                             f"engine's max_model_len {self.max_model_len}; truncate the prompt")
        arrival = arrival_time if arrival_time is not None else (request.arrival_time or time.perf_counter())
        seq = Sequence(request, arrival, self._order)
        self._order += 1
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One scheduler step (one forward over decodes and prompt chunks); returns the sequences that finished."""
        now = time.perf_counter()
        work = self.scheduler.schedule(now)
        if not work:
            nxt = self.scheduler.next_arrival()
            if nxt is not None and not self.scheduler.running:
                time.sleep(min(max(nxt - now, 0.0), 0.05))
            return []
        logits = self.runner.run_step(work.decodes, work.chunks)
        for seq, _, end in work.chunks:
            seq.num_computed = end
        seqs = work.decodes + [s for s, _, end in work.chunks if end == s.prefill_len]
        self.steps["prefill" if work.chunks else "decode"] += 1
        self._track_minmax()
        if not seqs:                 # only partial chunks: no token yet
            return []
        tokens = sample(logits, seqs)
        self._record_logprobs(seqs, logits, tokens)
        stamp = time.perf_counter()  # after sampling, which waits for the device: the token exists now
        finished = []
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            seq.token_times.append(stamp)
            seq.decode_step += 1
            if self._check_finish(seq, tok):
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished

    @staticmethod
    def _record_logprobs(seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> None:
        """Forced tokens replace the sampled ones; log-probabilities are kept where the request asks for them."""
        want = [i for i, s in enumerate(seqs) if s.request.forced_output_ids is not None or s.request.logprob_steps]
        if not want:
            return
        logp = torch.log_softmax(logits[want].float(), dim=-1)
        for row, i in enumerate(want):
            seq = seqs[i]
            step = seq.num_output_tokens
            forced = seq.request.forced_output_ids
            if forced is not None:
                tokens[i] = int(forced[step])
            seq.token_logprobs.append(float(logp[row, tokens[i]]))
            seq.argmax_ids.append(int(logits[i].argmax()))
            if step < seq.request.logprob_steps:
                seq.logprob_rows.append(logp[row].cpu())

    def _check_finish(self, seq: Sequence, token: int) -> bool:
        req = seq.request
        if req.forced_output_ids is not None:        # teacher forcing: exactly the given tokens, EOS or not
            if seq.num_output_tokens >= req.max_new_tokens:
                seq.finish_reason = "length"
                return True
            return False
        if not req.ignore_eos and self.is_eos(token):
            seq.finish_reason = "eos"
            return True
        if req.stop:
            _, found = cut_at_stop(self.decode_text(seq.output_ids), req.stop)
            if found:
                seq.finish_reason = "stop"
                return True
        if seq.num_output_tokens >= req.max_new_tokens:
            seq.finish_reason = "length"
            return True
        return False

    def _track_minmax(self) -> None:
        pages = sum(-(-(s.num_computed if s.in_prefill else len(s.token_ids)) // self.kv.page_size)
                    for s in self.scheduler.running)
        live = pages * self.kv.num_layers * self.kv.num_kv_heads * self.kv.minmax_bytes_per_page
        self.minmax_peak_bytes = max(self.minmax_peak_bytes, live)

    def abort(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (a client went away), freeing its KV blocks in both tiers."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.scheduler.waiting.remove(seq)
            seq.status = Status.FINISHED
        else:
            self.scheduler.finish(seq)
        seq.finish_reason = "abort"

    def run(self) -> None:
        while self.scheduler.has_work():
            self.step()

    def generate(self, requests: list[GenerationRequest]) -> list[Sequence]:
        """All requests to completion; mid-run arrivals honour each request's arrival_time."""
        t0 = time.perf_counter()
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time or t0)
        added = {i: self.add_request(requests[i], requests[i].arrival_time or t0) for i in order}
        self.run()
        seqs = [added[i] for i in range(len(requests))]
        assert all(s.status is Status.FINISHED for s in seqs)
        return seqs
