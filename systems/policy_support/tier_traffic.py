"""Page moves between the device and host tiers for offloading policies, and the per-request ledger that counts them."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from systems.policies.view import KVView, SeqInfo
from systems.policy_support import selection


def move_pages(fn: Callable[..., None], slot: int, layer: int, heads: torch.Tensor, pages: torch.Tensor) -> None:
    """Call a KV view's tier op (offload_pages, release_device_pages, ...) on (head, page) pairs of one slot and
    layer: the ops take one (slot, layer, head, page) per moved page."""
    n = heads.numel()
    fn(torch.full((n,), slot, dtype=torch.long, device=heads.device),
       torch.full((n,), layer, dtype=torch.long, device=heads.device), heads, pages)


def swap_pages(kv: KVView, slots: torch.Tensor, layer: int, heads: torch.Tensor, resident: torch.Tensor,
               chosen: torch.Tensor) -> tuple[list[int], list[int]]:
    """Make each (slot, head) hold exactly its `chosen` pages: the pages new in it are promoted from the host into
    the blocks of the pages that left it (block recycling), the leftover leavers freed (their host copy stays).
    slots [R]; heads [S]; resident, chosen: membership masks [R, S, M]. Returns the pages promoted and released
    per row."""
    R, S, M = resident.shape
    incoming, evicted = selection.swap_map(resident.reshape(R * S, M), chosen.reshape(R * S, M))
    pair_row, page, recycle, left_row, left_page = selection.pair_for_recycling(incoming, evicted)
    slot_of = slots.repeat_interleave(S)
    head_of = heads.repeat(R)
    kv.promote_pages(slot_of[pair_row], torch.full_like(pair_row, layer), head_of[pair_row], page, recycle=recycle)
    kv.release_device_pages(slot_of[left_row], torch.full_like(left_row, layer), head_of[left_row], left_page)
    return (torch.bincount(pair_row // S, minlength=R).tolist(), torch.bincount(left_row // S, minlength=R).tolist())


class TrafficLedger:
    """Per request: pages offloaded, promoted and released, reranks, and the wall time spent moving pages."""

    def __init__(self) -> None:
        self._stats: dict[int, dict[str, Any]] = {}

    def reset(self, slot: int) -> None:
        self._stats[slot] = {"promoted_pages": 0, "released_pages": 0, "offloaded_pages": 0, "reranks": 0,
                             "head_reranks": 0, "topk_pages_reranked": 0, "copy_time_s": 0.0,
                             "promoted_per_step": [], "_step": -1}

    def fork(self, src: int, dst: int) -> None:
        """A reader starts with the source's counters (what its cache went through so far)."""
        if src not in self._stats:
            self.reset(dst)
            return
        self._stats[dst] = {key: list(v) if isinstance(v, list) else v for key, v in self._stats[src].items()}

    def add(self, slot: int, key: str, amount: float) -> None:
        self._stats[slot][key] += amount

    def add_copy_time(self, seqs: list[SeqInfo], seconds: float) -> None:
        """Time spent on a batch's moves, split evenly over its requests."""
        for seq in seqs:
            self._stats[seq.slot]["copy_time_s"] += seconds / len(seqs)

    def reranked(self, seq: SeqInfo, heads: int, promoted: int, released: int, topk_pages: int) -> None:
        """One rerank of `heads` heads of a request at its current decode step (a step's layers count once)."""
        st = self._stats[seq.slot]
        if st["_step"] != seq.decode_step:
            st["_step"] = seq.decode_step
            st["promoted_per_step"].append(0)
            st["reranks"] += 1
        st["promoted_per_step"][-1] += promoted
        st["promoted_pages"] += promoted
        st["released_pages"] += released
        st["head_reranks"] += heads
        st["topk_pages_reranked"] += topk_pages

    def summary(self, slot: int) -> dict[str, Any]:
        return {k: v for k, v in self._stats.get(slot, {}).items() if not k.startswith("_")}
