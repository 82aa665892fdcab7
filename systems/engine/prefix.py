"""Compressed prefixes several sequences read: a context compressed once for k questions, or a prompt's state right
after its prefill, kept for a later request (the teacher-forced fidelity pass reusing the generation's prefill).

A Prefix is named by the request fields GenerationRequest.shared_context (its readers) and keep_prefill (its
keeper). It holds its tokens, how many of them the policy compressed on their own (`compress_end`: the context; the
rest, if any, was appended uncompressed) and, once built, a holder slot: a slot outside the running batch whose
tables map the prefix's pages, plus the next-token logits after its last token.

Life of a prefix:
- registered when the first request naming it is added;
- built once: the first reader admitted while nobody builds it prefills the context itself (a plain query-agnostic
  request) and, in the step its last context token is stored and compressed, the engine forks its cache onto a
  holder slot (pages shared, see kv_sharing; the policy's per-slot state copied by Policy.fork) — when another
  request reads it (k = 1 parks nothing and runs exactly as a lone query-agnostic request). A keeper does the same
  at the end of its prompt, always. Readers admitted meanwhile wait for it;
- read: a reader admitted once it is built forks the holder (pages shared, its own copy of each partial last page)
  and prefills only its own tokens after the prefix; with none left (a forced pass over a kept prompt) its first
  token comes from the kept logits. Its decode-time policy state is its own from then on;
- freed when its last reader finishes (a kept prefix: once also released): the holder slot's references are
  dropped, so each page returns to the pool when no sequence maps it any more. Device KV is counted once, by the pool.

A preempted reader keeps its prefix alive, forks it again and recomputes only its own tokens. When nothing runs and
nothing fits, built prefixes none of whose users runs are given up (`stall`; their readers rebuild them), so parked
contexts cannot stall the engine. Without a free holder slot (engine.max_kept_prefixes) a builder runs on without
keeping, and the next reader builds the prefix again.
"""
from __future__ import annotations

import torch

from systems.engine.kv_cache import TieredKVCache
from systems.engine.sequence import Prefix, Sequence
from systems.policies.base import Policy


class Prefixes:
    """The engine's prefixes by key, and the holder slots they occupy."""

    def __init__(self, kv: TieredKVCache, policy: Policy, slots: range):
        self.kv, self.policy = kv, policy
        self.by_key: dict[str, Prefix] = {}
        self.free_slots = list(reversed(slots))
        self.kept = 0                       # prefixes built so far (tests and stats)

    # ---- requests ----------------------------------------------------------------------------------------------
    def register(self, seq: Sequence) -> None:
        """Link a new request to the prefixes it names, creating them; ValueError (nothing changed) when it
        contradicts an existing one."""
        req, ids = seq.request, list(seq.request.prompt_token_ids)
        rid, shared, keep = req.request_id, req.shared_context, req.keep_prefill
        if shared is not None and shared == keep:
            raise ValueError(f"request {rid}: shared_context and keep_prefill name the same key {shared!r}")
        compress = len(ids) if req.context_len is None else req.context_len
        adopt = self.by_key.get(keep) if keep is not None else None
        if adopt is not None and (adopt.pinned or adopt.tokens != tuple(ids) or adopt.compress_end != compress):
            raise ValueError(f"request {rid}: keep_prefill key {keep!r} is in use; release_prefix it first")
        read = self.by_key.get(shared) if shared is not None else None
        if read is not None:
            assert req.context_len is not None        # checked with the request
            if tuple(ids[:read.length]) != read.tokens or read.compress_end != req.context_len:
                raise ValueError(f"request {rid}: shared_context {shared!r} holds {read.length} tokens compressed "
                                 f"up to {read.compress_end}; this prompt does not open with them (context_len "
                                 f"{req.context_len})")
        if shared is not None:
            if read is None:
                assert req.context_len is not None
                read = Prefix(shared, tuple(ids[:req.context_len]), req.context_len, pinned=False)
                self.by_key[shared] = read
            seq.reads = read
            read.users.add(seq)
        if keep is not None:
            # readers that arrived first registered this very prefix: it is now kept (pinned)
            kept = adopt if adopt is not None else Prefix(keep, tuple(ids), compress, pinned=True)
            kept.pinned = True
            self.by_key[keep] = kept
            seq.keeps = kept
            kept.users.add(seq)

    def plan(self, seq: Sequence) -> tuple[str, Prefix | None, list[Prefix]]:
        """How a waiting sequence starts: ("fork", prefix, builds) from a built prefix, ("prefill", None, builds)
        from its first token, or ("wait", None, []) while another sequence builds the context it reads. `builds`:
        the prefixes it keeps on the way."""
        mine = [p for p in (seq.reads, seq.keeps) if p is not None]
        if not mine:
            return "prefill", None, []
        compress = len(seq.token_ids) if seq.context_len is None else seq.context_len
        fits = [p for p in mine if p.compress_end == compress and tuple(seq.token_ids[:p.length]) == p.tokens]
        ready = [p for p in fits if p.ready]
        src = max(ready, key=lambda p: p.length) if ready else None
        start = src.length if src is not None else 0
        builds = [p for p in fits if not p.ready and p.builder is None and p.length > start]
        reads = seq.reads
        if src is None and reads is not None and not reads.ready and reads.builder not in (None, seq):
            return "wait", None, []
        return ("fork", src, builds) if src is not None else ("prefill", None, builds)

    def fork(self, seq: Sequence, prefix: Prefix) -> None:
        """Start an admitted sequence (slot set) as a reader of a built prefix."""
        assert prefix.slot is not None and seq.slot is not None
        self.kv.fork_slot(prefix.slot, seq.slot)
        self.policy.fork(self.kv, prefix.slot, seq.slot)
        prefix.forks += 1
        seq.num_computed = prefix.length
        seq.forked = True
        seq.prefix_logits = prefix.logits

    def keep(self, seq: Sequence, prefix: Prefix, logits: torch.Tensor | None) -> bool:
        """The builder's prefill just reached the prefix's end (its hooks ran): fork its cache onto a holder slot.
        False when nobody else reads it (an unpinned prefix with no other user: nothing to share), or no holder slot
        or too few device blocks are free (then the next reader builds it again)."""
        seq.builds.remove(prefix)
        prefix.builder = None
        assert seq.slot is not None
        if not prefix.pinned and prefix.users <= {seq}:
            return False
        if not self.free_slots or self.kv.free_device_blocks() < self.kv.fork_blocks_needed(seq.slot):
            return False
        slot = self.free_slots.pop()
        self.kv.fork_slot(seq.slot, slot)
        self.policy.fork(self.kv, seq.slot, slot)
        prefix.slot = slot
        prefix.logits = None if logits is None else logits.detach().float().clone()
        self.kept += 1
        return True

    def stop_building(self, seq: Sequence) -> None:
        """The sequence leaves the batch (preempted, finished, failed): it builds nothing any more."""
        for p in seq.builds:
            if p.builder is seq:
                p.builder = None
        seq.builds = []

    def leave(self, seq: Sequence) -> None:
        """The sequence is done for good: it no longer holds its prefixes alive."""
        self.stop_building(seq)
        for p in (seq.reads, seq.keeps):
            if p is not None:
                p.users.discard(seq)
                self._maybe_free(p)

    def release(self, key: str) -> bool:
        """Unpin a kept prefix: it goes now, or with its last reader. False when no prefix has this key."""
        prefix = self.by_key.pop(key, None)
        if prefix is None:
            return False
        prefix.pinned = False
        self._maybe_free(prefix)
        return True

    # ---- memory --------------------------------------------------------------------------------------------------
    def stall(self, running: list[Sequence]) -> bool:
        """Nothing runs and nothing fits: give up every built prefix none of whose users runs (they rebuild it).
        True when device blocks were freed."""
        live = set(running)
        freed = False
        for prefix in list(self.by_key.values()):
            if prefix.ready and not (prefix.users & live):
                self._drop_holder(prefix)
                freed = True
        return freed

    def holder_slots(self) -> list[int]:
        return [p.slot for p in self.by_key.values() if p.slot is not None]

    def _maybe_free(self, prefix: Prefix) -> None:
        if prefix.pinned or prefix.users:
            return
        if self.by_key.get(prefix.key) is prefix:
            del self.by_key[prefix.key]
        self._drop_holder(prefix)

    def _drop_holder(self, prefix: Prefix) -> None:
        if prefix.slot is None:
            return
        self.policy.reset(prefix.slot)
        self.kv.free_seq(prefix.slot)
        self.free_slots.append(prefix.slot)
        prefix.slot, prefix.logits = None, None
