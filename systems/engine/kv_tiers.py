"""Tier copies and scheduling signals of the tiered KV cache: offload, release and promotion of pages, pauses.

A base of TieredKVCache (kv_cache.py), over its sharing base (kv_sharing.py). On CUDA the host pool is pinned and
copies run on a low-priority stream whose events pause a sequence until its promotion lands; on CPU every copy is a
synchronous real copy.
"""
from __future__ import annotations

import torch

from systems.engine.kv_sharing import PageSharing


class TierCopies(PageSharing):
    """Its counters are TieredKVCache's, declared here for the type checker (tables and pools: PageSharing)."""

    bytes_per_block: int
    bytes_host_to_device: int
    bytes_device_to_host: int
    _paused: set[int]
    _inflight: dict[int, torch.cuda.Event]
    _copy_stream: torch.cuda.Stream | None

    def _alloc_device(self, n: int) -> torch.Tensor:
        raise NotImplementedError       # TieredKVCache's

    # ---- KVView: tiers ---------------------------------------------------------------------------------------------
    def _copy(self, dst_k: torch.Tensor, dst_v: torch.Tensor, dst_ids: torch.Tensor, src_k: torch.Tensor,
              src_v: torch.Tensor, src_ids: torch.Tensor) -> None:
        if self._copy_stream is None:
            dst_k.index_copy_(0, dst_ids, src_k.index_select(0, src_ids))
            dst_v.index_copy_(0, dst_ids, src_v.index_select(0, src_ids))
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._copy_stream):
            d, s = dst_ids.to(dst_k.device, non_blocking=True), src_ids.to(src_k.device, non_blocking=True)
            dst_k.index_copy_(0, d, src_k.index_select(0, s).to(dst_k.device, non_blocking=True))
            dst_v.index_copy_(0, d, src_v.index_select(0, s).to(dst_v.device, non_blocking=True))

    def offload_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor
                      ) -> None:
        s, lay, h, p = (t.to(self.device).long() for t in (slots, layers, heads, pages))
        if s.numel() == 0:
            return
        dev = self.block_table[s, lay, h, p].long()
        if bool((dev == 0).any()):
            raise ValueError("offload_pages: a listed page is not resident on the device")
        self.own_host_pages(s, lay, h, p, copy=False)                  # the copy below rewrites every listed page
        host = self.host_table[s, lay, h, p].long()
        fresh = host == 0
        host[fresh] = self.host_blocks.alloc(int(fresh.sum())).to(self.device).long()
        self.host_table[s, lay, h, p] = host.to(torch.int32)
        self._copy(self.host_k_pool, self.host_v_pool, host.cpu(), self.k_pool, self.v_pool, dev)
        self.bytes_device_to_host += s.numel() * self.bytes_per_block

    def release_device_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor,
                             pages: torch.Tensor) -> None:
        s, lay, h, p = (t.to(self.device).long() for t in (slots, layers, heads, pages))
        if self._copy_stream is not None:
            torch.cuda.current_stream().wait_stream(self._copy_stream)  # an offload may still read these blocks
        dev = self.block_table[s, lay, h, p]
        self.device_blocks.free(dev[dev != 0])
        self.block_table[s, lay, h, p] = 0

    def promote_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor,
                      recycle: torch.Tensor | None = None) -> None:
        s, lay, h, p = (t.to(self.device).long() for t in (slots, layers, heads, pages))
        if s.numel() == 0:
            return
        host = self.host_table[s, lay, h, p].long()
        if bool((host == 0).any()):
            raise ValueError("promote_pages: a listed page has no host copy")
        if recycle is None:
            dev = self._alloc_device(s.numel()).long()
        else:
            r = recycle.to(self.device).long()
            self.own_device_pages(s, lay, h, r, copy=False)              # a shared block is not ours to overwrite
            dev = self.block_table[s, lay, h, r].long()
            if bool((dev == 0).any()):
                raise ValueError("promote_pages: a recycle page is not resident")
            self.block_table[s, lay, h, r] = 0
        self.block_table[s, lay, h, p] = dev.to(torch.int32)
        self._copy(self.k_pool, self.v_pool, dev, self.host_k_pool, self.host_v_pool, host.cpu())
        self.bytes_host_to_device += s.numel() * self.bytes_per_block
        if self._copy_stream is not None:
            event = torch.cuda.Event()
            event.record(self._copy_stream)
            for slot in s.unique().tolist():
                self._inflight[slot] = event

    # ---- KVView: scheduling ----------------------------------------------------------------------------------------
    def pause(self, slot: int) -> None:
        self._paused.add(slot)

    def take_paused(self) -> set[int]:
        """Slots paused by the policy or with a promotion still in flight; clears the policy's pause requests."""
        paused, self._paused = self._paused, set()
        for slot, event in list(self._inflight.items()):
            if event.query():
                del self._inflight[slot]
            else:
                paused.add(slot)
        return paused

    def wait_slot(self, slot: int) -> None:
        event = self._inflight.pop(slot, None)
        if event is not None:
            event.synchronize()

    def sync_copies(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        self._inflight.clear()
