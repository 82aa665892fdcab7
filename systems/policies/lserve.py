"""LServe-style: streaming KV heads keep sink + local pages only, retrieval heads read Quest-selected 64-token pages.

Follows mit-han-lab/omniserve. Storage pages are the engine's 16-token pages (LServe's logical
pages); a physical page of 64 tokens is a selection unit of 4 adjacent logical pages, scoring the max of theirs.
Retrieval heads: every page while the sequence holds <= budget tokens, else the top k - 1 physical pages among all
but the most recent one plus that one, k = min(max(3, budget // 64), pages); the choice is recomputed when
seq_len % reuse_interval == 0 (or on a head's first sparse step) and reused otherwise, always with the current
last physical page. Streaming heads keep pages 0 .. sink/16 - 1 and the last local/16 + 1 pages (the partial page
counted, as `dec_local_block = 256/64 + 1`); every other page's device block is freed after prefill and as the
window slides, and never read again. Granularity `query_head` (default) is omniserve's selector, which writes its
statistics per (batch, query head): every query head of a retrieval KV head chooses its own pages and attends to
them alone; `kv_head` chooses once per KV head with the bound maxed over the group.

Head split: per KV head a score, high = retrieval head, from a profile. LServe takes DuoAttention's learned gates
(`+exp=duo_attention` trains them on this model: profile task `duo_attention`); the project's proxy (the share of
decode attention mass outside the sink + local window, harness/experiments/head_stability.py) is the other option.
As in LServe, a global quantile at `sparsity` (tiny seeded noise breaks ties) splits the heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from systems.policies.base import DecodeStep, KVDims, KVView, Policy, SeqInfo
from systems.policy_support import profiles, selection


@dataclass
class LServe(Policy):
    budget: int = 4096              # tokens per step and retrieval head (dynamic_sparse_token_budget)
    physical_page: int = 64         # block_size: the selection unit, sub_chunk_per_block = 64 / 16 = 4
    sink_tokens: int = 128          # --dec-sink-token
    local_tokens: int = 256         # --dec-local-token
    reuse_interval: int = 4         # selector_update_interval
    sparsity: float = 0.5           # --static-sparsity: share of KV heads that stream
    profile_model: str | None = None    # the model whose profile it reads; None: the model being run (dims.model_name)
    profile_task: str = "duo_attention"     # learned gates (+exp=duo_attention) | a head_stability task (the proxy)
    profile: str | None = None      # explicit profile file (overrides profile_model / profile_task); it must have
                                    # been made on the model being run
    streaming_heads: list | None = None   # explicit [[layer, head], ...] (overrides any profile)
    granularity: str = "query_head"       # query_head (omniserve's per-(batch, query head) selector) | kv_head

    name = "lserve"
    profile_schema = ("model", "task", "proxy", "num_layers", "num_kv_heads", "head_scores")
    profiler = "duo_attention"      # learned gates; head_stability makes the attention-mass proxy profile

    @classmethod
    def budget_granularity(cls, params: dict[str, Any], page_size: int) -> int:
        return int(params.get("physical_page", 64))     # its budget is whole physical pages

    def __post_init__(self) -> None:
        if self.budget <= 0 or self.physical_page <= 0 or self.budget % self.physical_page:
            raise ValueError(f"lserve: budget must be a positive multiple of physical_page={self.physical_page}, "
                             f"got {self.budget}")
        if self.granularity not in ("query_head", "kv_head"):
            raise ValueError(f"lserve: granularity must be query_head or kv_head, got {self.granularity!r}")
        if not 0.0 <= self.sparsity <= 1.0 or self.reuse_interval < 1:
            raise ValueError(f"lserve: need 0 <= sparsity <= 1 and reuse_interval >= 1, got {self.sparsity}, "
                             f"{self.reuse_interval}")
        if self.streaming_heads is not None:
            self.streaming_heads = [[int(x) for x in pair] for pair in self.streaming_heads]
        elif self.profile or self.profile_model:        # a missing profile fails before any model load
            self._path(self.profile_model)

    @property
    def _maker(self) -> str:
        """The experiment that makes its profile: learned gates, or head_stability's attention-mass proxy."""
        return str(self.profiler) if self.profile_task == "duo_attention" else "head_stability"

    def _path(self, model: str | None) -> str:
        """The profile file: params.profile, else the shipped one of `model` on profile_task (it must exist)."""
        if self.profile:
            if not Path(self.profile).is_file():
                raise ValueError(f"lserve: no profile at {self.profile}; pass an existing file")
            return self.profile
        if model is None:
            raise ValueError("lserve: the model being run has no name to find its profile by; set "
                             "params.profile_model or params.profile")
        path = profiles.profile_path("lserve", model, self.profile_task)
        if not path.is_file():
            make = profiles.make_command(self._maker, model)
            raise ValueError(f"lserve: no profile of {model!r} on {self.profile_task!r} (shipped); make one with "
                             f"`{make}`, or set params.streaming_heads")
        return str(path)

    @classmethod
    def missing_profile(cls, params: dict[str, Any], model: str) -> str | None:
        return cls._profile_lookup_error(params, model, given="streaming_heads")

    # ---- setup ---------------------------------------------------------------------------------------------------
    def configure(self, dims: KVDims) -> None:
        super().configure(dims)
        p = dims.page_size
        if self.physical_page % p or self.sink_tokens % p or self.local_tokens % p:
            raise ValueError(f"lserve: physical_page, sink_tokens and local_tokens must be multiples of "
                             f"engine.page_size={p}, got {self.physical_page}, {self.sink_tokens}, {self.local_tokens}")
        self.streaming = torch.zeros(dims.num_layers, dims.num_kv_heads, dtype=torch.bool)
        for layer, head in self._streaming_list(dims):
            self.streaming[layer, head] = True
        # a profile's heads on layers left to their window do nothing there: the counts below cover managed layers
        self.streaming[[layer for layer in range(dims.num_layers) if not self.manages(layer)]] = False
        self._streaming_dev = self.streaming.to(dims.device)
        # selection units: every query head (each with its own choice) or every KV head (one choice per group)
        self._group = dims.num_q_heads // dims.num_kv_heads if self.granularity == "query_head" else 1
        self._unit_streaming = self._streaming_dev.repeat_interleave(self._group, dim=1)      # [L, units]
        self._unit_kv = torch.arange(dims.num_kv_heads, device=dims.device).repeat_interleave(self._group)
        # the split is fixed: each layer's streaming heads and retrieval units as index lists, made once here instead
        # of a nonzero (a host sync) per layer per decode step
        self._stream_heads = [row.nonzero().view(-1) for row in self._streaming_dev]
        self._retrieval_units = [(~row).nonzero().view(-1) for row in self._unit_streaming]
        self.sub = self.physical_page // p
        self.sink_pages, self.local_pages = self.sink_tokens // p, self.local_tokens // p

    def bind(self, kv: KVView) -> None:
        super().bind(kv)
        slots, phys = kv.block_table.shape[0], -(-kv.max_pages // self.sub)
        self._chosen = torch.zeros(slots, kv.num_layers, kv.num_kv_heads * self._group, phys, dtype=torch.bool,
                                   device=kv.device)
        self._has_choice = torch.zeros(slots, kv.num_layers, dtype=torch.bool, device=kv.device)
        # bumped whenever a layer's choices or its streaming heads' resident pages change; _epoch on any reset/fork
        self._version = [0] * kv.num_layers
        self._epoch = 0
        self._last_read: dict[int, tuple[tuple, torch.Tensor | None]] = {}     # per layer: (key, pages it read)

    def _streaming_list(self, kv: KVDims) -> list[tuple[int, int]]:
        if self.streaming_heads is not None:
            return profiles.head_list(self.streaming_heads, kv.num_layers, kv.num_kv_heads, "lserve")
        model = getattr(kv, "model_name", None)
        path = self._path(self.profile_model or model)
        prof = profiles.load_model_profile(path, "lserve", self.profile_schema, model, self._maker, kv.num_layers,
                                           kv.num_kv_heads)
        scores = torch.tensor(prof["head_scores"], dtype=torch.float64)
        if tuple(scores.shape) != (kv.num_layers, kv.num_kv_heads):
            raise ValueError(f"lserve profile {path} scores {tuple(scores.shape)} heads, the model has "
                             f"{kv.num_layers} x {kv.num_kv_heads}; profile this model")
        # the sparsity quantile is over the heads it manages
        return streaming_split(scores, self.sparsity, list(self.managed_layers))

    def _kept_pages(self, pages: int) -> int:
        return min(pages, self.sink_pages + self.local_pages + 1)

    def device_blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        pages = -(-prompt_len // self.page_size)
        n_stream = self.streaming.sum(-1)[list(self.managed_layers)]
        settled = int(((self.num_kv_heads - n_stream) * pages + n_stream * self._kept_pages(pages)).sum())
        transient = int(n_stream.max()) * (pages - self._kept_pages(pages)) if n_stream.numel() else 0
        return settled + transient + self.window_prefill_blocks(prompt_len)

    def expected_device_blocks(self, prompt_len: int, output_tokens: int) -> int | None:
        """Retrieval heads hold every page; streaming heads the sink pages, the local window and the partial page."""
        tokens = prompt_len + output_tokens - 1
        pages = -(-tokens // self.page_size)
        n_stream = int(self.streaming.sum())
        return ((self.num_managed * self.num_kv_heads - n_stream) * pages + n_stream * self._kept_pages(pages)
                + self.window_blocks(tokens))

    def expected_blocks_slack(self) -> int:
        return self.num_managed * self.num_kv_heads

    @classmethod
    def profile_free_params(cls, num_layers: int, num_kv_heads: int) -> dict[str, Any]:
        """LServe's default sparsity: half the KV heads stream, taken as the first heads of every layer."""
        per_layer = round(0.5 * num_kv_heads)
        return {"streaming_heads": [[layer, h] for layer in range(num_layers) for h in range(per_layer)]}

    def reset(self, slot: int) -> None:
        if hasattr(self, "_has_choice"):
            self._has_choice[slot] = False
            self._epoch += 1

    # ---- streaming heads: sink + sliding local window --------------------------------------------------------------
    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        heads = self._streaming_dev[layer].nonzero().view(-1)
        n_pages = -(-int(kv.num_tokens[seq.slot, layer, 0]) // kv.page_size)
        if heads.numel() == 0 or n_pages - 1 - self.local_pages <= self.sink_pages:
            return
        drop = torch.arange(self.sink_pages, n_pages - 1 - self.local_pages, device=kv.device)
        hh, pp = heads.repeat_interleave(drop.numel()), drop.repeat(heads.numel())
        kv.release_device_pages(torch.full_like(hh, seq.slot), torch.full_like(hh, layer), hh, pp)
        self._version[layer] += 1

    def after_extend_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """A query-agnostic question appended after the context: the streaming heads' window moves past it, so the
        pages it pushed out of sink + local are released (those still on the device)."""
        heads = self._streaming_dev[layer].nonzero().view(-1)
        n_pages = -(-int(kv.num_tokens[seq.slot, layer, 0]) // kv.page_size)
        if heads.numel() == 0 or n_pages - 1 - self.local_pages <= self.sink_pages:
            return
        drop = torch.arange(self.sink_pages, n_pages - 1 - self.local_pages, device=kv.device)
        hh, pp = heads.repeat_interleave(drop.numel()), drop.repeat(heads.numel())
        live = kv.block_table[seq.slot, layer, hh, pp] != 0
        hh, pp = hh[live], pp[live]
        kv.release_device_pages(torch.full_like(hh, seq.slot), torch.full_like(hh, layer), hh, pp)
        self._version[layer] += 1

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        self._chosen[dst] = self._chosen[src]
        self._has_choice[dst] = self._has_choice[src]
        self._epoch += 1

    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        heads = self._stream_heads[step.layer]
        # a page leaves the window only on a step whose token starts a new page (every head holds seq_len tokens)
        if heads.numel() == 0 or all((s.seq_len - 1) % kv.page_size for s in step.seqs):
            return
        last = (kv.num_tokens[step.slots][:, step.layer, heads].long() - 1) // kv.page_size      # [B, s]
        old = last - 1 - self.local_pages                                # the page that just left the window
        b, j = (old >= self.sink_pages).nonzero(as_tuple=True)
        s, h, page = step.slots[b], heads[j], old[b, j]
        live = kv.block_table[s, step.layer, h, page] != 0
        if not bool(live.any()):        # released already
            return
        kv.release_device_pages(s[live], torch.full_like(s[live], step.layer), h[live], page[live])
        self._version[step.layer] += 1

    # ---- selection -------------------------------------------------------------------------------------------------
    def select_pages(self, kv: KVView, step: DecodeStep) -> torch.Tensor | None:
        """What a layer reads changes only when a row's choice is due, a page starts or leaves a streaming head's
        window, or a row crosses the budget: between those steps the layer's last answer is returned as it is."""
        due = [b for b, s in enumerate(step.seqs) if s.seq_len % self.reuse_interval == 0]
        # nothing is dropped (streaming heads release pages, not tokens): every head of a sequence spans its seq_len
        # tokens, so the page counts and which rows are past the budget are known here without a device op
        pages = [s.pages(kv.page_size) for s in step.seqs]
        past = [s.seq_len > self.budget for s in step.seqs]             # rows whose retrieval units are sparse
        key = ([s.slot for s in step.seqs], pages, past, self._epoch, self._version[step.layer])
        last = self._last_read.get(step.layer)
        if not due and last is not None and last[0] == key:
            return last[1]
        read = self._read_pages(kv, step, due, pages, past)
        self._last_read[step.layer] = ((*key[:3], self._epoch, self._version[step.layer]), read)
        return read

    def _read_pages(self, kv: KVView, step: DecodeStep, due: list[int], pages: list[int], past: list[bool]
                    ) -> torch.Tensor | None:
        layer, slots, G = step.layer, step.slots, self._group
        width = max(pages)
        num_pages = torch.tensor(pages, device=kv.device).view(-1, 1).expand(-1, kv.num_kv_heads * G)   # [B, units]
        valid = torch.arange(width, device=kv.device).view(1, 1, -1) < num_pages.unsqueeze(-1)
        # streaming heads read what they still hold (sink + local window)
        read = (kv.block_table[slots, layer, :, :width] != 0).repeat_interleave(G, 1) & valid
        units = self._retrieval_units[layer]
        if units.numel() and any(past):
            sparse = torch.tensor(past, device=kv.device).view(-1, 1)
            self._refresh(kv, step, units, num_pages, width, due)
            wp = -(-width // self.sub)
            phys = self._chosen[slots, layer][:, units, :wp].clone()                           # [B, r, wp]
            last_phys = (num_pages[:, units] - 1) // self.sub
            phys.scatter_(-1, last_phys.unsqueeze(-1), True)
            logical = phys.repeat_interleave(self.sub, dim=-1)[..., :width] & valid[:, units]
            read[:, units] = torch.where(sparse.unsqueeze(-1), logical, read[:, units])
        if bool((read == valid).all()):
            return None
        return selection.compact(read)      # [B, Hq, K] per query head, [B, Hkv, K] per KV head

    def _refresh(self, kv: KVView, step: DecodeStep, units: torch.Tensor, num_pages: torch.Tensor, width: int,
                 due: list[int]) -> None:
        """Recompute the physical-page choice of the rows whose reuse period is over (`due`) or that have none."""
        layer = step.layer
        stale = (~self._has_choice[step.slots, layer]).nonzero().view(-1).tolist()
        rows = sorted(set(due) | set(stale))
        if not rows:
            return
        r = torch.tensor(rows, device=kv.device)
        s, u = step.slots[r].view(-1, 1), units.view(1, -1)
        heads = self._unit_kv[units].view(1, -1)                        # the KV head each unit reads
        if self._group > 1:             # each query head scores with its own query (a group of one)
            q = step.q[r][:, units]
        else:                           # a KV head scores with the max over its query group
            q = selection.group_queries(step.q[r], kv.num_kv_heads, units)
        n_log = num_pages[r][:, units]
        scores = selection.page_scores(q, kv.kmin[s, layer, heads, :width], kv.kmax[s, layer, heads, :width], n_log)
        wp = -(-width // self.sub)
        pad = wp * self.sub - width
        phys = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")).view(*scores.shape[:2], wp, self.sub)
        n_phys = -(-n_log // self.sub)
        k = max(3, self.budget // self.physical_page)
        chosen = selection.topk_with_last(phys.amax(-1), n_phys, k)
        mask = torch.zeros(len(rows), units.numel(), self._chosen.shape[-1], dtype=torch.bool, device=kv.device)
        mask[..., :wp] = selection.as_mask(chosen, wp)
        self._chosen[s, layer, u] = mask
        self._has_choice[step.slots[r], layer] = True
        self._version[layer] += 1

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        stats = super().kv_stats(kv, seq)
        stats.update(streaming_heads=int(self.streaming.sum()),
                     retrieval_heads=self.num_managed * self.num_kv_heads - int(self.streaming.sum()),
                     budget_tokens=self.budget)
        return stats


def streaming_split(scores: torch.Tensor, sparsity: float, layers: list[int] | None = None,
                    seed: int = 0) -> list[tuple[int, int]]:
    """LServe's split: heads below the global `sparsity` quantile of scores (+ uniform noise in [0, 1e-6]) stream.
    `layers` (default all): the layers the quantile is taken over; the others stream nothing."""
    layers = list(range(scores.shape[0])) if layers is None else layers
    picked = scores[layers]
    noise = torch.rand(picked.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1e-6
    noisy = picked.double() + noise
    threshold = torch.quantile(noisy.flatten(), sparsity)
    return [(layers[layer], int(head)) for layer, head in (noisy < threshold).nonzero().tolist()]


POLICY = LServe
