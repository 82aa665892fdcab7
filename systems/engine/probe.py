"""Position probe: which prompt positions each (layer, KV head) holds and reads at a request's first decode step.

Policies compact a head's storage (keep_tokens keeps storage indices, drop_tokens moves the last token into a hole),
so after eviction a storage index no longer says which prompt token it holds. For requests that ask for it
(`GenerationRequest.probe_positions`), a `PositionTracker` mirrors those moves in a tensor of original positions per
storage index — only for the probed slots, only from their prefill to their first decode step, then forgotten:
requests that do not ask pay nothing, and the engine keeps one tracker while any probed request ran.

Tokens stored after the last mirrored change (decode tokens the fused C++ step appends, a question appended to a
compressed context) are not written one by one: they are a head's tail, in order, continuing from the positions
already stored; a keep or drop writes that tail out before it moves tokens. At the first decode step (SeqInfo
decode_step 1) `observe` is called per layer after the policy chose its pages: it records per KV head the positions
the head holds (pages resident on the device or copied to the host) and the positions the attention reads (the
selected pages — for page sets per query head, their union over the KV head's group, what the head reads from
memory — or every held token when the policy answers None; a sliding window's hidden tokens left out). A
request that never decodes (one output token, or EOS at once) gets no record.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from systems.base import PositionRecord
from systems.policies.base import SeqInfo

if TYPE_CHECKING:
    from systems.engine.sequence import Sequence


class PositionTracker:
    """Original prompt positions by storage index for the watched slots, kept in step with the KV cache's moves."""

    def __init__(self, num_layers: int, num_kv_heads: int, capacity: int) -> None:
        self.shape = (num_layers, num_kv_heads)
        self.capacity = capacity
        self.positions: dict[int, torch.Tensor] = {}   # slot -> [L, H, capacity] int64 position per storage index
        self.written: dict[int, torch.Tensor] = {}     # slot -> [L, H] storage indices whose position is written
        self.next_pos: dict[int, torch.Tensor] = {}    # slot -> [L, H] position of the first unwritten (tail) token

    def watch(self, slot: int) -> None:
        self.positions[slot] = torch.zeros((*self.shape, self.capacity), dtype=torch.int64)
        self.written[slot] = torch.zeros(self.shape, dtype=torch.int64)
        self.next_pos[slot] = torch.zeros(self.shape, dtype=torch.int64)

    def forget(self, slot: int) -> None:
        for table in (self.positions, self.written, self.next_pos):
            table.pop(slot, None)

    def watching(self, slot: int) -> bool:
        return slot in self.positions

    # ---- the KV cache's moves ------------------------------------------------------------------------------------
    def stored(self, slot: int, layer: int, start: int, n: int) -> None:
        """Prefill wrote positions start .. start+n-1 of one layer, in position order, at the same storage indices."""
        if slot not in self.positions:
            return
        self.positions[slot][layer, :, start:start + n] = torch.arange(start, start + n)
        self.written[slot][layer] = start + n
        self.next_pos[slot][layer] = start + n

    def kept(self, slot: int, layer: int, head: int, index: torch.Tensor, count: int) -> None:
        """keep_tokens: of the head's `count` tokens, storage indices `index` (ascending) move to 0 .. len-1."""
        if slot not in self.positions:
            return
        row = self._row(slot, layer, head, count)
        row[:index.numel()] = row[index.cpu().long()].clone()
        self.written[slot][layer, head] = index.numel()

    def dropped(self, slots: torch.Tensor, layer: int, heads: torch.Tensor, index: torch.Tensor,
                last: torch.Tensor) -> None:
        """drop_tokens: each entry's last token (storage index `last`) moves into the hole `index`."""
        if not self.positions:
            return
        for slot, head, hole, end in zip(slots.tolist(), heads.tolist(), index.tolist(), last.tolist()):
            if slot in self.positions:
                row = self._row(slot, layer, head, end + 1)
                row[hole] = row[end]
                self.written[slot][layer, head] = end

    def _row(self, slot: int, layer: int, head: int, count: int) -> torch.Tensor:
        """The head's positions with every token up to `count` written (the tail filled in order)."""
        row = self.positions[slot][layer, head]
        done = int(self.written[slot][layer, head])
        if count > done:
            start = int(self.next_pos[slot][layer, head])
            row[done:count] = torch.arange(start, start + count - done)
            self.next_pos[slot][layer, head] = start + count - done
            self.written[slot][layer, head] = count
        return row

    def positions_of(self, slot: int, layer: int, head: int, count: int) -> torch.Tensor:
        """Original positions of the head's storage indices 0 .. count-1."""
        return self._row(slot, layer, head, count)[:count]


class PositionProbe:
    """Watches probed requests from prefill to their first decode step and keeps one record per request."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.tracker = PositionTracker(kv.num_layers, kv.num_kv_heads, kv.max_pages * kv.page_size)
        self.records: dict[int, PositionRecord] = {}           # id(Sequence) -> its record
        self._seqs: dict[int, Sequence] = {}                   # watched slot -> its sequence
        self._layers: dict[int, tuple[list[list[Any]], list[list[Any]]]] = {}   # slot -> (held, read) so far

    def before_step(self, chunks: Seq[tuple[Sequence, int, int]]) -> None:
        """A prompt chunk from position 0 starts a prefill in its slot: watch it when its request is probed and has
        no record yet (a preempted request prefills again), else stop watching the slot."""
        for seq, start, _ in chunks:
            if start != 0 or seq.slot is None:
                continue
            self._layers.pop(seq.slot, None)
            if seq.request.probe_positions and id(seq) not in self.records:
                self.tracker.watch(seq.slot)
                self._seqs[seq.slot] = seq
            else:
                self.tracker.forget(seq.slot)
                self._seqs.pop(seq.slot, None)

    def observe(self, layer: int, seqs: list[SeqInfo], selected: torch.Tensor | None, window: int | None) -> None:
        """After the policy chose the pages of `layer` (None: all) for a decode batch: record the watched sequences
        at their first decode step."""
        if not self._seqs:
            return
        kv, page = self.kv, self.kv.page_size
        for b, info in enumerate(seqs):
            seq = self._seqs.get(info.slot)
            if seq is None or info.decode_step != 1 or seq.request.request_id != info.request_id:
                continue
            slot = info.slot
            held, read = self._layers.setdefault(slot, ([], []))
            if len(held) != layer:             # a layer missed (never expected): no partial record
                continue
            counts = kv.num_tokens[slot, layer].tolist()
            stored = ((kv.block_table[slot, layer] != 0) | (kv.host_table[slot, layer] != 0)).cpu()
            heads_held, heads_read = [], []
            for h, count in enumerate(counts):
                pos = self.tracker.positions_of(slot, layer, h, count)
                index = torch.arange(count)
                heads_held.append(pos[stored[h, index // page]])
                if selected is None:
                    visible = torch.ones(count, dtype=torch.bool)
                else:
                    group = selected.shape[1] // len(counts)
                    pages = selected[b, h * group:(h + 1) * group].reshape(-1).cpu()
                    chosen = torch.zeros(-(-count // page), dtype=torch.bool)
                    chosen[pages[pages >= 0]] = True
                    visible = chosen[index // page]
                if window is not None:
                    visible &= index >= count - window
                heads_read.append(pos[visible & stored[h, index // page]])
            held.append([p.sort().values for p in heads_held])
            read.append([p.sort().values for p in heads_read])
            if layer == kv.num_layers - 1:
                self.records[id(seq)] = PositionRecord(held=held, read=read, seq_len=info.seq_len)
                self.tracker.forget(slot)
                self._seqs.pop(slot, None)
                self._layers.pop(slot, None)

    def take(self, seq: Sequence) -> PositionRecord | None:
        """The finished sequence's record (None when it never decoded), handed over once."""
        return self.records.pop(id(seq), None)
