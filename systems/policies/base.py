"""The policy seam: what a KV policy may see and do at the engine's three hook points, and the KV view it acts through.

A policy is a dataclass of hyperparameters (validated by `Policy.from_params`) plus hooks. The engine calls them in
this order for each sequence (identified by its `slot`, an integer in [0, max_num_seqs)):

    reset(slot)                                   admitted (also after a preemption: it is prefilled again)
    after_prefill_layer(kv, seq, layer, q, k)     once per layer, as soon as that layer's prefill KV is stored
    after_extend_layer(kv, seq, layer, q, k)      query-agnostic requests: per layer, after the question's tokens
                                                  were appended to the compressed context (not compressed)
    fork(kv, src, dst)                            instead of reset: slot dst starts from slot src's cache (a
                                                  shared context's reader, or a kept prefix)
    ... per decode step, for the running batch:
    begin_decode_step(kv, seqs)                   before the forward; may kv.pause(slot) to skip a sequence this step
    select_pages(kv, step) -> pages | None        per layer, after the new token is appended, before attention
      or decode_page_rule(kv, step) -> rule       once, before the forward, where the engine runs page rules in its
         ... pages_chosen(kv, step, rule, sets)   fused step; then once after it with the sets the rule chose
    after_append(kv, step)                        per layer, after attention (the step saw the uncompressed cache)
      or after_decode_step(kv, step)              once, after every layer, in place of after_append where the
                                                  engine can defer it (see Policy.after_decode_step)
    kv_stats(kv, seq) -> dict                     when the sequence finishes (copied into Completion.kv_stats)
    reset(slot)                                   after it finishes; the engine then frees all its blocks

The per-layer hooks run only on the layers the policy manages (`Policy.manages`; on a hybrid model its full-attention
layers unless it sets `windowed_layers = "manage"`); the engine keeps the other, sliding-window layers to their window.

What a policy sees (SeqInfo, DecodeStep, DecodeLayers) and the KV view it acts through (KVDims, KVView) are
defined in `systems.policies.view` and re-exported here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from systems.policies.view import DecodeLayers, DecodeStep, KVDims, KVView, PageRule, SeqInfo, block_bytes

__all__ = ["DecodeLayers", "DecodeStep", "KVDims", "KVView", "PageRule", "Policy", "SeqInfo", "block_bytes",
           "WINDOWED_LAYERS"]

_REGISTRY_HINT = "systems/policies/<name>.py exposing POLICY"
WINDOWED_LAYERS = ("window", "manage")      # what a policy may do on sliding-window layers (Policy.windowed_layers)


@dataclass
class Policy:
    """Base of every KV policy: subclasses add hyperparameter fields and override the hooks they need."""

    name: ClassVar[str] = "base"
    mode: ClassVar[str] = "physical"    # 'simulated' if savings are only masked
    # keeps and reads every token (dense): a shared budget does not apply to it by design, and a backend that runs no
    # KV policies runs exactly such a policy
    full_cache: ClassVar[bool] = False
    profile_schema: ClassVar[tuple[str, ...]] = ()      # keys its profile JSON must hold; () = it needs no profile
    profiler: ClassVar[str | None] = None               # the experiment (conf/exp name) that makes its profile
    # What the policy does on sliding-window layers. "window" (default, as kvpress compresses only Gemma 3's global
    # layers): it leaves them to their window — its hooks never run there and the engine frees the pages the window
    # left behind — and its budgets, allocations and profiles cover the full-attention layers only; on a model
    # without full-attention layers (a window everywhere) it manages every layer. "manage": its hooks run on every
    # layer and it alone decides what a windowed layer holds (the window then only masks).
    windowed_layers: ClassVar[str] = "window"
    step_queries: ClassVar[bool] = False    # after_decode_step reads each layer's query (DecodeLayers.q)

    # ---- what the harness asks a policy (defaults here; a policy overrides what differs) ----------------------------
    @classmethod
    def has_budget(cls) -> bool:
        """Whether one shared token budget maps onto this policy's knobs (default: it has a `budget` knob; a policy
        whose knob has another name overrides this, with_budget and budget_of)."""
        return "budget" in {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def with_budget(cls, params: dict[str, Any], budget: int) -> dict[str, Any]:
        """`params` with a shared token budget applied: how the budget maps onto this policy's knobs."""
        return {**params, "budget": budget} if cls.has_budget() else dict(params)

    @classmethod
    def budget_of(cls, params: dict[str, Any]) -> Any:
        """The token budget `params` set (the inverse of with_budget; an int when the params are valid), or None."""
        return params.get("budget") if cls.has_budget() else None

    @classmethod
    def budget_granularity(cls, params: dict[str, Any], page_size: int) -> int:
        """The step a budget moves in (a budget derived per request, e.g. from kvpress's compression_ratio, is
        rounded down to a multiple of it): 1 token for policies that keep tokens; a paged policy overrides it."""
        return 1

    def at_budget(self, budget: int) -> Policy:
        """This policy with its budget set to `budget` (with_budget's mapping), unbound: for one request's budget."""
        cls = type(self)
        params = {f.name: getattr(self, f.name) for f in dataclasses.fields(cls) if f.init}
        return cls.from_params(cls.with_budget(params, budget))

    @classmethod
    def budget_left_out(cls) -> str | None:
        """Why a shared budget leaves this policy as configured, for the summary to say so; None when the budget
        applies or the policy keeps the full cache by design."""
        if cls.full_cache or cls.has_budget():
            return None
        return f"policy {cls.name!r} maps no shared budget onto its knobs"

    @classmethod
    def with_heldout_task(cls, params: dict[str, Any], task: str) -> dict[str, Any]:
        """`params` for evaluating `task`: a policy profiled on tasks holds the evaluated one out of its profile."""
        return dict(params)

    @classmethod
    def missing_profile(cls, params: dict[str, Any], model: str) -> str | None:
        """Why this policy cannot run on `model` (a model.name) for lack of a profile made on it, naming the command
        that makes one; None when it needs none or has one."""
        return None

    @classmethod
    def _profile_lookup_error(cls, params: dict[str, Any], model: str, given: str) -> str | None:
        """`missing_profile` of a policy that finds its profile by model name unless `given` (its heads, listed in
        the params) or `profile` (a path) is set: the error constructing it for `model` raises, if any."""
        if params.get(given) is not None or params.get("profile"):
            return None
        try:
            cls.from_params({**params, "profile_model": params.get("profile_model") or model})
        except ValueError as exc:
            return str(exc)
        return None

    @classmethod
    def profile_free_params(cls, num_layers: int, num_kv_heads: int) -> dict[str, Any]:
        """Parameters that let the policy run without a profile of the model (microbenchmarks on synthetic KV):
        only how many heads play each role matters there, not which."""
        return {}

    def expected_device_blocks(self, prompt_len: int, output_tokens: int) -> int | None:
        """Device blocks one request holds when it finishes (prompt_len + output_tokens - 1 tokens stored), by this
        policy's rule: the analytic count `+exp=memory` checks the engine against. Default: every page of every
        (layer, KV head) resident. None: no closed form."""
        tokens = prompt_len + output_tokens - 1
        return self.num_managed * self.num_kv_heads * -(-tokens // self.page_size) + self.window_blocks(tokens)

    def expected_blocks_slack(self) -> int:
        """How far the measured count may sit from expected_device_blocks (per-layer rounding, partial pages)."""
        return 0

    def prefill_peak_blocks(self, prompt_len: int) -> int | None:
        """Bound on the blocks a request holds at any moment of its prefill, when it differs from holding the whole
        prompt (CAKE's cascading); None otherwise."""
        return None

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> Policy:
        """Build from a config dict; unknown keys fail in one line naming the valid ones."""
        params = dict(params or {})
        valid = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(params) - set(valid))
        if unknown:
            raise ValueError(f"policy {cls.name!r}: unknown parameter(s) {unknown}; valid: {valid or 'none'}")
        try:
            return cls(**params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"policy {cls.name!r}: {exc}") from None

    def configure(self, dims: KVDims) -> None:
        """Learn the model's shape and the page size, and derive everything that needs no storage (head roles from
        a profile, per-layer budgets): enough for device_blocks_needed, so the harness can check a request fits the
        device pool before any model loads. Overrides call super().configure(dims) and raise ValueError with a
        one-line message for a setting that cannot work with these dims."""
        self.num_layers, self.num_kv_heads = dims.num_layers, dims.num_kv_heads
        self.num_q_heads, self.head_dim, self.page_size = dims.num_q_heads, dims.head_dim, dims.page_size
        if self.windowed_layers not in WINDOWED_LAYERS:
            raise ValueError(f"policy {self.name!r}: windowed_layers={self.windowed_layers!r}, use one of "
                             f"{list(WINDOWED_LAYERS)}")
        windows = tuple(getattr(dims, "layer_windows", None) or (None,) * dims.num_layers)
        self.layer_windows = windows
        full = tuple(layer for layer, w in enumerate(windows) if w is None)
        # a full-cache policy changes nothing anywhere, so its windowed layers are the window's
        every = not self.full_cache and (self.windowed_layers == "manage" or not full)
        self.managed_layers: tuple[int, ...] = tuple(range(dims.num_layers)) if every else full
        self.left_windows: dict[int, int] = {layer: w for layer, w in enumerate(windows)
                                             if w is not None and layer not in self.managed_layers}
        self._rank = {layer: i for i, layer in enumerate(self.managed_layers)}

    def manages(self, layer: int) -> bool:
        """Whether the policy's hooks run on `layer` (see `windowed_layers`)."""
        return layer in self._rank

    def layer_rank(self, layer: int) -> int:
        """The layer's place among the managed layers (per-layer budgets and profiles are indexed by it)."""
        return self._rank[layer]

    @property
    def num_managed(self) -> int:
        return len(self.managed_layers)

    def window_blocks(self, tokens: int) -> int:
        """Device blocks the layers left to their window hold with `tokens` tokens stored: the pages of their last
        W - 1 tokens (at most ceil((W - 1) / P) + 1 per KV head), the freed ones not counted."""
        pages = -(-tokens // self.page_size)
        return self.num_kv_heads * sum(pages - max(tokens - w + 1, 0) // self.page_size
                                       for w in self.left_windows.values())

    def window_prefill_blocks(self, prompt_len: int) -> int:
        """window_blocks after a prefill of `prompt_len`, plus its transient peak: one windowed layer holds the whole
        prompt until its attention is done and the pages before its window go."""
        if not self.left_windows:
            return 0
        pages = -(-prompt_len // self.page_size)
        least = min(pages - max(prompt_len - w + 1, 0) // self.page_size for w in self.left_windows.values())
        return self.window_blocks(prompt_len) + self.num_kv_heads * (pages - least)

    def bind(self, kv: KVView) -> None:
        """Called once before any request, with the storage the policy will act on: configure, then allocate
        per-slot state. Overrides call super().bind(kv)."""
        self.configure(kv)

    def device_blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Device blocks that must be free to admit a request with this prefill length: an upper bound on what it
        holds after prefill plus its transient peak during prefill (decode growth is handled by preemption).
        Default: every page of every (layer, KV head) resident."""
        pages = -(-prompt_len // self.page_size)
        return pages * self.num_managed * self.num_kv_heads + self.window_prefill_blocks(prompt_len)

    def reset(self, slot: int) -> None:
        """Forget every piece of state held for this slot (called at admission and after finish/preemption)."""

    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Prefill of `layer` for `seq` is done and its KV stored (all n tokens resident, storage order = position
        order). q: [n, Hq, D], k: [n, Hkv, D], both post-RoPE (the last S_w rows of q are the observation window;
        values are in kv.v_pool via gather_tokens). Evict (kv.keep_tokens), offload (kv.offload_pages /
        release_device_pages) or re-evict earlier layers here (CAKE's cascading). Layers arrive in order
        0 .. L-1; layer L-1 is the end of the sequence's prefill."""

    def after_extend_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Query-agnostic mode (kvpress's default): the context was prefilled and compressed alone, and n more
        tokens — the question, and after a preemption the outputs so far — were appended to `layer` after every
        head's stored tokens (storage rows num_tokens - n .. num_tokens - 1 of each head, positions seq.seq_len - n
        .. seq.seq_len - 1) and attended to what each head holds on the device. q: [n, Hq, D], k: [n, Hkv, D]
        post-RoPE. These tokens are not compressed here (only the context is); record the per-token state that
        decode-time hooks read (positions, scores) and keep placement rules (a sliding window, host copies of full
        pages). Decode-time hooks then treat them like any earlier token. Default: nothing."""

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        """Slot dst starts as a copy of slot src's cache (the engine already forked the KV: same pages, shared;
        see the engine's prefix sharing): a shared context's reader, or a prefix kept for later requests. Copy the
        per-slot state that later hooks read, so dst continues exactly as src would. Default: reset(dst), right
        for policies whose per-slot state only counts what a sequence did (a policy with decode-time state
        overrides this)."""
        self.reset(dst)

    def begin_decode_step(self, kv: KVView, seqs: list[SeqInfo]) -> None:
        """Before each decode step's forward, for the sequences about to decode; may call kv.pause(slot)."""

    def select_pages(self, kv: KVView, step: DecodeStep) -> torch.Tensor | None:
        """Before decode attention of step.layer: logical pages [B, Hkv, K] each head reads (see module docstring),
        or None for all pages. The new token is already appended (num_tokens and MinMax include it)."""
        return None

    def decode_page_rule(self, kv: KVView, step: DecodeLayers) -> PageRule | None:
        """A whole decode step's page choice as a rule (view.PageRule), where the engine can run one inside its fused
        step instead of calling select_pages per layer: do now the bookkeeping select_pages would have done on every
        managed layer of this step (the chosen sets then reach pages_chosen). Called once, before the forward, with
        step.q None. None (default): the engine calls select_pages per layer. A policy that overrides it keeps
        select_pages, which the engine's other paths call, and the two must choose the same pages. A rule's step
        runs no after_append: a policy with one does its work in pages_chosen, which runs after the step's last
        layer, when nothing has read a layer's cache since its attention (so each layer's work sees what its
        after_append would have seen; with `step_queries`, step.q carries each layer's query)."""
        return None

    def pages_chosen(self, kv: KVView, step: DecodeLayers, rule: PageRule, chosen: torch.Tensor) -> None:
        """After a step run by decode_page_rule's rule: chosen [L, B, sets, K] holds at each of rule.layers the sets
        select_pages would have answered there (rows of other layers are unspecified; an empty tensor when the rule
        covers no layer). Also where a rule's step does what after_append would have done, layer by layer."""

    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        """After decode attention of step.layer: decode-time eviction through kv.drop_tokens / keep_tokens."""

    def after_decode_step(self, kv: KVView, step: DecodeLayers) -> None:
        """Decode-time eviction of a whole step at once: exactly what after_append on every managed layer, in
        ascending order, would have done (the same kept tokens, storage moves and freed blocks), with tensors that
        span the layers instead of one set of ops per layer. The engine calls it instead of after_append after the
        step's last layer, where nothing reads a layer's cache between its attention and the end of the step (a
        pure decode step of the fused CPU path), so each layer's cache is still what its after_append would have
        seen. A policy that overrides it keeps after_append for the engine's other paths. Not overridden: the
        engine calls after_append per layer."""
        raise NotImplementedError

    def defers_eviction(self) -> bool:
        """Whether the policy evicts once per step (after_decode_step) where the engine can defer eviction: not
        when a subclass overrides after_append below the class that defined after_decode_step (its per-layer hook
        is then the policy's rule, which after_decode_step does not know)."""
        mro = type(self).__mro__
        deferring = next(c for c in mro if "after_decode_step" in vars(c))
        appending = next(c for c in mro if "after_append" in vars(c))
        return deferring is not Policy and mro.index(appending) >= mro.index(deferring)

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """Whether the policy defines its own `hook` (a method Policy gives a no-op or neutral default): the engine
        skips the work a default would make pointless. The engine asks once, at its start, so the answer depends on
        the class alone (Engine.set_policy keeps the class)."""
        return next(c for c in cls.__mro__ if hook in vars(c)) is not Policy

    def hooks_prefill(self) -> bool:
        """Whether the policy acts on a finished prompt (overrides after_prefill_layer): the engine then keeps each
        layer's prompt queries until the prompt's last chunk, and runs that chunk's step layer by layer."""
        return self.overrides("after_prefill_layer")

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        """Realized KV of the finished sequence: tokens kept per layer and KV head, resident device pages."""
        counts = kv.num_tokens[seq.slot]
        resident = (kv.block_table[seq.slot] != 0).sum(-1)
        out = {"policy": self.name, "mode": self.mode, "kept_tokens": counts.tolist(),
               "device_pages": int(resident.sum())}
        windowed = [layer for layer, w in enumerate(self.layer_windows) if w is not None]
        if windowed:                # what each layer type holds (layers left to their window keep only it)
            out.update(windowed_layers=self.windowed_layers, device_pages_windowed=int(resident[windowed].sum()),
                       device_pages_full=int(resident.sum()) - int(resident[windowed].sum()))
        return out
