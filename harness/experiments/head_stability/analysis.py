"""FlexiCache's head-stability analysis of top-K traces: TS windows, the unstable set, RCO by offset, overlaps.

Pure functions over the traces the `topk_trace` policy records (harness/experiments/head_stability runs them):
per non-overlapping window of W decode steps a head's TS is the mean random-corrected overlap of its top-K set with
the window's first set; the unstable set follows FlexiCache's final-set rule (systems.policy_support.selection).
On a hybrid model only the layers the policies manage count (the trace has no sets for layers left to their window):
the unstable share is a share of their heads.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from systems.policy_support import selection


def analyse(traces: list[dict], k: Any, num_layers: int, num_kv_heads: int,
            layers: Sequence[int] | None = None) -> dict[str, Any]:
    """TS windows of all samples, the unstable set, per-head statistics, promoted share, LServe proxy scores, over
    the heads of `layers` (default every layer)."""
    layers = list(range(num_layers)) if layers is None else list(layers)
    cols = torch.tensor([layer * num_kv_heads + h for layer in layers for h in range(num_kv_heads)])
    H, K, W = len(cols), k.top_k, k.window

    def name(h: int) -> list[int]:         # column h of the analysed heads -> [layer, head]
        return [layers[h // num_kv_heads], h % num_kv_heads]

    ts_all, promoted = [], []
    for tr in traces:
        sets = tr["sets"].long().view(-1, num_layers * num_kv_heads, K)[:, cols]
        n = tr["num_pages"]
        ts_all.append(selection.temporal_stability(sets, n, K, W))
        # a stable head's rerank every W steps promotes the pages new in its top-K
        starts = torch.arange(0, sets.shape[0] - W, W)
        for s in starts.tolist():
            if int(n[s]) > K and int(n[s + W]) > K:
                M = int(n[s + W])
                promoted.append(1 - selection.overlap(sets[s], sets[s + W], M).double() / K)
    rco_by_offset = rco_offsets(traces, num_layers * num_kv_heads, K, W, cols)
    ts = torch.cat(ts_all) if ts_all else torch.empty(0, H, dtype=torch.float64)
    count = k.unstable_count or int(math.floor(k.unstable_fraction * H + 0.5))
    # the official final set: most frequent in the bottom share on a random half of the windows, whose recall of
    # the other half's bottom sets is the consensus check
    heads, recall, baseline = selection.consensus_split(ts, count)
    _, freq = selection.unstable_by_frequency(ts, count)
    valid = ts[~torch.isnan(ts).any(-1)]
    unstable = torch.zeros(H, dtype=torch.bool)
    unstable[heads] = True
    share = torch.stack(promoted) if promoted else torch.empty(0, H, dtype=torch.float64)
    mass = torch.cat([tr["outside_mass"] for tr in traces]).view(-1, num_layers * num_kv_heads).double()
    head_stats = []
    for h in range(H):
        col = valid[:, h]
        layer, head = name(h)
        head_stats.append({"layer": layer, "head": head, "ts_mean": float(col.mean()),
                           "ts_std": float(col.std()) if col.numel() > 1 else 0.0, "ts_min": float(col.min()),
                           "bottom_frequency": int(freq[h]), "unstable": bool(unstable[h])})
    stable_share = share[:, ~unstable] if share.numel() else share
    return {
        "unstable_heads": [name(h) for h in heads], "unstable_count": count,
        "head_stats": head_stats, "windows": int(valid.shape[0]), "samples": len(traces),
        "consensus_recall": recall, "random_baseline": baseline,
        "promoted_share_stable": float(stable_share[~torch.isnan(stable_share)].mean()) if stable_share.numel()
        else None,
        "outside_mass": torch.nanmean(mass, 0).view(num_layers, num_kv_heads).nan_to_num(0.0).tolist(),
        "rco_by_offset": rco_by_offset,
    }


def rco_offsets(traces: list[dict], H: int, K: int, W: int, cols: torch.Tensor | None = None) -> list[list[float]]:
    """Mean RCO(S_s, S_{s+d}) per head for d = 1 .. W-1 over all window starts (FlexiCache F1): [W-1][H], or over
    the heads `cols` of the H traced."""
    if cols is not None:
        traces = [{**tr, "sets": tr["sets"].reshape(tr["sets"].shape[0], H, K)[:, cols]} for tr in traces]
        H = len(cols)
    sums = torch.zeros(W - 1, H, dtype=torch.float64)
    counts = torch.zeros(W - 1, H, dtype=torch.float64)
    for tr in traces:
        sets = tr["sets"].long().view(-1, H, K)
        n = tr["num_pages"]
        for s in range(0, sets.shape[0] - W + 1, W):
            for d in range(1, W):
                M = int(n[s + d])
                value = selection.rco(selection.overlap(sets[s], sets[s + d], M), K, n[s + d].expand(H))
                ok = ~torch.isnan(value)
                sums[d - 1] += value.nan_to_num(0.0)
                counts[d - 1] += ok.double()
    return (sums / counts.clamp(min=1)).masked_fill(counts == 0, float("nan")).tolist()


def overlap_table(named_sets: dict[str, list]) -> tuple[list[str], list[list[float]]]:
    """|A_i ∩ A_j| / |A| between the unstable sets of every pair of tasks (|A| the set size, equal across tasks)."""
    names = list(named_sets)
    sets = {n: {tuple(h) for h in named_sets[n]} for n in names}
    return names, [[len(sets[a] & sets[b]) / max(len(sets[a]), 1) for b in names] for a in names]
