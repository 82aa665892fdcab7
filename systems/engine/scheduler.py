"""Continuous batching: admit by device-tier footprint, prefill (whole or in chunks), decode, preempt by recompute.

Two modes. Chunked prefill (the default, as vLLM's scheduler): every step first decodes the running sequences, then
spends what is left of max_num_batched_tokens on prompt chunks — sequences mid-prefill first, then new arrivals —
so a long arrival no longer stalls the decodes. A chunked prompt keeps every page resident until its last chunk is
stored (a sliding-window layer only its window and the chunk being stored: kv_window.py); then the policy sees the
whole prompt at once (its after_prefill_layer hooks run in that step), so eviction policies keep their semantics,
and admission reserves the prompt's full footprint for it.

Whole-prompt prefill (chunked_prefill off, and always in batch-invariant mode, where a row's matmul shape must not
depend on what shares its step): prefill steps and decode steps alternate, several prompts share a prefill step
while their total stays within max_num_batched_tokens, a longer prompt runs alone.

Query-agnostic requests (GenerationRequest.context_len) prefill their context first, with the policy's hooks at its
end, and append the question in later steps (a chunk never crosses the end of the context). Requests reading a
shared context or a kept prefix (engine/prefix.py) are admitted by forking it: they need blocks only for their own
tokens, the private copies of the prefix's partial last pages, and (decoding over shared pages under a policy that
writes pages at decode time) one block per layer and KV head per step for a copy on write.

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
from systems.engine.prefix import Prefix, Prefixes
from systems.engine.sequence import Sequence, Status
from systems.policies.base import Policy


class SequenceError(RuntimeError):
    """A problem that belongs to one sequence: the engine fails that sequence and keeps serving the others."""

    def __init__(self, seq: Sequence, message: str):
        super().__init__(message)
        self.seq = seq


@dataclass
class Step:
    """One forward's work: sequences decoding one token, and prompt chunks (sequence, start, end); `from_prefix`:
    sequences just forked from a prefix with nothing left to prefill, whose first token comes from its logits."""

    decodes: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int, int]] = field(default_factory=list)
    from_prefix: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.chunks or self.from_prefix)


class Scheduler:
    def __init__(self, kv: TieredKVCache, policy: Policy, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = False, kept_prefixes: int = 0):
        """Slots 0 .. max_num_seqs-1 run sequences; the next `kept_prefixes` slots hold built prefixes."""
        self.kv, self.policy = kv, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.prefixes = Prefixes(kv, policy, range(max_num_seqs, max_num_seqs + kept_prefixes))
        self.blocks_per_page_row = kv.num_layers * kv.num_kv_heads  # one new page in every (layer, head)
        # a policy with decode-time hooks may write pages it holds (an eviction's hole, a promotion's recycled
        # block): over shared pages each such write takes a fresh block
        self._decode_writes = policy.overrides("after_append")
        self.num_preemptions = 0
        self.suspects: deque[Sequence] = deque()      # sequences of a failed step, to run alone (see isolate)

    def add(self, seq: Sequence) -> None:
        self.prefixes.register(seq)
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
        # whole prompts: a query-agnostic question waiting for its step goes first, then new arrivals
        chunks = self._continue([s for s in self.running if s.in_prefill], self.max_num_batched_tokens, whole=True)
        used = sum(b - a for _, a, b in chunks)
        admitted, ready = self._admit(now, self.max_num_batched_tokens - used, chunked=False, started=bool(chunks))
        if chunks or admitted or ready:
            return Step(chunks=chunks + admitted, from_prefix=ready)
        return Step(decodes=self._decode_batch(list(self.running)))

    def _schedule_chunked(self, now: float) -> Step:
        prefilling = [s for s in self.running if s.in_prefill]
        # with prompt work ready, a step whose decodes all wait on a tier copy runs the chunks instead of waiting
        other_work = bool(prefilling) or any(s.arrival_time <= now for s in self.waiting)
        decodes = self._decode_batch([s for s in self.running if not s.in_prefill], wait=not other_work)
        budget = self.max_num_batched_tokens - len(decodes)
        chunks = self._continue(prefilling, budget, whole=False)
        budget -= sum(b - a for _, a, b in chunks)
        ready: list[Sequence] = []
        if budget > 0:
            admitted, ready = self._admit(now, budget, chunked=True)
            chunks += admitted
        return Step(decodes=decodes, chunks=chunks, from_prefix=ready)

    def _continue(self, prefilling: list[Sequence], budget: int, whole: bool) -> list[tuple[Sequence, int, int]]:
        """The next chunk of each sequence mid-prefill, up to its next boundary (whole: all of it, alone when it
        is longer than the budget)."""
        chunks: list[tuple[Sequence, int, int]] = []
        for seq in prefilling:
            if budget <= 0:
                break
            if seq not in self.running:                       # preempted to make room for a decode
                continue
            stop = seq.next_boundary()
            if whole and chunks and stop - seq.num_computed > budget:
                break
            end = stop if whole else min(stop, seq.num_computed + budget)
            chunks.append((seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        return chunks

    # ---- device blocks -------------------------------------------------------------------------------------------
    def _dense_blocks(self, tokens: int) -> int:
        """Most blocks a prompt stored in chunks holds while `tokens` of it are stored (every page of a full-attention
        layer; a sliding-window layer returns the pages its window left after each chunk)."""
        return self.kv.prompt_blocks(tokens, self.max_num_batched_tokens if self.chunked_prefill else tokens)

    def _tail_blocks(self, tokens: int) -> int:
        """Blocks an uncompressed append of `tokens` can take after a compressed cache (per head a partial page,
        then ceil(tokens / P) pages at most)."""
        return self.blocks_per_page_row * -(-tokens // self.kv.page_size)

    def pending_prefill_blocks(self) -> int:
        """Device blocks that prompts mid-prefill will still store (and copy for a prefix they keep): reserved at
        admission, not yet drawn."""
        total = 0
        for s in self.running:
            if not s.in_prefill:
                continue
            end = s.compress_end
            if s.num_computed < end:
                # what it may still draw: its peak up to the end, less what it holds now
                total += max(self._dense_blocks(end) - self.kv.prompt_blocks(s.num_computed), 0)
                total += self._tail_blocks(s.prefill_len - end)
            else:
                total += self._tail_blocks(s.prefill_len - s.num_computed)
            total += self.blocks_per_page_row * len(s.builds)
        return total

    def _need(self, seq: Sequence, how: str, src: Prefix | None, builds: list[Prefix], split: bool) -> int:
        """Device blocks that must be free to admit the sequence this way (see device_blocks_needed)."""
        n = len(seq.token_ids)
        keep = self.blocks_per_page_row * len(builds)       # the kept prefixes' partial pages, copied once each
        if how == "fork":
            assert src is not None and src.slot is not None
            return self._tail_blocks(n - src.length) + self.kv.fork_blocks_needed(src.slot) + keep
        context = n if seq.context_len is None else seq.context_len
        base = self._dense_blocks(context) if split else self.policy.device_blocks_needed(context,
                                                                                          seq.remaining_tokens)
        return base + self._tail_blocks(n - context) + keep

    # ---- admission -----------------------------------------------------------------------------------------------
    def _admit(self, now: float, token_budget: int, chunked: bool, started: bool = False
               ) -> tuple[list[tuple[Sequence, int, int]], list[Sequence]]:
        """Waiting sequences admitted this step: their first chunks (start, end; the whole context when unchunked),
        and those forked with nothing to prefill. `started`: the step already holds prompt work."""
        batch: list[tuple[Sequence, int, int]] = []
        ready: list[Sequence] = []
        tokens = reserved = 0
        headroom = self.blocks_per_page_row * len(self.running)   # next decode pages of the running sequences
        headroom += self.pending_prefill_blocks()
        if self.suspects:       # a suspect waits for room (_schedule_suspect): newcomers must not take it first
            return batch, ready
        for seq in list(self.waiting):
            if seq.arrival_time > now or len(self.running) + len(batch) + len(ready) >= self.max_num_seqs:
                break
            how, src, builds = self.prefixes.plan(seq)
            if how == "wait":               # another sequence is building the context it reads
                continue
            start = src.length if src is not None else 0
            stop = min([len(seq.token_ids) if src is not None or seq.context_len is None else seq.context_len]
                       + [p.length for p in builds])
            n = stop - start
            left = token_budget - tokens
            if n and (left <= 0 or (not chunked and (batch or started) and n > left)):
                break
            # a prompt stored in several chunks holds all its pages until its last chunk: the dense footprint. When
            # that could never fit but the policy's own footprint does, the prompt is prefilled whole instead. An
            # append after a fork is chunked freely (its blocks are reserved whole)
            split = (chunked and n > left and how == "prefill"
                     and self._dense_blocks(stop) <= self.kv.device_blocks.capacity)
            need = self._need(seq, how, src, builds, split)
            if need + reserved + headroom > self.kv.free_device_blocks():
                if not self.running and not batch and not ready:
                    if self.prefixes.stall(self.running):       # parked contexts hold the pool: give them up
                        return self._admit(now, token_budget, chunked, started)
                    if need > self.kv.device_blocks.capacity:
                        raise self._too_big(seq, need)
                break
            self._start(seq, how, src, builds)
            end = start + (min(n, left) if (split or (chunked and how == "fork")) else n)
            if end == start:
                ready.append(seq)
            else:
                batch.append((seq, start, end))
            tokens += end - start
            reserved += need
        self.running.extend([s for s, _, _ in batch] + ready)
        return batch, ready

    def _too_big(self, seq: Sequence, need: int) -> SequenceError:
        return SequenceError(seq, f"request {seq.request.request_id}: needs {need} device blocks, the device tier "
                                  f"holds {self.kv.device_blocks.capacity}; raise engine.device_memory_gb or shorten "
                                  "the prompt")

    def _start(self, seq: Sequence, how: str, src: Prefix | None, builds: list[Prefix]) -> None:
        """Move a waiting sequence into a slot, to prefill its tokens from the start or from a forked prefix."""
        self.waiting.remove(seq)
        seq.slot = self.free_slots.pop()
        seq.status = Status.RUNNING
        seq.prefill_len = len(seq.token_ids)
        seq.num_computed = 0
        seq.decode_step = 0
        seq.forked = False
        seq.builds = list(builds)
        for p in builds:
            p.builder = seq
        if how == "fork":
            assert src is not None
            self.prefixes.fork(seq, src)
        else:
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
                if seq.in_prefill:
                    return Step(chunks=[(seq, seq.num_computed, seq.next_boundary())])
                return Step(decodes=self._decode_batch([seq]))
            how, src, builds = self.prefixes.plan(seq)
            if how == "wait":                     # alone, it does not wait for another builder
                how, builds = "prefill", []
            need = self._need(seq, how, src, builds, split=False)
            headroom = self.blocks_per_page_row * len(self.running) + self.pending_prefill_blocks()
            if len(self.running) >= self.max_num_seqs or need + headroom > self.kv.free_device_blocks():
                if not self.running and need > self.kv.device_blocks.capacity:
                    raise self._too_big(seq, need)
                return None
            self._start(seq, how, src, builds)
            self.running.append(seq)
            if not seq.in_prefill:
                return Step(from_prefix=[seq])
            return Step(chunks=[(seq, seq.num_computed, seq.next_boundary())])
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
            if int(need.sum()) + self._write_reserve(batch) <= (self.kv.free_device_blocks()
                                                                 - self.pending_prefill_blocks()):
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

    def _write_reserve(self, batch: list[Sequence]) -> int:
        """Blocks kept free for copies on write during the step: one per layer and KV head of each sequence that
        shares pages, when the policy writes pages at decode time (at most one hole per head per step)."""
        if not self._decode_writes or not self.kv.device_blocks.num_shared:
            return 0
        sharing = sum(1 for s in batch if s.slot is not None and self.kv.shared_device_pages(s.slot))
        return self.blocks_per_page_row * sharing

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV and queue it first; it is prefilled again over prompt + outputs so far (a reader
        forks its prefix again)."""
        self._release(seq)
        self.prefixes.stop_building(seq)
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
        self.prefixes.leave(seq)

    def finish(self, seq: Sequence) -> None:
        if not seq.in_prefill:
            seq.kv_stats = self.policy.kv_stats(self.kv, seq.info())
            seq.kv_stats.update(self._context_stats(seq))
        self._release(seq)
        seq.status = Status.FINISHED
        self.prefixes.leave(seq)

    def _context_stats(self, seq: Sequence) -> dict:
        """How the sequence's prompt met the cache: query-aware or agnostic, and the prefix it read or kept."""
        if seq.context_len is None and seq.reads is None and seq.keeps is None:
            return {}
        assert seq.slot is not None
        out: dict = {"compression": "query_aware" if seq.context_len is None else "query_agnostic",
                     "context_tokens": seq.compress_end}
        if seq.reads is not None:
            out.update(shared_context=seq.reads.key, forked_prefix=seq.forked,
                       shared_device_pages=self.kv.shared_device_pages(seq.slot))
        return out

    def _release(self, seq: Sequence) -> None:
        assert seq.slot is not None
        self.policy.reset(seq.slot)
        self.kv.free_seq(seq.slot)
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        seq.slot = None
        seq.num_computed = 0
        seq.prompt_q = {}
