"""Tiered paged KV storage: device and host pools of head-pages, per-(seq, layer, KV head) tables, the MinMax cache.

Implements systems.policies.base.KVView. Blocks may be mapped by several slots (kv_sharing.py: forks, copy on
write); tier copies live in kv_tiers.py; sliding-window layers return the pages their window left (kv_window.py).
On CUDA the host pool is pinned and tier copies run on a low-priority stream; on CPU both pools are RAM but separate
tensors, and every tier copy is a real copy. No CUDA API is touched unless the device is CUDA.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from systems.engine.block_pool import BlockPool
from systems.engine.kv_tiers import TierCopies
from systems.engine.kv_window import WindowRelease
from systems.engine.ops import load_ops
from systems.policies.base import block_bytes

if TYPE_CHECKING:
    from systems.engine.probe import PositionTracker

GIB = 1 << 30
ZEROED_POOL_BYTES = 256 << 20


def _pool(n: int, shape: tuple, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    nbytes = n * shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda" or pin or nbytes <= ZEROED_POOL_BYTES:
        return torch.zeros((n, *shape), dtype=dtype, device=device, pin_memory=pin)
    return torch.empty((n, *shape), dtype=dtype, device=device)


class TieredKVCache(TierCopies, WindowRelease):
    def __init__(self, *, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_seqs: int, max_model_len: int, device_memory_gb: float, host_memory_gb: float,
                 dtype: torch.dtype, device: torch.device, ops: Any = None, scale: float | None = None,
                 layer_windows: tuple[int | None, ...] | None = None) -> None:
        """`scale`: the model's softmax scale of q.k (None: head_dim ** -0.5; Gemma 3 sets query_pre_attn_scalar).
        `layer_windows`: each layer's sliding window (None: full attention), see set_released_windows."""
        self.num_layers, self.num_q_heads, self.num_kv_heads = num_layers, num_q_heads, num_kv_heads
        self.head_dim, self.page_size, self.dtype, self.device = head_dim, page_size, dtype, torch.device(device)
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.model_name: str | None = None   # the engine sets it: what a policy keys its profile by
        self.max_pages = -(-max_model_len // page_size)
        self.ops = ops or load_ops(self.device)
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = block_bytes(page_size, head_dim, elem)   # K and V of one page of one KV head
        cuda = self.device.type == "cuda"
        n_dev = int(device_memory_gb * GIB) // self.bytes_per_block + 1
        n_host = int(host_memory_gb * GIB) // self.bytes_per_block + 1
        self.device_blocks = BlockPool(n_dev, self.bytes_per_block, "device")
        self.host_blocks = BlockPool(n_host, self.bytes_per_block, "host")
        shape = (page_size, head_dim)
        # Pools must read as finite values (masked slots are multiplied by probability 0): small pools and CUDA
        # pools are zeroed; a large CPU pool comes from fresh mmap pages, which the OS zero-fills lazily, so an
        # 8 GiB host tier costs no resident memory until it is written.
        self.k_pool, self.v_pool = (_pool(n_dev, shape, dtype, self.device, False) for _ in range(2))
        self.host_k_pool, self.host_v_pool = (_pool(n_host, shape, dtype, torch.device("cpu"), cuda)
                                              for _ in range(2))
        tab = (max_seqs, num_layers, num_kv_heads, self.max_pages)
        self.block_table = torch.zeros(tab, dtype=torch.int32, device=self.device)
        self.host_table = torch.zeros(tab, dtype=torch.int32, device=self.device)
        self.num_tokens = torch.zeros(tab[:3], dtype=torch.int32, device=self.device)
        self.layer_windows = tuple(layer_windows) if layer_windows is not None else (None,) * num_layers
        self.window_floor = torch.zeros(tab[:3], dtype=torch.int32, device=self.device)
        self.set_released_windows({})
        self.kmin = torch.empty((*tab, head_dim), dtype=dtype, device=self.device)
        self.kmax = torch.empty((*tab, head_dim), dtype=dtype, device=self.device)
        self.minmax_bytes_per_page = 2 * head_dim * elem
        self.bytes_host_to_device = 0
        self.bytes_device_to_host = 0
        self.minmax_bytes_read = 0      # MinMax bounds the page scorers read (selection metadata, decode_roofline)
        self._paused: set[int] = set()
        self._inflight: dict[int, torch.cuda.Event] = {}         # slot -> CUDA event of its last promotion
        # tier copies overlap decoding on a stream at the lowest priority (CUDA's 0; negative is higher)
        self._copy_stream = torch.cuda.Stream(priority=0) if cuda else None
        self._heads = torch.arange(num_kv_heads, device=self.device)
        # original positions of probed requests' tokens, told of every prefill store, keep and drop (engine/probe.py)
        self.positions: PositionTracker | None = None

    # ---- tier capacity -------------------------------------------------------------------------------------------
    def free_device_blocks(self) -> int:
        return self.device_blocks.num_free

    def free_host_blocks(self) -> int:
        return self.host_blocks.num_free

    def _alloc_device(self, n: int) -> torch.Tensor:
        return self.device_blocks.alloc(n).to(self.device)

    # ---- prefill and decode writes (engine side) -----------------------------------------------------------------
    def store_prefill(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Store prompt K/V [n, Hkv, D] of positions start .. start+n-1 for one layer, in position order: the whole
        prompt (start 0, fresh pages) or one chunk of it after the `start` tokens already stored (chunked prefill:
        the chunk fills the last page first, then fresh pages)."""
        n = k.shape[0]
        end = self.reserve_prompt_pages(slot, layer, start, n)
        # the chunk's K/V into its pages and the MinMax bounds of every page it touched, in one op
        self.ops.store_prompt(self.k_pool, self.v_pool, self.kmin[slot, layer], self.kmax[slot, layer],
                              self.block_table[slot, layer, :, :end], k.to(self.dtype), v.to(self.dtype), start)
        self.num_tokens[slot, layer] = start + n
        if self.positions is not None:
            self.positions.stored(slot, layer, start, n)

    def reserve_prompt_pages(self, slot: int, layer: int, start: int, n: int) -> int:
        """Device pages for prompt positions start .. start+n-1 of one layer, before they are stored: the partial
        last page made the slot's own (a shared prefix page is copied first), fresh blocks for the rest. Returns
        the page count through the chunk's end."""
        P, H = self.page_size, self.num_kv_heads
        first, end = start // P, -(-(start + n) // P)
        have = -(-start // P)                                           # pages already holding the earlier tokens
        if start % P:
            heads = torch.arange(H, device=self.device)
            self.own_device_pages(torch.full_like(heads, slot), torch.full_like(heads, layer), heads,
                                  torch.full_like(heads, first))
        if end > have:
            self.block_table[slot, layer, :, have:end] = self._alloc_device(H * (end - have)).view(H, end - have)
        return end

    def prompt_kv(self, slot: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n stored tokens' K and V [n, Hkv, D] of one layer (a prompt mid-prefill: all resident, in
        position order)."""
        ids = self.block_table[slot, layer, :, :-(-n // self.page_size)].reshape(-1).long()
        shape = (self.num_kv_heads, -1, self.head_dim)
        k = self.k_pool.index_select(0, ids).view(shape)[:, :n]
        v = self.v_pool.index_select(0, ids).view(shape)[:, :n]
        return k.transpose(0, 1), v.transpose(0, 1)

    def append_tokens(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n tokens' K/V [n, Hkv, D] to one layer after each head's stored tokens (a question's extension of
        a compressed cache, whose heads may hold different counts): the head's partial last page first (it must be
        resident), then fresh pages; MinMax kept exact."""
        n, H, D = k.shape
        P = self.page_size
        cnt = self.num_tokens[slot, layer].long()                        # [H]
        end = cnt + n
        heads = torch.arange(H, device=self.device)
        partial = heads[cnt % P != 0]
        if partial.numel():
            last = cnt[partial] // P
            if bool((self.block_table[slot, layer, partial, last] == 0).any()):
                raise ValueError("append_tokens: a head's partial last page is not resident")
            self.own_device_pages(torch.full_like(partial, slot), torch.full_like(partial, layer), partial, last)
        hh, pp = _page_runs(heads, -(-cnt // P), -(-end // P))           # pages that get a block now
        if hh.numel():
            self.block_table[slot, layer, hh, pp] = self._alloc_device(hh.numel())
        tok = cnt.view(H, 1) + torch.arange(n, device=self.device).view(1, n)          # [H, n] storage index
        blk = self.block_table[slot, layer].gather(-1, tok // P).long()
        self.ops.store_kv(self.k_pool, self.v_pool, k.transpose(0, 1).reshape(H * n, D),
                          v.transpose(0, 1).reshape(H * n, D), blk.reshape(-1), (tok % P).reshape(-1))
        self.num_tokens[slot, layer] = end.to(self.num_tokens.dtype)
        hh, pp = _page_runs(heads, cnt // P, (end - 1) // P + 1)         # every page that received a token
        fill = (end[hh] - pp * P).clamp(max=P)
        lo, hi = self.ops.page_minmax(self.k_pool, self.block_table[slot, layer, hh, pp], fill)
        self.kmin[slot, layer, hh, pp] = lo
        self.kmax[slot, layer, hh, pp] = hi

    def decode_blocks_needed(self, slots: torch.Tensor) -> torch.Tensor:
        """[B, L, Hkv] bool: heads whose next token opens a page that has no device block yet, or lands in a page
        shared with another slot (it gets a private copy first)."""
        cnt = self.num_tokens[slots].long()
        page = (cnt // self.page_size).clamp(max=self.max_pages - 1)
        blk = self.block_table[slots].gather(-1, page.unsqueeze(-1)).squeeze(-1)
        need = (cnt % self.page_size == 0) & (blk == 0)
        if self.device_blocks.num_shared:
            need |= (blk != 0) & self.device_blocks.shared(blk).to(blk.device)
        return need

    def allocate_decode(self, slots: torch.Tensor, need: torch.Tensor) -> None:
        """Give every head flagged in `need` (from decode_blocks_needed) a block for its next page (a private copy
        of it when it is shared)."""
        b, layer, head = need.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        s = slots[b]
        page = self.num_tokens[s, layer, head].long() // self.page_size
        opens = self.block_table[s, layer, head, page] == 0
        self.own_device_pages(s[~opens], layer[~opens], head[~opens], page[~opens])
        if bool(opens.any()):
            self.block_table[s[opens], layer[opens], head[opens], page[opens]] = self._alloc_device(
                int(opens.sum()))

    def append_decode(self, slots: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token's K/V [B, Hkv, D] per sequence to each head's last page, keeping MinMax exact."""
        self.ops.append_decode(self.k_pool, self.v_pool, self.block_table, self.num_tokens, self.kmin, self.kmax,
                               slots, layer, k.to(self.dtype), v.to(self.dtype))

    def decode_tables(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block table [B, Hkv, M'] (M' = most pages any listed head holds) and token counts [B, Hkv]."""
        counts = self.num_tokens[slots, layer]
        pages = -(-int(counts.max()) // self.page_size)
        return self.block_table[slots, layer, :, :pages], counts

    def free_seq(self, slot: int) -> None:
        """Return every block of the slot to its tier and clear its tables."""
        self.wait_slot(slot)
        for table, pool in ((self.block_table, self.device_blocks), (self.host_table, self.host_blocks)):
            row = table[slot]
            pool.free(row[row != 0])
            row.zero_()
        self.num_tokens[slot].zero_()
        self.window_floor[slot].zero_()
        self._paused.discard(slot)

    def fork_slot(self, src: int, dst: int) -> None:
        super().fork_slot(src, dst)
        self.window_floor[dst] = self.window_floor[src]       # the pages src released are released for dst too

    def refresh_minmax(self, slot: int, layer: int, heads: torch.Tensor | None = None,
                       pages: range | None = None) -> None:
        """Recompute the MinMax entries of every resident page of the given heads (or only the pages in `pages`)
        from the pool."""
        heads = self._heads if heads is None else heads
        P = self.page_size
        cnt = self.num_tokens[slot, layer, heads].long()                # [h]
        n_pages = -(-cnt // P)
        page = (torch.arange(int(n_pages.max()), device=self.device) if pages is None
                else torch.arange(pages.start, pages.stop, device=self.device))
        valid = page.view(1, -1) < n_pages.view(-1, 1)                  # [h, pages]
        pos = torch.arange(heads.numel(), device=self.device).view(-1, 1).expand_as(valid)[valid]
        hh, pp = heads[pos], page.view(1, -1).expand_as(valid)[valid]
        blk = self.block_table[slot, layer, hh, pp]
        keep = blk != 0
        hh, pp, blk, pos = hh[keep], pp[keep], blk[keep], pos[keep]
        fill = (cnt[pos] - pp * P).clamp(max=P)
        lo, hi = self.ops.page_minmax(self.k_pool, blk, fill)
        self.kmin[slot, layer, hh, pp] = lo
        self.kmax[slot, layer, hh, pp] = hi

    # ---- KVView: reading -----------------------------------------------------------------------------------------
    def gather_tokens(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table, counts = self.decode_tables(slots, layer)
        B, H, Mp = table.shape
        ids = table.reshape(-1).long()
        k = self.k_pool.index_select(0, ids).view(B, H, Mp * self.page_size, self.head_dim)
        v = self.v_pool.index_select(0, ids).view(B, H, Mp * self.page_size, self.head_dim)
        n = int(counts.max())
        k, v = k[:, :, :n], v[:, :, :n]
        pad = (torch.arange(n, device=self.device).view(1, 1, n) >= counts.view(B, H, 1)).unsqueeze(-1)
        return k.masked_fill(pad, 0), v.masked_fill(pad, 0), counts.long()

    def attention_probs(self, slots: torch.Tensor, layer: int | torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        counts = self.num_tokens[slots, layer]                          # [R, Hkv]
        width = int(counts.max()) if counts.numel() else 0
        tables = self.block_table[slots, layer, :, :max(1, -(-width // self.page_size))]
        return self.ops.token_probs(q, self.k_pool, tables, counts, self.scale, width)

    def pooled_victims(self, probs: torch.Tensor, counts: torch.Tensor, key: torch.Tensor, window: int, kernel: int,
                       pooling: str, new_keys: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.ops.pooled_victims(probs, counts, key, window, kernel, pooling, new_keys)

    def _minmax_read(self, slots: torch.Tensor, layer: int, heads: torch.Tensor | None, width: int | None
                     ) -> tuple[torch.Tensor, int]:
        """Pages each listed head holds [B, h] and the scored width, with the MinMax bytes that read counted."""
        counts = self.num_tokens[slots, layer] if heads is None else self.num_tokens[slots, layer][:, heads]
        n_pages = -(-counts.long() // self.page_size)
        width = int(n_pages.max()) if width is None else width
        self.minmax_bytes_read += slots.numel() * n_pages.shape[-1] * width * self.minmax_bytes_per_page
        return n_pages, width

    def score_pages(self, slots: torch.Tensor, layer: int, q: torch.Tensor, heads: torch.Tensor | None = None,
                    width: int | None = None) -> torch.Tensor:
        n_pages, width = self._minmax_read(slots, layer, heads, width)
        # one layer's MinMax cache as a view: the kernels read the rows and heads in place
        return self.ops.page_scores(q, self.kmin[:, layer, :, :width], self.kmax[:, layer, :, :width], n_pages,
                                    slots, heads)

    def ranked_pages(self, slots: torch.Tensor, layer: int, q: torch.Tensor, k: list[int],
                     heads: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        n_pages, width = self._minmax_read(slots, layer, heads, width)
        return self.ops.ranked_pages(q, self.kmin[:, layer, :, :width], self.kmax[:, layer, :, :width], n_pages,
                                     slots, heads, torch.tensor(k, device=self.device))

    def top_pages(self, slots: torch.Tensor, layer: int, q: torch.Tensor, k: int, keep_last: bool = True,
                  heads: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        if width is None:         # the longest listed head (a device sync; callers that know the lengths pass it)
            counts = self.num_tokens[slots, layer] if heads is None else self.num_tokens[slots, layer][:, heads]
            width = -(-int(counts.max()) // self.page_size)
        listed = self.num_kv_heads if heads is None else heads.numel()
        self.minmax_bytes_read += slots.numel() * listed * width * self.minmax_bytes_per_page
        # the op reads the token counts through slots and heads itself: no gather or page arithmetic out here
        return self.ops.top_pages(q, self.kmin[:, layer, :, :width], self.kmax[:, layer, :, :width],
                                  self.num_tokens[:, layer], self.page_size, k, keep_last, slots,
                                  self._heads if heads is None else heads)

    def resident_pages(self, slots: torch.Tensor, layer: int, heads: torch.Tensor | None = None,
                       appending: int = 0) -> torch.Tensor:
        table = self.block_table[slots, layer] if heads is None else self.block_table[slots, layer][:, heads]
        counts = self.num_tokens[slots, layer] if heads is None else self.num_tokens[slots, layer][:, heads]
        return self.ops.resident_pages(table, -(-(counts.long() + appending) // self.page_size))

    # ---- KVView: eviction ----------------------------------------------------------------------------------------
    def keep_tokens(self, slot: int, layer: int, keep: list[torch.Tensor]) -> None:
        P = self.page_size
        for h, idx in enumerate(keep):
            idx = idx.to(self.device).long()
            n_keep, n_old = idx.numel(), int(self.num_tokens[slot, layer, h])
            if n_keep < 1 or (n_keep > 1 and bool((idx[1:] <= idx[:-1]).any())) or int(idx[-1]) >= n_old:
                raise ValueError(f"keep_tokens: head {h} needs ascending unique indices < {n_old}, at least one")
            old_pages, new_pages = -(-n_old // P), -(-n_keep // P)
            ids = self.block_table[slot, layer, h, :old_pages].long()
            if bool((ids == 0).any()):
                raise ValueError("keep_tokens: the head has non-resident pages; promote or drop them first")
            k_kept, v_kept = (pool.index_select(0, ids).view(-1, self.head_dim)[idx]     # copies, not views
                              for pool in (self.k_pool, self.v_pool))
            if self.device_blocks.num_shared:          # the compaction rewrites the leading pages: own them first
                lead = torch.arange(new_pages, device=self.device)
                self.own_device_pages(torch.full_like(lead, slot), torch.full_like(lead, layer),
                                      torch.full_like(lead, h), lead, copy=False)
                ids = self.block_table[slot, layer, h, :old_pages].long()
            if self.positions is not None:
                self.positions.kept(slot, layer, h, idx, n_old)
            pos = torch.arange(n_keep, device=self.device)
            self.ops.store_kv(self.k_pool, self.v_pool, k_kept, v_kept, ids[pos // P], pos % P)
            self.device_blocks.free(ids[new_pages:])
            self.block_table[slot, layer, h, new_pages:old_pages] = 0
            host = self.host_table[slot, layer, h]
            self.host_blocks.free(host[host != 0])                     # host copies no longer match the pages
            host.zero_()
            self.num_tokens[slot, layer, h] = n_keep
        self.refresh_minmax(slot, layer)

    def drop_tokens(self, slots: torch.Tensor, layer: int | torch.Tensor, heads: torch.Tensor,
                    index: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if isinstance(layer, torch.Tensor) and (self.device_blocks.num_shared or self.positions is not None):
            # copy on write allocates blocks and the tracker records per layer: one call per layer keeps their order
            for each, part in zip(*_layer_runs(layer)):
                self.drop_tokens(slots[part], each, heads[part], index[part])
            return
        P, M, D = self.page_size, self.max_pages, self.head_dim
        s, h, idx = slots.long(), heads.long(), index.long()
        # one flat row per (slot, layer, head): every read and write below is a single-index op, because this runs
        # once per layer of every decode step of an evicting policy and its cost is the number of tensor ops
        rows = (s * self.num_layers + layer) * self.num_kv_heads + h
        last = self.num_tokens.view(-1).index_select(0, rows).long() - 1
        if bool(((idx > last) | (last < 1)).any()):
            raise ValueError("drop_tokens: index beyond the head's tokens, or the head would become empty")
        hole_page, last_page = idx // P, last // P
        if self.device_blocks.num_shared or self.positions is not None:
            assert not isinstance(layer, torch.Tensor)                       # a layer per entry went per layer
            if self.device_blocks.num_shared:                                # copy on write only when shared
                self.own_device_pages(s, torch.full_like(s, layer), h, hole_page)   # the hole's page is written
            if self.positions is not None:
                self.positions.dropped(s, layer, h, idx, last)
        table = self.block_table.view(-1, M)
        blk_last = table[rows, last_page].long()
        blk_hole = table[rows, hole_page].long()
        k_flat, v_flat = self.k_pool.view(-1, D), self.v_pool.view(-1, D)
        src, dst = blk_last * P + last % P, blk_hole * P + idx % P
        k_flat[dst] = k_flat[src]
        v_flat[dst] = v_flat[src]
        self.num_tokens.view(-1)[rows] = last.to(self.num_tokens.dtype)
        emptied = last % P == 0
        if bool(emptied.any()):          # once per page of drops: the last page's block is freed
            if isinstance(layer, torch.Tensor):
                # as one free per layer, in layer order: the free list then stacks exactly as per-layer calls left it
                self.device_blocks.free_runs(blk_last[emptied], layer[emptied])
            else:
                self.device_blocks.free(blk_last[emptied])
            table[rows[emptied], last_page[emptied]] = 0
            pages, rr, cnt = torch.cat([hole_page, last_page[~emptied]]), torch.cat([rows, rows[~emptied]]), \
                torch.cat([last, last[~emptied]])
            keep = table[rr, pages] != 0
            rr, pages, cnt = rr[keep], pages[keep], cnt[keep]
        else:                            # both pages stay resident (the view's contract)
            pages, rr, cnt = torch.cat([hole_page, last_page]), torch.cat([rows, rows]), torch.cat([last, last])
        # the hole's page changed content and the last page lost a token: recompute both bounds
        fill = (cnt - pages * P).clamp(max=P)
        lo, hi = self.ops.page_minmax(self.k_pool, table[rr, pages], fill)
        bound_rows = rr * M + pages
        self.kmin.view(-1, D)[bound_rows] = lo
        self.kmax.view(-1, D)[bound_rows] = hi


def _layer_runs(layers: torch.Tensor) -> tuple[list[int], list[slice]]:
    """The layers of entries sorted by layer (ascending) and the slice of entries each one owns."""
    if bool((layers[1:] < layers[:-1]).any()):
        raise ValueError("drop_tokens: entries with a layer each must be sorted by layer")
    each, counts = torch.unique_consecutive(layers, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return each.tolist(), [slice(end - c, end) for end, c in zip(ends, counts.tolist())]


def _page_runs(heads: torch.Tensor, start: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, page) for every page start[h] <= page < stop[h] of each head, flattened head by head."""
    length = (stop - start).clamp(min=0)
    total = int(length.sum())
    hh = heads.repeat_interleave(length)
    offset = torch.arange(total, device=heads.device) - (length.cumsum(0) - length).repeat_interleave(length)
    return hh, start.repeat_interleave(length) + offset
