"""Continuous batching: admit by device-tier footprint, prefill first, decode the rest, preempt by recompute.

Prefill limit (instead of chunked prefill): a sequence is prefilled in one forward, because eviction policies
(SnapKV, CAKE's cascading) need a layer's whole prompt KV at once. Several prompts share a prefill step while their
total stays within max_num_batched_tokens; a longer prompt runs alone in its own step.
"""
from __future__ import annotations

from collections import deque

import torch

from systems.engine.kv_cache import TieredKVCache
from systems.engine.sequence import Sequence, Status
from systems.policies.base import Policy


class Scheduler:
    def __init__(self, kv: TieredKVCache, policy: Policy, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv, self.policy = kv, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.blocks_per_page_row = kv.num_layers * kv.num_kv_heads  # one new page in every (layer, head)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        return min((s.arrival_time for s in self.waiting), default=None)

    def schedule(self, now: float) -> tuple[list[Sequence], bool]:
        """The sequences to run this step and whether it is a prefill step (empty when nothing can run yet)."""
        batch = self._admit(now)
        if batch:
            return batch, True
        return self._decode_batch(), False

    def _admit(self, now: float) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = reserved = 0
        headroom = self.blocks_per_page_row * len(self.running)   # next decode pages of the running sequences
        for seq in list(self.waiting):
            if seq.arrival_time > now or len(self.running) + len(batch) >= self.max_num_seqs:
                break
            n = len(seq.token_ids)
            if batch and tokens + n > self.max_num_batched_tokens:
                break
            need = self.policy.device_blocks_needed(n, seq.remaining_tokens)
            if need + reserved + headroom > self.kv.free_device_blocks():
                if not self.running and not batch and need > self.kv.device_blocks.capacity:
                    raise RuntimeError(
                        f"request {seq.request.request_id}: needs {need} device blocks, the device tier holds "
                        f"{self.kv.device_blocks.capacity}; raise engine.device_memory_gb or shorten the prompt")
                break
            self.waiting.remove(seq)
            seq.slot = self.free_slots.pop()
            seq.status = Status.RUNNING
            seq.prefill_len = n
            seq.decode_step = 0
            self.policy.reset(seq.slot)
            batch.append(seq)
            tokens += n
            reserved += need
        self.running.extend(batch)
        return batch

    def _decode_batch(self) -> list[Sequence]:
        if not self.running:
            return []
        self.policy.begin_decode_step(self.kv, [s.info() for s in self.running])
        paused = self.kv.take_paused()
        batch = [s for s in self.running if s.slot not in paused]
        if not batch:                        # everyone waits on a copy: wait for it rather than spin
            self.kv.sync_copies()
            batch = list(self.running)
        while True:
            slots = torch.tensor([s.slot for s in batch], device=self.kv.device)
            need = self.kv.decode_blocks_needed(slots)
            if int(need.sum()) <= self.kv.free_device_blocks():
                self.kv.allocate_decode(slots, need)
                return batch
            victim = max(self.running, key=lambda s: s.order)     # the latest request gives way
            if len(self.running) == 1:
                raise RuntimeError(f"request {victim.request.request_id}: one sequence alone outgrows the device "
                                   f"tier; raise engine.device_memory_gb")
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

    def finish(self, seq: Sequence) -> None:
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
