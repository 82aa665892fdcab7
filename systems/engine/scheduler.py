"""Continuous batching: admit by device-tier footprint, prefill (whole or in chunks), decode, preempt by recompute.

Two modes. Chunked prefill (the default, as vLLM's scheduler): every step first decodes the running sequences, then
spends what is left of max_num_batched_tokens on prompt chunks — sequences mid-prefill first, then new arrivals —
so a long arrival no longer stalls the decodes. A chunked prompt keeps every page resident until its last chunk is
stored; then the policy sees the whole prompt at once (its after_prefill_layer hooks run in that step), so
eviction policies keep their semantics, and admission reserves the prompt's full footprint for it.

Whole-prompt prefill (chunked_prefill off, and always in batch-invariant mode, where a row's matmul shape must not
depend on what shares its step): prefill steps and decode steps alternate, several prompts share a prefill step
while their total stays within max_num_batched_tokens, a longer prompt runs alone.

Isolation: when a forward over several sequences fails, nobody knows whose row broke it, so the engine preempts them
all and hands them to `isolate`; each then runs alone (its recompute prefill and one decode) before it rejoins the
batch, so a failure that returns is that one sequence's own and fails it alone. Problems that belong to one sequence
(it alone outgrows the device tier) raise SequenceError, which the engine turns into that sequence's failure.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from systems.engine.kv_cache import TieredKVCache
from systems.engine.sequence import Sequence, Status
from systems.policies.base import Policy


class SequenceError(RuntimeError):
    """A problem that belongs to one sequence: the engine fails that sequence and keeps serving the others."""

    def __init__(self, seq: Sequence, message: str):
        super().__init__(message)
        self.seq = seq


@dataclass
class Step:
    """One forward's work: sequences decoding one token, and prompt chunks (sequence, start, end)."""

    decodes: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.chunks)


class Scheduler:
    def __init__(self, kv: TieredKVCache, policy: Policy, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = False):
        self.kv, self.policy = kv, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.blocks_per_page_row = kv.num_layers * kv.num_kv_heads  # one new page in every (layer, head)
        self.num_preemptions = 0
        self.suspects: deque[Sequence] = deque()      # sequences of a failed step, to run alone (see isolate)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        return min((s.arrival_time for s in self.waiting), default=None)

    def schedule(self, now: float) -> Step:
        """This step's work (empty when nothing can run yet)."""
        if self.suspects:
            solo = self._schedule_suspect()
            if solo is not None:
                return solo
        if self.chunked_prefill:
            return self._schedule_chunked(now)
        batch = self._admit(now, self.max_num_batched_tokens, chunked=False)
        if batch:
            return Step(chunks=[(s, 0, s.prefill_len) for s, _ in batch])
        return Step(decodes=self._decode_batch(list(self.running)))

    def _schedule_chunked(self, now: float) -> Step:
        prefilling = [s for s in self.running if s.in_prefill]
        # with prompt work ready, a step whose decodes all wait on a tier copy runs the chunks instead of waiting
        other_work = bool(prefilling) or any(s.arrival_time <= now for s in self.waiting)
        decodes = self._decode_batch([s for s in self.running if not s.in_prefill], wait=not other_work)
        budget = self.max_num_batched_tokens - len(decodes)
        chunks = []
        for seq in prefilling:
            if budget <= 0:
                break
            if seq not in self.running:                       # preempted to make room for a decode
                continue
            end = min(seq.prefill_len, seq.num_computed + budget)
            chunks.append((seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        if budget > 0:
            for seq, end in self._admit(now, budget, chunked=True):
                chunks.append((seq, 0, end))
                budget -= end
        return Step(decodes=decodes, chunks=chunks)

    def _dense_blocks(self, tokens: int) -> int:
        return self.blocks_per_page_row * -(-tokens // self.kv.page_size)

    def pending_prefill_blocks(self) -> int:
        """Device blocks that prompts mid-prefill will still store: reserved at admission, not yet drawn."""
        return sum(self._dense_blocks(s.prefill_len) - self._dense_blocks(s.num_computed)
                   for s in self.running if s.in_prefill)

    def _admit(self, now: float, token_budget: int, chunked: bool) -> list[tuple[Sequence, int]]:
        """Waiting sequences admitted this step, each with the end of its first chunk (its whole prompt when
        unchunked)."""
        batch: list[tuple[Sequence, int]] = []
        tokens = reserved = 0
        headroom = self.blocks_per_page_row * len(self.running)   # next decode pages of the running sequences
        headroom += self.pending_prefill_blocks()
        if self.suspects:       # a suspect waits for room (_schedule_suspect): newcomers must not take it first
            return batch
        for seq in list(self.waiting):
            if seq.arrival_time > now or len(self.running) + len(batch) >= self.max_num_seqs:
                break
            n = len(seq.token_ids)
            left = token_budget - tokens
            if left <= 0 or (not chunked and batch and n > left):
                break
            # a prompt stored in several chunks holds all its pages until its last chunk: the dense footprint. When
            # that could never fit but the policy's own footprint does, the prompt is prefilled whole instead
            need = self.policy.device_blocks_needed(n, seq.remaining_tokens)
            split = chunked and n > left and self._dense_blocks(n) <= self.kv.device_blocks.capacity
            if split:
                need = self._dense_blocks(n)
            if need + reserved + headroom > self.kv.free_device_blocks():
                if not self.running and not batch and need > self.kv.device_blocks.capacity:
                    raise self._too_big(seq, need)
                break
            self._start(seq, n)
            end = min(n, left) if split else n
            batch.append((seq, end))
            tokens += end
            reserved += need
        self.running.extend(s for s, _ in batch)
        return batch

    def _too_big(self, seq: Sequence, need: int) -> SequenceError:
        return SequenceError(seq, f"request {seq.request.request_id}: needs {need} device blocks, the device tier "
                                  f"holds {self.kv.device_blocks.capacity}; raise engine.device_memory_gb or shorten "
                                  "the prompt")

    def _start(self, seq: Sequence, n: int) -> None:
        """Move a waiting sequence into a slot, to prefill its n tokens from the start."""
        self.waiting.remove(seq)
        seq.slot = self.free_slots.pop()
        seq.status = Status.RUNNING
        seq.prefill_len = n
        seq.num_computed = 0
        seq.decode_step = 0
        self.policy.reset(seq.slot)

    def isolate(self, seqs: list[Sequence]) -> None:
        """Preempt the sequences of a failed step; each runs alone before it rejoins the batch."""
        for seq in sorted(seqs, key=lambda s: s.order, reverse=True):      # the earliest ends up first in line
            if seq.status is Status.RUNNING:
                self.preempt(seq)
        self.suspects.extend(sorted(seqs, key=lambda s: s.order))

    def _schedule_suspect(self) -> Step | None:
        """The first suspect's step, alone: its whole prefill, then one decode. None while it cannot fit yet (the
        others run meanwhile, and finish or free blocks)."""
        while self.suspects:
            seq = self.suspects[0]
            if seq.status is Status.FINISHED or (seq.status is Status.RUNNING and seq.decode_step >= 2):
                self.suspects.popleft()           # cleared: it ran alone without failing
                continue
            if seq.status is Status.RUNNING:
                return Step(decodes=self._decode_batch([seq]))
            n = len(seq.token_ids)
            need = self.policy.device_blocks_needed(n, seq.remaining_tokens)
            headroom = self.blocks_per_page_row * len(self.running) + self.pending_prefill_blocks()
            if len(self.running) >= self.max_num_seqs or need + headroom > self.kv.free_device_blocks():
                if not self.running and need > self.kv.device_blocks.capacity:
                    raise self._too_big(seq, need)
                return None
            self._start(seq, n)
            self.running.append(seq)
            return Step(chunks=[(seq, 0, n)])
        return None

    def _decode_batch(self, candidates: list[Sequence], wait: bool = True) -> list[Sequence]:
        if not candidates:
            return []
        self.policy.begin_decode_step(self.kv, [s.info() for s in candidates])
        paused = self.kv.take_paused()
        batch = [s for s in candidates if s.slot not in paused]
        if not batch:
            if not wait:
                return []
            self.kv.sync_copies()            # everyone waits on a copy: wait for it rather than spin
            batch = list(candidates)
        while True:
            slots = torch.tensor([s.slot for s in batch], device=self.kv.device)
            need = self.kv.decode_blocks_needed(slots)
            # blocks that prompts mid-prefill still need are theirs: a decode that would take them preempts
            if int(need.sum()) <= self.kv.free_device_blocks() - self.pending_prefill_blocks():
                self.kv.allocate_decode(slots, need)
                return batch
            victim = max(self.running, key=lambda s: s.order)     # the latest request gives way
            if len(self.running) == 1:
                raise SequenceError(victim, f"request {victim.request.request_id}: one sequence alone outgrows "
                                            "the device tier; raise engine.device_memory_gb")
            self.preempt(victim)
            batch = [s for s in batch if s is not victim]
            if not batch:
                return []

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV and queue it first; it is prefilled again over prompt + outputs so far."""
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def drop(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (failed or aborted), freeing its KV blocks in both tiers."""
        if seq in self.suspects:
            self.suspects.remove(seq)
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self._release(seq)
        seq.status = Status.FINISHED

    def finish(self, seq: Sequence) -> None:
        if not seq.in_prefill:
            seq.kv_stats = self.policy.kv_stats(self.kv, seq.info())
        self._release(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: Sequence) -> None:
        assert seq.slot is not None
        self.policy.reset(seq.slot)
        self.kv.free_seq(seq.slot)
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        seq.slot = None
        seq.num_computed = 0
        seq.prompt_q = {}
