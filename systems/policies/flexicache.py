"""FlexiCache: stable KV heads keep only their top-K pages on the device (full KV on the host), unstable heads keep all.

Follows NazmulTakbir/FlexiCache-vLLM-extension. A head's top-K is K pages counting the last (partial) one, as the
official scorer ranks: the last page gets a sentinel score, then the K best are taken, so K - 1 are chosen among the
others (every page when the head holds <= K). Unstable heads (a profile's 25 %) keep every page on the device and
read their top-K every step. Stable heads copy every full page to the host once; they read whatever they hold on the
device and rerank at decode step 1 and every R steps: every page is scored from the MinMax cache (offloaded pages
too), and only pages newly in the top-K cross host -> device, each into the block of a page that left the top-K
(block recycling); leftover leavers are freed, their host copy stays.

Where this departs from the official fork, and why:
- The top-K kept after prefill is ranked with the last prompt token's query, so the non-top-K device blocks are
  freed as each layer's prefill ends (the official frees them after the first decode ranking). The device footprint
  is then K pages per stable head from admission on, which is what lets a capped pool admit more requests;
  decode step 1 reranks with the real decode query as in the official code.
- A rerank step's attention reads the pages resident when it starts; the promotion is issued after that layer's
  attention (so recycled blocks are no longer read) and serves the next step. On CUDA the engine pauses the request
  while its copy is in flight; on CPU copies are synchronous and nothing waits.
- `naive: true` reranks every head every step (FlexiCache F8's stability-unaware baseline): stable heads then
  promote every step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from systems.policies.base import DecodeLayers, DecodeStep, KVDims, KVView, PageRule, Policy, SeqInfo, block_bytes
from systems.policy_support import profiles, selection
from systems.policy_support.tier_traffic import TrafficLedger, move_pages, swap_pages


@dataclass
class FlexiCache(Policy):
    budget: int = 1024                # tokens of a stable head's device top-K, K = budget // engine.page_size (64)
    rerank_interval: int = 16         # R (--rerank-frequency 16); unstable heads rerank every step
    profile_model: str | None = None  # the model whose profile it reads; None: the model being run (dims.model_name)
    profile_tasks: list = field(default_factory=lambda: ["needlebench_mrt", "needlebench_srt"])  # preference
    heldout_task: str | None = None   # the evaluated task; leave-one-out skips its own profile (official rule)
    profile: str | None = None        # explicit profile file (overrides profile_model / profile_tasks); it must have
                                      # been made on the model being run
    unstable_heads: list | None = None  # explicit [[layer, head], ...] (overrides any profile)
    naive: bool = False               # rerank every head every step

    name = "flexicache"
    step_queries: ClassVar[bool] = True   # a fused step's reranks (pages_chosen) score with each layer's query
    profile_schema = ("model", "task", "K", "W", "page_size", "num_layers", "num_kv_heads", "unstable_heads",
                      "head_stats")
    profiler = "head_stability"

    @classmethod
    def with_heldout_task(cls, params: dict[str, Any], task: str) -> dict[str, Any]:
        """Leave-one-out (the official GovReport / paper_assistant rule): never the evaluated task's own profile."""
        return {**params, "heldout_task": task} if params.get("heldout_task") is None else dict(params)

    @classmethod
    def budget_granularity(cls, params: dict[str, Any], page_size: int) -> int:
        return page_size                  # top_k = budget // page_size pages

    def __post_init__(self) -> None:
        if self.budget <= 0 or self.rerank_interval < 1:
            raise ValueError(f"flexicache: need budget > 0 and rerank_interval >= 1, got budget={self.budget} "
                             f"rerank_interval={self.rerank_interval}")
        self.profile_tasks = [str(t) for t in self.profile_tasks]
        if self.unstable_heads is not None:
            self.unstable_heads = [[int(x) for x in pair] for pair in self.unstable_heads]
            self._profile_path = None
        elif self.profile or self.profile_model:                      # a missing profile fails before any model load
            self._profile_path = self.profile or self._find(self.profile_model)
        else:                                       # the model being run: looked up in configure, which the harness
            self._profile_path = None               # calls on the model's dims before any weights load

    def _find(self, model: str | None) -> str:
        if model is None:
            raise ValueError("flexicache: the model being run has no name to find its profile by; set "
                             "params.profile_model or params.profile")
        return str(profiles.find_profile("flexicache", model, self.profile_tasks, self.heldout_task,
                                         profiler=self.profiler))

    @classmethod
    def missing_profile(cls, params: dict[str, Any], model: str) -> str | None:
        return cls._profile_lookup_error(params, model, given="unstable_heads")

    @property
    def top_k(self) -> int:
        return self.budget // self.page_size

    # ---- setup ---------------------------------------------------------------------------------------------------
    def configure(self, dims: KVDims) -> None:
        super().configure(dims)
        if self.budget < dims.page_size:
            raise ValueError(f"flexicache: budget={self.budget} is less than one page (engine.page_size="
                             f"{dims.page_size}); raise params.budget")
        heads, self.profile_source = self._unstable_list(dims)
        self.unstable = torch.zeros(dims.num_layers, dims.num_kv_heads, dtype=torch.bool, device=dims.device)
        for layer, head in heads:
            self.unstable[layer, head] = True
        # a profile's heads on layers left to their window do nothing there: the counts below cover managed layers
        left = [layer for layer in range(dims.num_layers) if not self.manages(layer)]
        self.unstable[left] = False
        self._unstable_cpu = self.unstable.cpu()
        self._stable_heads = [(~row).nonzero().view(-1) for row in self.unstable]
        self._unstable_heads = [row.nonzero().view(-1) for row in self.unstable]
        # select_pages stacks [stable heads, unstable heads]; this gathers them back into head order
        self._head_order = [torch.cat([s, u]).argsort() for s, u in zip(self._stable_heads, self._unstable_heads)]
        self._kv_heads = torch.arange(dims.num_kv_heads, device=dims.device)

    def bind(self, kv: KVView) -> None:
        super().bind(kv)
        self._page_index = torch.arange(kv.block_table.shape[-1], device=kv.device)
        self.bytes_per_block = block_bytes(kv.page_size, kv.head_dim, kv.k_pool.element_size())
        self.minmax_bytes_per_page = 2 * kv.head_dim * kv.kmin.element_size()
        self.traffic = TrafficLedger()
        self._pending: dict[int, tuple] = {}
        self._held: dict[int, tuple] = {}         # layer -> (batch key, stable heads' resident pages)
        self._rule_sets: tuple | None = None      # (batch key, held [L, B, Hkv, W], widths) for decode_page_rule

    def _unstable_list(self, kv: KVDims) -> tuple[list[tuple[int, int]], str]:
        if self.unstable_heads is not None:
            return profiles.head_list(self.unstable_heads, kv.num_layers, kv.num_kv_heads, "flexicache"), "params"
        model = getattr(kv, "model_name", None)
        path = self._profile_path or self._find(model)
        prof = profiles.load_model_profile(path, "flexicache", self.profile_schema, model, str(self.profiler),
                                           kv.num_layers, kv.num_kv_heads)
        return profiles.head_list(prof["unstable_heads"], kv.num_layers, kv.num_kv_heads, str(path)), str(path)

    def device_blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        pages = -(-prompt_len // self.page_size)
        n_unstable = self._unstable_cpu.sum(-1)[list(self.managed_layers)]     # [managed layers]
        n_stable = self.num_kv_heads - n_unstable
        kept = min(pages, self.top_k)
        settled = int((n_unstable * pages + n_stable * kept).sum())
        transient = int(n_stable.max()) * (pages - kept) if n_stable.numel() else 0   # one layer before release
        return settled + transient + self.window_prefill_blocks(prompt_len)

    def expected_device_blocks(self, prompt_len: int, output_tokens: int) -> int | None:
        return self._analytic_blocks(prompt_len + output_tokens - 1)

    def _analytic_blocks(self, tokens: int) -> int:
        """Unstable heads hold every page; stable heads their top-K pages, the partial last one among them."""
        pages = -(-tokens // self.page_size)
        n_unstable = int(self._unstable_cpu.sum())
        n_stable = self.num_managed * self.num_kv_heads - n_unstable
        return n_unstable * pages + n_stable * min(pages, self.top_k) + self.window_blocks(tokens)

    def expected_blocks_slack(self) -> int:
        return self.num_managed * self.num_kv_heads     # a reranked page in flight: within one page per head

    @classmethod
    def profile_free_params(cls, num_layers: int, num_kv_heads: int) -> dict[str, Any]:
        """FlexiCache's share of unstable heads (25 %), taken as the first heads of every layer."""
        per_layer = round(0.25 * num_kv_heads)
        return {"unstable_heads": [[layer, h] for layer in range(num_layers) for h in range(per_layer)]}

    def reset(self, slot: int) -> None:
        self._forget()
        self.traffic.reset(slot)

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        stable = self._stable_heads[layer]
        if stable.numel() == 0:
            return
        self._forget(layer)
        slot, P = seq.slot, kv.page_size
        n = int(kv.num_tokens[slot, layer, 0])
        n_pages, full = -(-n // P), n // P
        t0 = time.perf_counter()
        if full:
            hh = stable.repeat_interleave(full)
            pp = torch.arange(full, device=kv.device).repeat(stable.numel())
            move_pages(kv.offload_pages, slot, layer, hh, pp)
            self.traffic.add(slot, "offloaded_pages", hh.numel())
        if n_pages > self.top_k:
            last_q = selection.group_queries(q[-1:], kv.num_kv_heads, stable)
            top = kv.top_pages(torch.tensor([slot], device=kv.device), layer, last_q, self.top_k, keep_last=True,
                               heads=stable, width=n_pages)[0]                                   # [s, K]
            hi, pp = (~selection.as_mask(top, n_pages)).nonzero(as_tuple=True)
            move_pages(kv.release_device_pages, slot, layer, stable[hi], pp)
            self.traffic.add(slot, "released_pages", pp.numel())
        self.traffic.add(slot, "copy_time_s", time.perf_counter() - t0)

    def after_extend_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """A query-agnostic question appended after the compressed context: the stable heads' pages it filled get
        their host copies, as decode fills do (ranking waits for decode step 1, with a decode query)."""
        stable = self._stable_heads[layer]
        P, n = kv.page_size, q.shape[0]
        first, full = (seq.seq_len - n) // P, seq.seq_len // P          # pages filled by these tokens
        if stable.numel() == 0 or full <= first:
            return
        self._forget(layer)
        hh = stable.repeat_interleave(full - first)
        pp = torch.arange(first, full, device=kv.device).repeat(stable.numel())
        fresh = kv.host_table[seq.slot, layer, hh, pp] == 0
        t0 = time.perf_counter()
        move_pages(kv.offload_pages, seq.slot, layer, hh[fresh], pp[fresh])
        self.traffic.add(seq.slot, "offloaded_pages", int(fresh.sum()))
        self.traffic.add(seq.slot, "copy_time_s", time.perf_counter() - t0)

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        """A reader starts with the source's counters (what its cache went through so far)."""
        self._forget()
        self.traffic.fork(src, dst)

    def _reranks(self, seqs: list[SeqInfo]) -> list[int]:
        if self.naive:
            return list(range(len(seqs)))
        return [b for b, s in enumerate(seqs) if s.decode_step == 1 or s.decode_step % self.rerank_interval == 0]

    def decode_page_rule(self, kv: KVView, step: DecodeLayers) -> PageRule:
        """Stable heads read the device pages they hold, unstable heads their top-K scored in the fused step."""
        K, B = self.top_k, len(step.seqs)
        width = _width(kv, step.seqs)
        if width <= K:                                                # nothing was released: every page is read
            return PageRule(layers=(), k=[K] * B, heads=self._kv_heads, width=width, ranked=False)
        key = _batch_key(kv, step.seqs)
        if self._rule_sets is None or self._rule_sets[0] != key:
            self._rule_sets = (key, *self._held_sets(kv, step.slots, step.seqs, K))
        _, held, widths = self._rule_sets
        return PageRule(layers=tuple(self.managed_layers), k=[K] * B, heads=self._kv_heads, width=width,
                        ranked=False, keep_last=True, held=held, held_widths=widths, scored=self.unstable)

    def pages_chosen(self, kv: KVView, step: DecodeLayers, rule: PageRule, chosen: torch.Tensor) -> None:
        """What select_pages' reranks and after_append do at each managed layer, in the per-layer hooks' order: each
        layer's cache and MinMax bounds are still what its hooks would have seen (step.q: its queries)."""
        assert step.q is not None
        width = _width(kv, step.seqs)
        reranks = width > self.top_k and self._reranks(step.seqs)
        if not reranks and all(seq.seq_len % kv.page_size for seq in step.seqs):     # no tier traffic (most steps)
            return
        for layer in self.managed_layers:
            layer_step = DecodeStep(layer=layer, slots=step.slots, seqs=step.seqs, q=step.q[layer])
            self._score_rerank(kv, layer_step, width)
            self.after_append(kv, layer_step)

    def _held_sets(self, kv: KVView, slots: torch.Tensor, seqs: list[SeqInfo],
                   top: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        """[L, B, Hkv, W] and each layer's width: what select_pages answers at each managed layer, with the unstable
        heads' rows PAD where their `top` pages go: the widths select_pages' sets have, so attention reads the same."""
        stable = self._stable_heads
        resident = [self._resident(kv, slots, seqs, layer, stable[layer], appending=1)
                    if stable[layer].numel() and self.manages(layer) else None for layer in range(self.num_layers)]
        widths = tuple(max(r.shape[-1] if r is not None else 0, top if self._unstable_heads[layer].numel() else 0, 1)
                       for layer, r in enumerate(resident))
        held = torch.full((self.num_layers, len(seqs), kv.num_kv_heads, max(widths)), selection.PAD,
                          dtype=torch.long, device=kv.device)
        for layer, r in enumerate(resident):
            if r is not None:
                held[layer][:, stable[layer], :r.shape[-1]] = r
        return held, widths

    def _score_rerank(self, kv: KVView, step: DecodeStep, width: int) -> None:
        """The reranked rows' stable heads: their next top-K, applied by after_append (after the layer's attention)."""
        stable, rows = self._stable_heads[step.layer], self._reranks(step.seqs)
        if width > self.top_k and rows and stable.numel():
            r = torch.tensor(rows, device=kv.device)
            q = selection.group_queries(step.q[r], kv.num_kv_heads, stable)
            top = kv.top_pages(step.slots[r], step.layer, q, self.top_k, keep_last=True, heads=stable, width=width)
            self._pending[step.layer] = (r, top)

    def select_pages(self, kv: KVView, step: DecodeStep) -> torch.Tensor | None:
        layer, slots, K = step.layer, step.slots, self.top_k
        width = _width(kv, step.seqs)
        if width <= K:                                                # nothing was released: every page is read
            return None
        stable, unstable = self._stable_heads[layer], self._unstable_heads[layer]
        self._score_rerank(kv, step, width)                           # stable heads: the next step's top-K
        # stable heads read what they hold on the device (their top-K and the pages filled since, no scoring between
        # reranks); unstable heads hold everything and read their top-K, reranked every step
        parts = []
        if stable.numel():
            parts.append((stable, self._resident(kv, slots, step.seqs, layer, stable)))
        if unstable.numel():
            q = selection.group_queries(step.q, kv.num_kv_heads, unstable)
            parts.append((unstable, kv.top_pages(slots, layer, q, K, keep_last=True, heads=unstable, width=width)))
        if len(parts) == 1:
            return parts[0][1]
        W = max(p.shape[-1] for _, p in parts)
        padded = [torch.nn.functional.pad(p, (0, W - p.shape[-1]), value=selection.PAD) for _, p in parts]
        return torch.cat(padded, dim=1).index_select(1, self._head_order[layer])    # back to head order

    def _resident(self, kv: KVView, slots: torch.Tensor, seqs: list[SeqInfo], layer: int, stable: torch.Tensor,
                  appending: int = 0) -> torch.Tensor:
        """The stable heads' device pages once the step's token is in (`appending`: 1 before its append). They change
        only at a rerank swap, a prefill or when a sequence starts a page, so the list is kept per layer and rebuilt
        when the batch (slots, pages held) differs or a swap ran."""
        key = _batch_key(kv, seqs)
        held = self._held.get(layer)
        if held is None or held[0] != key:
            held = (key, kv.resident_pages(slots, layer, heads=stable, appending=appending))
            self._held[layer] = held
        return held[1]

    def _forget(self, layer: int | None = None) -> None:
        """Drop the kept resident lists (one layer's, or all) after their pages moved; the rule's sets with them."""
        self._held.clear() if layer is None else self._held.pop(layer, None)
        self._rule_sets = None

    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        layer, slots, P = step.layer, step.slots, kv.page_size
        # nothing is dropped, so every head holds seq_len tokens: a page filled iff seq_len % P == 0
        full = [b for b, seq in enumerate(step.seqs) if seq.seq_len % P == 0]
        stable = self._stable_heads[layer]
        pending = self._pending.pop(layer, None)
        if not (full and stable.numel()) and pending is None:        # no tier traffic this layer and step
            return
        t0 = time.perf_counter()
        if full and stable.numel():                                   # a stable head's page just filled: host copy
            b = torch.tensor(full, device=kv.device).repeat_interleave(stable.numel())
            h = stable.repeat(len(full))
            page = kv.num_tokens[slots[b], layer, h].long() // P - 1
            fresh = kv.host_table[slots[b], layer, h, page] == 0
            b, h, page = b[fresh], h[fresh], page[fresh]
            kv.offload_pages(slots[b], torch.full_like(b, layer), h, page)
            for slot, n in zip(*torch.unique(slots[b], return_counts=True)):
                self.traffic.add(int(slot), "offloaded_pages", int(n))
        if pending is not None:
            self._apply_rerank(kv, step, *pending)
        self.traffic.add_copy_time(step.seqs, time.perf_counter() - t0)

    def _apply_rerank(self, kv: KVView, step: DecodeStep, rows: torch.Tensor, top: torch.Tensor) -> None:
        """The reranked rows' stable heads: the new top-K (the last page among it) against what they hold now."""
        self._forget(step.layer)
        heads = self._stable_heads[step.layer]
        num_pages = selection.pages_of(kv.num_tokens[step.slots[rows], step.layer][:, heads], kv.page_size)
        M = int(num_pages.max())
        valid = self._page_index[:M] < num_pages.unsqueeze(-1)
        resident = (kv.block_table[step.slots[rows], step.layer][:, heads, :M] != 0) & valid
        chosen = selection.as_mask(top, M)
        self._swap(kv, step, rows, heads, resident, chosen)

    def _swap(self, kv: KVView, step: DecodeStep, rows: torch.Tensor, heads: torch.Tensor, resident: torch.Tensor,
              chosen: torch.Tensor) -> None:
        """Promote the pages new in `chosen` into the blocks of the pages that left it, free the leftovers."""
        promoted, released = swap_pages(kv, step.slots[rows], step.layer, heads, resident, chosen)
        topk_pages = chosen.sum((-1, -2)).tolist()
        for i, b in enumerate(rows.tolist()):
            self.traffic.reranked(step.seqs[b], heads.numel(), promoted[i], released[i], topk_pages[i])

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        stats = super().kv_stats(kv, seq)
        st = self.traffic.summary(seq.slot)
        tokens = int(kv.num_tokens[seq.slot].max())
        n_unstable = int(self.unstable.sum())
        st["bytes_host_to_device"] = st.get("promoted_pages", 0) * self.bytes_per_block
        st["bytes_device_to_host"] = st.get("offloaded_pages", 0) * self.bytes_per_block
        st["promoted_share_of_topk"] = (st["promoted_pages"] / st["topk_pages_reranked"]
                                        if st.get("topk_pages_reranked") else None)
        stats.update(st, budget_tokens=self.budget, top_k=self.top_k, naive=self.naive,
                     unstable_heads=n_unstable, stable_heads=self.num_managed * self.num_kv_heads - n_unstable,
                     profile=self.profile_source, device_kv_bytes=stats["device_pages"] * self.bytes_per_block,
                     analytic_device_kv_bytes=self._analytic_blocks(tokens) * self.bytes_per_block,
                     minmax_bytes=self.num_layers * self.num_kv_heads * -(-tokens // kv.page_size)
                     * self.minmax_bytes_per_page)
        return stats


def _width(kv: KVView, seqs: list[SeqInfo]) -> int:
    """Pages the longest sequence holds (nothing is dropped: every head holds seq_len tokens, no device sync)."""
    return -(-max(seq.seq_len for seq in seqs) // kv.page_size)


def _batch_key(kv: KVView, seqs: list[SeqInfo]) -> tuple:
    """What the stable heads' device pages depend on between swaps: each sequence's slot and pages."""
    return tuple((seq.slot, -(-seq.seq_len // kv.page_size)) for seq in seqs)


POLICY = FlexiCache
