"""Shared pages in the tiered KV cache: forking a sequence's tables onto another slot, and copy on write.

A fork maps the source's device and host blocks into the target's tables (one more reference each, see BlockPool),
copies its token counts and MinMax rows, and gives the target a private copy of every head's partial last page at
once. vLLM shares only full blocks for the same reason: the first token either side appends lands in that page.
Copying it eagerly (at most one page per layer and KV head) keeps every append — decode, the fused C++ step, a
question's extension — free of sharing checks. Any other write into a page that is still shared (a decode-time
eviction moving a token into a hole, a compaction, a promotion into a recycled block, a fresh host copy) first takes
a private block through `own_device_pages` / `own_host_pages`; releasing a shared page drops one reference.
"""
from __future__ import annotations

import torch

from systems.engine.block_pool import BlockPool


class PageSharing:
    """Base of TieredKVCache (through kv_tiers.TierCopies): its tables, pools and MinMax cache are declared here for
    the type checker."""

    page_size: int
    device: torch.device
    block_table: torch.Tensor
    host_table: torch.Tensor
    num_tokens: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    host_k_pool: torch.Tensor
    host_v_pool: torch.Tensor
    device_blocks: BlockPool
    host_blocks: BlockPool

    def wait_slot(self, slot: int) -> None:
        raise NotImplementedError       # kv_tiers.TierCopies's

    def _partial_pages(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(layer, head, page) of every resident partial last page of the slot."""
        cnt = self.num_tokens[slot].long()                                  # [L, H]
        layer, head = (cnt % self.page_size != 0).nonzero(as_tuple=True)
        page = cnt[layer, head] // self.page_size
        resident = self.block_table[slot, layer, head, page] != 0
        return layer[resident], head[resident], page[resident]

    def fork_blocks_needed(self, slot: int) -> int:
        """Device blocks a fork of this slot takes: one per resident partial last page (its private copy)."""
        return int(self._partial_pages(slot)[0].numel())

    def fork_slot(self, src: int, dst: int) -> None:
        """Slot dst (empty) starts as a reader of src's cache: same blocks in both tiers (shared, counted once),
        same token counts and MinMax rows, its own copy of each partial last page."""
        if bool((self.block_table[dst] != 0).any()) or bool((self.host_table[dst] != 0).any()):
            raise RuntimeError(f"fork_slot: target slot {dst} still maps blocks")
        self.wait_slot(src)
        for table, pool in ((self.block_table, self.device_blocks), (self.host_table, self.host_blocks)):
            row = table[src]
            pool.share(row[row != 0])
            table[dst] = row
        self.num_tokens[dst] = self.num_tokens[src]
        width = -(-int(self.num_tokens[src].max()) // self.page_size)
        self.kmin[dst, :, :, :width] = self.kmin[src, :, :, :width]
        self.kmax[dst, :, :, :width] = self.kmax[src, :, :, :width]
        layer, head, page = self._partial_pages(dst)
        self.own_device_pages(torch.full_like(layer, dst), layer, head, page)

    def shared_device_pages(self, slot: int) -> int:
        """How many of the slot's device pages other slots map too."""
        row = self.block_table[slot]
        ids = row[row != 0]
        return int(self.device_blocks.shared(ids).sum()) if self.device_blocks.num_shared else 0

    def own_device_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor,
                         copy: bool = True) -> None:
        """Copy on write: each listed (unique, resident) page whose block is shared gets a block of its own (with
        the content when `copy`; a caller about to overwrite the whole page passes False)."""
        self._own(self.block_table, self.device_blocks, self.k_pool, self.v_pool, slots, layers, heads, pages, copy)

    def own_host_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor,
                       copy: bool = True) -> None:
        """own_device_pages for host copies."""
        self._own(self.host_table, self.host_blocks, self.host_k_pool, self.host_v_pool, slots, layers, heads,
                  pages, copy)

    def _own(self, table: torch.Tensor, pool: BlockPool, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor, copy: bool) -> None:
        if pool.num_shared == 0 or slots.numel() == 0:
            return
        s, lay, h, p = (t.to(self.device).long() for t in (slots, layers, heads, pages))
        blk = table[s, lay, h, p].long()
        mine = (blk != 0) & pool.shared(blk).to(blk.device)
        if not bool(mine.any()):
            return
        s, lay, h, p, old = s[mine], lay[mine], h[mine], p[mine], blk[mine]
        new = pool.alloc(int(old.numel())).to(k_pool.device).long()
        if copy:
            src = old.to(k_pool.device)
            k_pool.index_copy_(0, new, k_pool.index_select(0, src))
            v_pool.index_copy_(0, new, v_pool.index_select(0, src))
        pool.free(old)
        table[s, lay, h, p] = new.to(device=table.device, dtype=table.dtype)
