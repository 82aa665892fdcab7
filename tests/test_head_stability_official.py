"""The unstable-head profiler against FlexiCache's analysis procedure, re-stated here step by step on fixed windows.

The reference below restates the facts of TopK-Analysis (stability.py, analyze_head_stability.py) on its own:
N_t = ceil((prompt + t) / page_size); per window of W steps a [heads, W-1] fp32 RCO row against the window's first
set, clamped at 0, instability = 1 - its mean; a window's unstable set = torch.topk of the instabilities; the sets
of all windows shuffled by Python's `random` seeded 43; frequencies over the first half ranked by np.argsort of
their negation; recall over the second half. The traces are built so that ties decide the answer: many heads at
instability exactly 1 (no better than chance) or 0 (never changing), and equal frequencies at the cut.
"""
from __future__ import annotations

import math
import random

import numpy as np
import torch

from systems.policy_support import selection

LAYERS, KV_HEADS, K, W, PAGE = 30, 3, 8, 16, 16
HEADS = LAYERS * KV_HEADS
M = math.floor(0.25 * HEADS + 0.5)                   # FlexiCache's 25 %: 23 of SmolLM2's 90 KV heads


def fixed_traces(samples: int = 7, steps: int = 48) -> list[tuple[torch.Tensor, int]]:
    """(trace [T, L, H, K], prompt length) per sample: frozen heads, jumping heads and heads in between."""
    rng = random.Random(20260107)
    out = []
    for _ in range(samples):
        prompt = rng.randint(600, 900)
        trace = torch.empty(steps, HEADS, K, dtype=torch.long)
        for h in range(HEADS):
            kind = h % 3
            pages = math.ceil((prompt + 1) / PAGE)
            current = rng.sample(range(pages), K)
            start, jumping = current, True
            for t in range(steps):
                n = math.ceil((prompt + t + 1) / PAGE)
                if kind == 1:    # in most windows jump: a fresh set at the start, then sets disjoint from it
                    if t % W == 0:
                        jumping = rng.random() < 0.85
                        current = start = rng.sample(range(n), K)
                    elif jumping:
                        current = rng.sample([p for p in range(n) if p not in start], K)
                elif kind == 2 and rng.random() < 0.3:                          # drift by one page
                    current = current[1:] + [rng.choice([p for p in range(n) if p not in current])]
                trace[t, h] = torch.tensor(current)
        out.append((trace.view(steps, LAYERS, KV_HEADS, K), prompt))
    return out


def reference_procedure(traces: list[tuple[torch.Tensor, int]]) -> tuple[list[int], float, list[set], np.ndarray]:
    window_sets: list[set] = []
    for trace, prompt in traces:
        steps = trace.shape[0]
        n_pages = np.ceil((prompt + np.arange(1, steps + 1, dtype=np.int64)) / PAGE)
        width = int(n_pages.max())
        masks = torch.zeros((HEADS, steps, width), dtype=torch.bool)
        flat = trace.view(steps, HEADS, K)
        for t in range(steps):
            for h in range(HEADS):
                masks[h, t, flat[t, h]] = True
        n_float = torch.as_tensor(n_pages, dtype=torch.float32)
        starts = list(range(0, steps - W + 1, W))
        instability = torch.empty((len(starts), HEADS), dtype=torch.float32)
        for i, s in enumerate(starts):
            shared = (masks[:, s, :].unsqueeze(1) & masks[:, s + 1:s + W, :]).sum(dim=2, dtype=torch.int32)
            share = shared.to(torch.float32) / float(K)
            chance = float(K) / n_float[s + 1:s + W]
            rco = ((share - chance) / (1.0 - chance)).clamp(min=0.0)
            instability[i] = 1.0 - rco.mean(dim=1)
        top = torch.topk(instability, k=M, dim=1, largest=True, sorted=False).indices
        window_sets += [set(row.tolist()) for row in top]
    shuffled = list(window_sets)
    random.Random(43).shuffle(shuffled)
    first, second = shuffled[:len(shuffled) // 2], shuffled[len(shuffled) // 2:]
    counts = np.zeros(HEADS, dtype=np.int64)
    for s in first:
        for h in s:
            counts[h] += 1
    top_m = sorted(np.argsort(-counts).tolist()[:M])
    recall = float(np.mean([len(s & set(top_m)) / M for s in second]))
    return top_m, recall, window_sets, counts


def profiler(traces: list[tuple[torch.Tensor, int]]) -> tuple[list[int], float, torch.Tensor]:
    """The project's path: the trace policy's layout [T, L*H, K] with N_t per step, then selection."""
    ts = []
    for trace, prompt in traces:
        steps = trace.shape[0]
        num_pages = torch.tensor([math.ceil((prompt + t) / PAGE) for t in range(1, steps + 1)])
        ts.append(selection.temporal_stability(trace.view(steps, HEADS, K), num_pages, K, W))
    windows = torch.cat(ts)
    heads, recall, _ = selection.consensus_split(windows, M)
    return heads, recall, windows


def test_profiler_reproduces_the_official_procedure_on_fixed_windows():
    traces = fixed_traces()
    want_heads, want_recall, want_sets, counts = reference_procedure(traces)
    heads, recall, windows = profiler(traces)
    assert heads == want_heads
    assert recall == want_recall
    # the per-window sets are the official ones, and the instabilities bit for bit
    got_sets = [set(torch.nonzero(row).view(-1).tolist()) for row in selection.bottom_sets(windows, M)]
    assert got_sets == want_sets
    # the fixture exercises ties: more than M heads at instability exactly 1 in a window, and equal frequencies
    # across the cut of the first half's ranking
    assert int(((1.0 - windows) == 1.0).sum(-1).max()) > M
    ordered = sorted(counts.tolist(), reverse=True)
    assert ordered[M - 1] == ordered[M]
