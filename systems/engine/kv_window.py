"""Sliding-window layers keep only the pages their window can still read: the rest go back to the device pool.

A base of TieredKVCache (kv_cache.py), beside its sharing base. vLLM's hybrid allocator does the same
(SlidingWindowManager.remove_skipped_blocks): once a sequence holds c tokens of a layer whose window is W, its next
query (position c) sees keys c - W + 1 .. c, so every page wholly before token c - W + 1 can never be read again and
its block is returned — the table entry becomes the null block, so logical pages keep their positions and the
attention ops, which mask everything before the window, read nothing else. A layer holds at most
ceil((W - 1) / P) + 1 pages between steps. Released pages drop one reference (a shared context's page stays while
another reader maps it) and lose their host copies too.

Only layers the policy leaves to the window are released (the engine sets `released_windows`): a policy that manages
a windowed layer evicts there itself, and its storage rows stop meaning positions.
"""
from __future__ import annotations

import torch

from systems.engine.kv_sharing import PageSharing


class WindowRelease(PageSharing):
    """`released_windows` {layer: W}: the layers whose pages before the window are freed; `window_floor` [S, L, Hkv]
    int32: pages below it are already released (so a step looks only at pages the window left since)."""

    num_layers: int
    num_kv_heads: int
    released_windows: dict[int, int]
    window_floor: torch.Tensor
    _window_layers: torch.Tensor
    _window_sizes: torch.Tensor

    def set_released_windows(self, windows: dict[int, int]) -> None:
        """The windowed layers whose pages before the window are returned (only between requests: pages already
        released stay so)."""
        self.released_windows = dict(sorted(windows.items()))
        self._window_layers = torch.tensor(list(self.released_windows), dtype=torch.long, device=self.device)
        self._window_sizes = torch.tensor(list(self.released_windows.values()), dtype=torch.long, device=self.device)

    def window_pages_bound(self, layer: int, tokens: int) -> int:
        """Pages one KV head of `layer` holds after a step that leaves it `tokens` tokens (a released window keeps
        the pages of its last W - 1 tokens at most)."""
        pages = -(-tokens // self.page_size)
        window = self.released_windows.get(layer)
        if window is None:
            return pages
        return pages - max(tokens - window + 1, 0) // self.page_size

    def prompt_blocks(self, tokens: int, chunk: int | None = None) -> int:
        """Device blocks (every layer and KV head) of a prompt stored uncompressed up to `tokens`: between steps
        (chunk None), or at most at any moment while it is stored in chunks of up to `chunk` tokens (a layer left to
        its window then holds its window's pages plus one chunk, until that layer's attention is done)."""
        pages = -(-tokens // self.page_size)
        total = 0
        for layer in range(self.num_layers):
            window = self.released_windows.get(layer)
            if window is None:
                total += pages
            elif chunk is None:
                total += self.window_pages_bound(layer, tokens)
            else:
                total += min(pages, -(-(window - 1) // self.page_size) + 1 + -(-chunk // self.page_size))
        return total * self.num_kv_heads

    def release_out_of_window(self, slots: torch.Tensor, layer: int | None = None) -> int:
        """Free every page of the given slots (1-D) that the released windows can no longer read, on one layer or
        on all released layers; returns how many table entries were cleared."""
        if not self.released_windows or slots.numel() == 0:
            return 0
        if layer is None:
            layers, sizes = self._window_layers, self._window_sizes
        elif layer in self.released_windows:
            layers = torch.tensor([layer], dtype=torch.long, device=self.device)
            sizes = torch.tensor([self.released_windows[layer]], dtype=torch.long, device=self.device)
        else:
            return 0
        s = slots.to(self.device).long()
        cnt = self.num_tokens[s][:, layers].long()                                   # [B, Lw, H]
        first = (cnt - sizes.view(1, -1, 1) + 1).clamp(min=0) // self.page_size      # pages below are unreadable
        floor = self.window_floor[s][:, layers].long()
        b, lw, h = (first > floor).nonzero(as_tuple=True)
        if b.numel() == 0:
            return 0
        lo, hi = floor[b, lw, h], first[b, lw, h]
        n = hi - lo
        ss, ll, hh = s[b].repeat_interleave(n), layers[lw].repeat_interleave(n), h.repeat_interleave(n)
        offset = torch.arange(int(n.sum()), device=self.device) - (n.cumsum(0) - n).repeat_interleave(n)
        pp = lo.repeat_interleave(n) + offset
        for table, pool in ((self.block_table, self.device_blocks), (self.host_table, self.host_blocks)):
            blk = table[ss, ll, hh, pp]
            pool.free(blk[blk != 0])
            table[ss, ll, hh, pp] = 0
        self.window_floor[s[b], layers[lw], h] = hi.to(self.window_floor.dtype)
        return int(pp.numel())
