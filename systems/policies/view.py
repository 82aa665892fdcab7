"""What a KV policy sees: a running sequence, a decode step, and the paged KV view it reads and changes.

Storage the view exposes (all tensors live on the engine's device; policies may read them and must change them only
through the view's methods, which keep the free lists, MinMax cache and byte counters consistent):

- pools of head-pages `k_pool`/`v_pool` (device tier) and `host_k_pool`/`host_v_pool`, each [blocks, P, D];
  one block = one page of one (layer, KV head); block 0 is the null block.
- `block_table` [S, L, Hkv, M] int32: logical page -> device block (0 = not resident); `host_table` the same
  for the host tier. A head's tokens are laid out in storage order through its logical pages 0, 1, ...; only its
  last page may be partial. `num_tokens` [S, L, Hkv] int32 counts the tokens each head holds (heads differ after
  eviction). Keys are stored post-RoPE at their original positions, so storage order need not be position order.
- `kmin`/`kmax` [S, L, Hkv, M, D]: elementwise min/max key of every logical page, resident or not, kept exact by
  the engine on every write (the partial last page included); `score_pages` turns them into Quest bounds with the
  engine's kernel (Triton on CUDA), so a policy needs no engine import to score.

Rules: GQA stays grouped (never store K/V per query head); savings must be physical (drop or offload through the
view so blocks are freed); a policy never imports engine modules; per-sequence state is keyed by slot and cleared in
`reset`. Selecting pages: `select_pages` returns logical page indices [B, Hkv, K] (entries < 0 are padding, no
duplicates, at least one page per row, every selected page resident); the engine reads only those pages. It may
instead return [B, Hq, K], one page set per query head (row h belongs to KV head h // G): each query head then
attends to its own pages only, and what the KV head reads from memory is the union of its group's sets. Returning
None means "all of the head's pages", which requires every page 0 .. ceil(num_tokens/P)-1 to be resident.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SeqInfo:
    """What a policy may know about one running sequence."""

    slot: int
    request_id: str
    # tokens the after-prefill hooks compressed: the prompt (plus earlier outputs after a preemption), or in
    # query-agnostic mode its context only
    prefill_len: int
    seq_len: int            # tokens the sequence has processed so far, including the one being decoded now
                            # (in after_extend_layer: including the appended rows)
    decode_step: int        # 0 during prefill, 1 at the first decode step, then 2, 3, ...
    max_new_tokens: int

    def pages(self, page_size: int) -> int:
        """Pages each head of this sequence spans under a policy that drops no token (every head then holds all
        seq_len tokens, resident or not): known on the host, where reading num_tokens would be a device op."""
        return -(-self.seq_len // page_size)


@dataclass
class DecodeStep:
    """One layer of one batched decode step, as seen by `select_pages` and `after_append`."""

    layer: int
    slots: torch.Tensor     # [B] int64 slots of the batch, on the engine's device
    seqs: list[SeqInfo]     # the same B sequences, in order
    q: torch.Tensor         # [B, Hq, D] post-RoPE queries of the new token
    # a step of several layers at once (DecodeLayers.rows, for a policy's after_decode_step): the layer of each row,
    # whose slots, seqs and q then list one row per (layer, sequence); `layer` is then -1
    layers: torch.Tensor | None = None

    @property
    def at(self) -> int | torch.Tensor:
        """What indexes [slots, layers, ...] storage beside `slots`: the layer, or each row's layer."""
        return self.layer if self.layers is None else self.layers

    def rows_at(self, rows: torch.Tensor, repeat: int = 1) -> int | torch.Tensor:
        """`at` for the listed rows, each repeated `repeat` times in a row (e.g. once per KV head)."""
        return self.layer if self.layers is None else self.layers[rows].repeat_interleave(repeat)


@dataclass
class DecodeLayers:
    """Every layer of one batched decode step at once, as seen by `after_decode_step`."""

    slots: torch.Tensor     # [B] int64 slots of the batch, on the engine's device
    seqs: list[SeqInfo]     # the same B sequences, in order
    # [L, B, Hq, D] each layer's post-RoPE queries of the new token (the q its DecodeStep would carry), for a
    # policy with `step_queries`; None otherwise. Rows of layers the policy does not manage hold their queries too.
    q: torch.Tensor | None

    def rows(self, layers: tuple[int, ...]) -> DecodeStep:
        """The listed layers' rows as one DecodeStep: a row per (layer, sequence), layer-major (the order the
        per-layer hooks run in), `layers` giving each row's layer; q is empty when this step carries none."""
        b, dev = len(self.seqs), self.slots.device
        index = torch.tensor(layers, device=dev)
        q = self.q[index].flatten(0, 1) if self.q is not None else torch.empty(0, device=dev)
        return DecodeStep(layer=-1, slots=self.slots.repeat(len(layers)), seqs=self.seqs * len(layers), q=q,
                          layers=index.repeat_interleave(b))


@dataclass(frozen=True)
class PageRule:
    """A decode step's page choice stated as data, for an engine that runs it inside its own step instead of calling
    `select_pages` between a layer's halves (Policy.decode_page_rule). At each layer in `layers`, the sets are what
    KVView.ranked_pages(slots, layer, q, k, heads, width) returns (ranked) or KVView.top_pages(slots, layer, q, k[0],
    keep_last, heads, width) (not ranked), for that layer's queries after the new token's append, or beside `held`
    sets, those sets with the scored heads' top pages in front; every other layer reads all it holds. Running the
    rule must equal select_pages answering those sets at those layers."""

    layers: tuple[int, ...]     # the layers whose pages the rule chooses, ascending
    k: list[int]                # pages per head of each sequence of the step, in order (top: all equal)
    heads: torch.Tensor         # [sets] the KV head each page set scores: one set per KV head or per query head
    width: int                  # pages scored per head (the most any sequence of the step holds)
    ranked: bool = True         # best first, ties to the lower page; False: top_pages' ascending sets
    keep_last: bool = True      # top_pages only: the last page always read
    # Sets partly held rather than scored (top_pages, one set per KV head): at each of `layers` every KV head reads
    # its row of held[layer] [B, Hkv, held_widths[layer]] (PAD-padded), except the heads scored[layer] marks, whose
    # top k[0] pages fill the front of their rows (held there: PAD, the width at least theirs)
    held: torch.Tensor | None = None          # [L, B, Hkv, W] int64
    held_widths: tuple[int, ...] = ()         # per layer
    scored: torch.Tensor | None = None        # [L, Hkv] bool

    def sets_shape(self, batch: int) -> tuple[int, int, int]:
        """[B, sets, K] of one layer's answer (beside held sets: K is held's, a narrower layer's rows end in PAD)."""
        if self.held is not None:
            return batch, self.heads.numel(), self.held.shape[-1]
        return batch, self.heads.numel(), min(max(self.k) if self.ranked else self.k[0], self.width)

    def scored_sets(self) -> int:
        """Page sets the rule scores over a step, summed over its layers (what its MinMax reads scale with)."""
        if self.scored is not None:
            return int(self.scored[list(self.layers)].sum())
        return len(self.layers) * self.heads.numel()


class KVDims(Protocol):
    """The model's attention shape and the engine's paging: what a policy may know before any storage exists."""

    page_size: int                      # tokens per page: the engine's (engine.page_size), read by every policy
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_pages: int                      # M: logical pages per (seq, layer, KV head)
    device: torch.device
    dtype: torch.dtype
    scale: float                        # softmax scale of the model's attention (1/sqrt(head_dim))
    layer_windows: tuple[int | None, ...]   # each layer's sliding window, None for full attention
    # the model's name as its runner knows it (the harness: model.name), or None: a profile made on another model is
    # refused by it; read with getattr, as dims made outside the engine and the harness may not carry it
    model_name: str | None


class KVView(KVDims, Protocol):
    """The engine's KV storage as a policy sees it (implemented by the engine's tiered KV cache)."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    host_k_pool: torch.Tensor
    host_v_pool: torch.Tensor
    block_table: torch.Tensor
    host_table: torch.Tensor
    num_tokens: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor

    def free_device_blocks(self) -> int:
        """Free blocks in the device tier now."""

    def free_host_blocks(self) -> int:
        """Free blocks in the host tier now."""

    def gather_tokens(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, counts) of the given sequences' resident tokens in storage order: k, v [B, Hkv, N, D] (N = the
        largest count, padding zeroed), counts [B, Hkv] int64. Reads device pages; a non-resident page reads zeros."""

    def attention_probs(self, slots: torch.Tensor, layer: int | torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The decode queries' attention over every token their KV heads hold (every page resident), in storage
        order, for a decode-time eviction's scores: q [R, Hq, D] of the rows (slots[i], layer or layer[i]) ->
        fp32 [R, Hq, N] (N = the most tokens a listed head holds), exactly 0 past a head's count. Each row is
        computed alone: its probabilities depend on neither the other rows nor the thread count."""

    def pooled_victims(self, probs: torch.Tensor, counts: torch.Tensor, key: torch.Tensor, window: int, kernel: int,
                       pooling: str, new_keys: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode-time eviction's victims by attention pooled along an order of the tokens, with the engine's
        kernel: per (row, KV head) of `probs` [R, Hq, N] (attention_probs), the tokens ranked by `key` [R, Hkv, N]
        ascending, the group's probabilities pooled along those ranks (pooling avgpool | maxpool | none, kernel,
        stride 1, zero padding kernel // 2) with the last `window` ranks of its count [R, Hkv] zeroed, averaged over
        the group; the victim is the first lowest of the ranks below count - window. Returns the victims' storage
        indices [R, Hkv] and, with new_keys, each token's place in a stable descending order of its pooled score
        (the window keeping its rank) [R, Hkv, N] fp32."""

    def score_pages(self, slots: torch.Tensor, layer: int, q: torch.Tensor, heads: torch.Tensor | None = None,
                    width: int | None = None) -> torch.Tensor:
        """Quest upper bounds from the MinMax cache, every page resident or not: [B, H, W] fp32 for the KV heads
        `heads` (default all) of the sequences in `slots`; W = `width` or the most pages any listed head holds;
        pages a head does not hold score -inf. q: [B, H*G, D], the queries of those heads' groups in order; a KV
        head's score is the max over its query group of sum_d max(q_d*kmin_d, q_d*kmax_d). The engine's kernel
        reads the cache in place (Triton on CUDA, C++ on CPU)."""

    def ranked_pages(self, slots: torch.Tensor, layer: int, q: torch.Tensor, k: list[int],
                     heads: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """The k[b] pages score_pages' bounds rank best for each listed head of sequence b, the last page competing
        like any other: [B, H, min(max k, W)] int64, best first, ties to the lower page, padded with -1 past k[b]
        and past a head's pages (what a stable descending sort of score_pages gives, without the score tensor)."""

    def top_pages(self, slots: torch.Tensor, layer: int, q: torch.Tensor, k: int, keep_last: bool = True,
                  heads: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """The page sets score_pages' bounds rank best, without the score tensor: [B, H, min(k, W)] int64, any
        order, padded with -1. keep_last: each head's last page plus its k - 1 best other pages (every page when it
        holds <= k); otherwise the k best pages excluding the last. Ties may resolve either way."""

    def resident_pages(self, slots: torch.Tensor, layer: int, heads: torch.Tensor | None = None,
                       appending: int = 0) -> torch.Tensor:
        """The logical pages each listed head holds on the device: [B, H, W] int64, ascending, padded with -1 (W =
        the longest list, at least 1) — a select_pages answer for heads that read everything they hold. `appending`:
        as they will hold once that many more tokens are appended (their pages already reserved), for a page rule
        stated before the step's append."""

    def keep_tokens(self, slot: int, layer: int, keep: list[torch.Tensor]) -> None:
        """Evict for good: head h keeps only the storage indices keep[h] (1-D int, ascending, unique), compacted into
        its leading pages; surplus device (and host) blocks are freed and MinMax recomputed. Heads may keep different
        counts (>= 1). The head must be fully resident."""

    def drop_tokens(self, slots: torch.Tensor, layer: int | torch.Tensor, heads: torch.Tensor,
                    index: torch.Tensor) -> None:
        """Decode-time eviction, batched: entry i removes storage index index[i] of head (slots[i], layer, heads[i])
        by moving that head's last token into the hole (policies mirror this move in their per-token state); the
        last page's block is freed when it empties. At most one entry per head per call. The head's last page and
        the hole's page must be resident. `layer` may be one per entry ([E], entries sorted by layer): the same as
        one call per layer in ascending order."""

    def offload_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor,
                      pages: torch.Tensor) -> None:
        """Copy the listed resident pages device -> host (1-D tensors, one entry per page); host blocks are
        allocated and host_table set; the device copies stay until released. Asynchronous on CUDA."""

    def release_device_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor,
                             pages: torch.Tensor) -> None:
        """Free the device blocks of the listed pages (block_table -> 0). A page without a host copy is gone for
        good: it must never be selected again (its MinMax entry stays, its tokens stay counted in num_tokens)."""

    def promote_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor,
                      recycle: torch.Tensor | None = None) -> None:
        """Copy the listed pages host -> device. With `recycle` (logical pages of the same (slot, layer, head),
        one per entry, resident), each incoming page takes over the device block of its recycle page, whose
        block_table entry becomes 0 (block recycling); without it fresh device blocks are allocated.
        Asynchronous on CUDA: the engine pauses the sequence until the copy lands; see `sync_copies`."""

    def pause(self, slot: int) -> None:
        """Skip this sequence in the current decode step (when called from begin_decode_step) or the next one."""

    def sync_copies(self) -> None:
        """Wait for every in-flight tier copy (no-op on CPU, where copies are synchronous)."""


def block_bytes(page_size: int, head_dim: int, element_bytes: int) -> int:
    """Bytes of one KV block: K and V of one page of one (layer, KV head). The one place this formula lives."""
    return 2 * page_size * head_dim * element_bytes
