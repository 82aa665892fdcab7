"""The engine loop: add requests (at their arrival time), step the scheduler and model, finish sequences.

Requests may compress their context query-agnostically (GenerationRequest.context_len), read a shared compressed
context or a kept prefix (shared_context), or keep their prompt's state for later requests (keep_prefill); see
engine/prefix.py. A prefix stays until its last reader finishes; a kept one also until `release_prefix`."""
from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from systems.base import GenerationRequest, cut_at_stop
from systems.engine.config import EngineConfig
from systems.engine.kv_cache import TieredKVCache
from systems.engine.model_runner import ModelRunner
from systems.engine.models.llama import LlamaModel
from systems.engine.ops import load_ops
from systems.engine.probe import PositionProbe
from systems.engine.sampler import check_sampling, sample
from systems.engine.scheduler import Scheduler, SequenceError, Step
from systems.engine.sequence import Sequence, Status
from systems.hardware import resolve_dtype
from systems.policies.base import Policy

log = logging.getLogger("kvharness.engine")


def _ids_ok(ids: Any, vocab: int) -> bool:
    # numbers.Integral: numpy and torch integer scalars are fine ids too; bool is an int but never a token
    return all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= int(t) < vocab for t in ids)


@dataclass
class StepTally:
    """The engine's steps that ran a forward, since it started (or the system's reset_stats), by kind: decode-only
    steps, mixed steps (decode rows beside a prompt chunk) and prompt-only steps; their count, decode rows and wall
    seconds from scheduling to the sampled tokens. A decode row makes one token of a running sequence (a sequence's
    first token, and its next one after a preemption, come from its prompt's last chunk instead). Under chunked
    prefill a decode row in a mixed step waits for the chunk. A forward that raised is counted apart, with no rows:
    its rows fail, or run again alone (Scheduler.isolate) and are counted then."""

    decode_steps: int = 0
    decode_rows: int = 0
    decode_s: float = 0.0
    mixed_steps: int = 0
    mixed_rows: int = 0
    mixed_s: float = 0.0
    prompt_steps: int = 0
    prompt_s: float = 0.0
    failed_steps: int = 0
    failed_s: float = 0.0

    def add(self, rows: int, with_chunk: bool, seconds: float) -> None:
        if not with_chunk:
            self.decode_steps += 1
            self.decode_rows += rows
            self.decode_s += seconds
        elif rows:
            self.mixed_steps += 1
            self.mixed_rows += rows
            self.mixed_s += seconds
        else:
            self.prompt_steps += 1
            self.prompt_s += seconds

    def add_failed(self, seconds: float) -> None:
        self.failed_steps += 1
        self.failed_s += seconds


class Engine:
    """Owns model, KV storage, scheduler and policy; `generate` or `add_request` + `step` drive it."""

    def __init__(self, model_dir: str, policy: Policy, engine_cfg: Any, dtype: str = "auto",
                 device: str | None = None, max_model_len: int | None = None,
                 is_eos: Callable[[int], bool] | None = None, model_name: str | None = None):
        self.config = cfg = EngineConfig.coerce(engine_cfg)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cfg.threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        self.dtype = resolve_dtype(dtype, self.device)
        kept = cfg.max_num_seqs if cfg.max_kept_prefixes is None else cfg.max_kept_prefixes
        self.model = LlamaModel(model_dir, self.dtype, self.device)
        spec = self.model.spec
        self.max_model_len = max_model_len or spec.max_position_embeddings
        self.ops = load_ops(self.device)
        self.kv = TieredKVCache(
            num_layers=spec.num_layers, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, page_size=cfg.page_size, max_seqs=cfg.max_num_seqs + kept,
            max_model_len=self.max_model_len, device_memory_gb=cfg.device_memory_gb,
            host_memory_gb=cfg.host_memory_gb, dtype=self.dtype, device=self.device, ops=self.ops,
            scale=spec.attn_scale, layer_windows=spec.layer_windows)
        self.kv.model_name = model_name      # what the policy keys its profile by (KVDims.model_name)
        self.policy = policy
        policy.bind(self.kv)
        self.kv.set_released_windows(policy.left_windows)
        # batch-invariant mode never mixes prefill and decode rows in one forward (a row's matmul shape would then
        # depend on its neighbours), so it prefills whole prompts
        self.scheduler = Scheduler(self.kv, policy, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   chunked_prefill=cfg.chunked_prefill and not cfg.batch_invariant,
                                   kept_prefixes=kept)
        self.runner = ModelRunner(self.model, self.kv, policy, self.ops, batch_invariant=cfg.batch_invariant,
                                  fused=cfg.fused_decode)
        eos = set(spec.eos_token_ids)
        self.is_eos = is_eos or (lambda t: t in eos)
        self.decode_text: Callable[[list[int]], str] = lambda ids: ""
        self._order = 0
        self.minmax_peak_bytes = 0
        self.tally = StepTally()

    @property
    def steps(self) -> dict[str, int]:
        """Forwards run, by phase: steps with a prompt chunk (mixed or prompt-only) and decode-only steps."""
        return {"prefill": self.tally.mixed_steps + self.tally.prompt_steps, "decode": self.tally.decode_steps}

    def add_request(self, request: GenerationRequest, arrival_time: float | None = None) -> Sequence:
        """Queue one request; a value that could fail a step is refused here, before it can share a batch."""
        self._check_request(request)
        if request.probe_positions and self.runner.probe is None:
            self.runner.probe = PositionProbe(self.kv)
            self.kv.positions = self.runner.probe.tracker
        arrival = arrival_time if arrival_time is not None else (request.arrival_time or time.perf_counter())
        seq = Sequence(request, arrival, self._order)
        self._order += 1
        self.scheduler.add(seq)
        return seq

    def _check_request(self, request: GenerationRequest) -> None:
        rid = request.request_id
        ids, n = request.prompt_token_ids, request.max_new_tokens
        if not ids:
            raise ValueError(f"request {rid}: empty prompt")
        vocab = self.model.spec.vocab_size
        if not _ids_ok(ids, vocab):
            bad = [t for t in ids if not _ids_ok([t], vocab)][:5]
            raise ValueError(f"request {rid}: prompt token ids {bad} are not integers in [0, {vocab})")
        if type(n) is not int or n < 1:
            raise ValueError(f"request {rid}: max_new_tokens={n!r} must be an integer >= 1")
        lp = request.logprob_steps
        if type(lp) is not int or lp < 0:
            raise ValueError(f"request {rid}: logprob_steps={lp!r} must be an integer >= 0")
        top = request.prompt_logprobs
        if top is not None and (type(top) is not int or not 0 <= top <= vocab):
            raise ValueError(f"request {rid}: prompt_logprobs={top!r} must be None or an integer in [0, {vocab}]")
        try:
            check_sampling(request.temperature, request.top_p, request.seed)
        except ValueError as exc:
            raise ValueError(f"request {rid}: {exc}") from None
        if not isinstance(request.stop, (tuple, list)) or not all(isinstance(x, str) for x in request.stop):
            raise ValueError(f"request {rid}: stop={request.stop!r} must be a tuple of strings")
        forced = request.forced_output_ids
        if forced is not None:
            if not 0 < n <= len(forced):
                raise ValueError(f"request {rid}: max_new_tokens={n} must be in [1, {len(forced)}], the number of "
                                 "forced output tokens")
            if not _ids_ok(forced, vocab):
                raise ValueError(f"request {rid}: forced output ids must be integers in [0, {vocab})")
        self._check_context(request)
        total = len(ids) + n
        if total > self.max_model_len:
            raise ValueError(f"request {rid}: prompt + max_new_tokens = {total} exceeds the "
                             f"engine's max_model_len {self.max_model_len}; truncate the prompt")

    @staticmethod
    def _check_context(request: GenerationRequest) -> None:
        rid, ctx = request.request_id, request.context_len
        if ctx is not None and (type(ctx) is not int or not 1 <= ctx <= len(request.prompt_token_ids)):
            raise ValueError(f"request {rid}: context_len={ctx!r} must be an integer in [1, prompt length "
                             f"{len(request.prompt_token_ids)}]")
        for name in ("shared_context", "keep_prefill"):
            key = getattr(request, name)
            if key is not None and (not isinstance(key, str) or not key):
                raise ValueError(f"request {rid}: {name}={key!r} must be a non-empty string")
        if request.shared_context is not None and ctx is None:
            raise ValueError(f"request {rid}: shared_context needs context_len (how many prompt tokens it shares)")

    @torch.inference_mode()
    def release_prefix(self, key: str) -> bool:
        """Unpin a prefix kept by keep_prefill: freed now, or when its last reader finishes. False: no such key."""
        return self.scheduler.prefixes.release(key)

    # every entry that reaches the policy's hooks runs in inference mode, as the forward does: a hook may (re)allocate
    # its state there (a ledger growing), and an inference tensor can only be updated in place inside that mode
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One scheduler step (one forward over decodes and prompt chunks); returns the sequences that finished.

        A failure that belongs to one sequence (its sampling, its log-probabilities, its stop check, it alone
        outgrowing the device tier) finishes that sequence with finish_reason "error" and `error` set; the other
        sequences of the step go on. A failed forward over several sequences sends them to run alone (see
        Scheduler.isolate), so a failure that returns there is one sequence's own."""
        now = time.perf_counter()
        try:
            work = self.scheduler.schedule(now)
        except SequenceError as exc:
            self.fail(exc.seq, exc)
            return [exc.seq]
        if not work:
            nxt = self.scheduler.next_arrival()
            if nxt is not None and not self.scheduler.running:
                time.sleep(min(max(nxt - now, 0.0), 0.05))
            return []
        finished: list[Sequence] = []
        logits = None
        tallied: tuple[int, bool] | None = None     # (decode rows, with a chunk) of a forward that ran
        if work.decodes or work.chunks:
            if self.runner.probe is not None:
                self.runner.probe.before_step(work.chunks)
            try:
                logits = self.runner.run_step(work.decodes, work.chunks)
            except Exception as exc:  # noqa: BLE001 - whose row broke the forward is found by running each alone
                self.tally.add_failed(time.perf_counter() - now)
                in_step = work.decodes + [s for s, _, _ in work.chunks]
                if len(in_step) == 1:
                    self.fail(in_step[0], exc)
                    finished = in_step
                else:
                    self.scheduler.isolate(in_step)
                if not work.from_prefix:
                    return finished
                work.decodes, work.chunks = [], []
            else:
                tallied = (len(work.decodes), bool(work.chunks))
        for seq, _, end in work.chunks:
            seq.num_computed = end
        seqs, logits = self._token_rows(work, logits)
        self._track_minmax()
        if not seqs:                 # only partial chunks: no token yet
            if tallied:
                self.tally.add(*tallied, time.perf_counter() - now)
            return finished
        tokens = sample(logits, seqs)
        self._record_logprobs(seqs, logits, tokens)
        stamp = time.perf_counter()  # after sampling, which waits for the device: the token exists now
        if tallied:
            self.tally.add(*tallied, stamp - now)
        for seq, tok in zip(seqs, tokens):
            try:
                if isinstance(tok, Exception):
                    raise tok
                seq.token_ids.append(tok)
                seq.token_times.append(stamp)
                seq.decode_step += 1
                done = self._check_finish(seq, tok)
                if done:
                    self.scheduler.finish(seq)
            except Exception as exc:  # noqa: BLE001 - this sequence's failure, not its neighbours'
                self.fail(seq, exc)
                done = True
            if done:
                finished.append(seq)
        return finished

    def _token_rows(self, work: Step, logits: torch.Tensor | None) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences that get a token this step and their logits rows; keeps the prefixes whose builders'
        chunks just reached them (the forward returned a logits row for each, see Sequence.logits_at)."""
        rows = work.decodes + [s for s, _, end in work.chunks if s.logits_at(end)]
        seqs = work.decodes + [s for s, _, end in work.chunks if end == s.prefill_len]
        for seq, _, end in work.chunks:
            for prefix in [p for p in seq.builds if p.length == end]:
                assert logits is not None
                self.scheduler.prefixes.keep(seq, prefix, logits[rows.index(seq)])
        if logits is not None and len(rows) != len(seqs):
            logits = logits[[rows.index(s) for s in seqs]]
        if work.from_prefix:        # forked with nothing left to prefill: the prefix's own next-token logits
            rows_kept = [s.prefix_logits for s in work.from_prefix if s.prefix_logits is not None]
            assert len(rows_kept) == len(work.from_prefix)
            kept = torch.stack(rows_kept)
            logits = kept if logits is None else torch.cat([logits.float(), kept.to(logits.device)])
            seqs = seqs + work.from_prefix
        return seqs, logits if logits is not None else torch.empty(0)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """Finish one sequence with an error (its blocks freed); the rest of the batch is untouched."""
        self.scheduler.drop(seq)
        seq.finish_reason = "error"
        seq.error = f"{type(exc).__name__}: {exc}"
        log.warning("request %s failed alone: %s", seq.request.request_id, seq.error)

    @staticmethod
    def _record_logprobs(seqs: list[Sequence], logits: torch.Tensor, tokens: list[int | Exception]) -> None:
        """Forced tokens replace the sampled ones; log-probabilities are kept where the request asks for them. A
        row that fails here holds its exception in `tokens`, like a failed draw."""
        want = [i for i, s in enumerate(seqs) if s.request.forced_output_ids is not None or s.request.logprob_steps]
        if not want:
            return
        logp = torch.log_softmax(logits[want].float(), dim=-1)
        for row, i in enumerate(want):
            seq = seqs[i]
            try:
                step = seq.num_output_tokens
                forced = seq.request.forced_output_ids
                if forced is not None:
                    tokens[i] = int(forced[step])
                tok = tokens[i]
                if isinstance(tok, Exception):
                    continue
                seq.token_logprobs.append(float(logp[row, tok]))
                seq.argmax_ids.append(int(logits[i].argmax()))
                if step < seq.request.logprob_steps:
                    seq.logprob_rows.append(logp[row].cpu())
            except Exception as exc:  # noqa: BLE001 - this row's failure is its sequence's
                tokens[i] = exc

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
        pages += sum(-(-int(self.kv.num_tokens[slot].max()) // self.kv.page_size)       # parked prefixes' rows
                     for slot in self.scheduler.prefixes.holder_slots())
        live = pages * self.kv.num_layers * self.kv.num_kv_heads * self.kv.minmax_bytes_per_page
        self.minmax_peak_bytes = max(self.minmax_peak_bytes, live)

    @torch.inference_mode()
    def abort(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (a client went away), freeing its KV blocks in both tiers."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.scheduler.drop(seq)
        else:
            self.scheduler.finish(seq)
        seq.finish_reason = "abort"

    def run(self) -> None:
        while self.scheduler.has_work():
            self.step()

    def set_policy(self, policy: Policy) -> None:
        """Run later requests under `policy` (one of the same class, e.g. Policy.at_budget's): bound to this KV
        storage and handed to the scheduler and runner. Only between generate() calls: no sequence may be alive."""
        assert not self.scheduler.has_work(), "set_policy with sequences in flight"
        if type(policy) is not type(self.policy):
            # the runner chose its paths by the class's hooks (which steps run fused, which keep prompt queries)
            raise ValueError(f"set_policy takes a {type(self.policy).__name__} (the engine's policy class), not a "
                             f"{type(policy).__name__}: build another engine for another policy")
        policy.bind(self.kv)
        self.kv.set_released_windows(policy.left_windows)
        self.policy = self.scheduler.policy = self.runner.policy = policy
        if self.runner.fused is not None:
            self.runner.fused.policy = policy

    def generate(self, requests: list[GenerationRequest]) -> list[Sequence]:
        """All requests to completion; mid-run arrivals honour each request's arrival_time."""
        t0 = time.perf_counter()
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time or t0)
        added = {i: self.add_request(requests[i], requests[i].arrival_time or t0) for i in order}
        self.run()
        seqs = [added[i] for i in range(len(requests))]
        assert all(s.status is Status.FINISHED for s in seqs)
        failed = [s for s in seqs if s.error]
        if failed:       # an offline caller gets no partial results it could mistake for complete ones
            raise RuntimeError(f"{len(failed)} of {len(seqs)} requests failed; the first, request "
                               f"{failed[0].request.request_id}: {failed[0].error}")
        return seqs
