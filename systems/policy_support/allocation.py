"""Per-layer KV budget allocation: uniform, PyramidKV's pyramid, random, and CAKE's preference-prioritized budgets.

Every function returns the number of *non-window* tokens each layer keeps (the S_w observation window is kept on top
of it, as in SnapKV, PyramidKV and CAKE). Budgets are plain Python ints so tests can check them by hand.

CAKE (antgroup/cakekv `cake/utils.py`, `cake/cake_cache.py`): a layer's preference is P_l = H^(1/tau1) * V^(1/tau2)
of its window attention; B_l = P_l / sum(P) * total with total = (cache_size - S_w) * L, then `adjust_budgets`
repairs the integer rounding exactly as the official code does (truncate, cap + redistribute, repair the sum).
"""
from __future__ import annotations

import math

import torch

ALLOCATIONS = ("preference", "uniform", "pyramid", "random")

# CAKE's official (tau1, tau2) per (model, cache_size) (`experiments/LongBench/config/model2tau.json`);
# any other (model, budget) falls back to (1.0, 1.0) as `pred_cake.py` does.
CAKE_TAU = {
    ("llama3.1-8b-128k", 1024): (1.6, 0.4), ("llama3.1-8b-128k", 128): (1.6, 0.6),
    ("llama2-7b-chat-4k", 1024): (1.9, 1.8), ("llama2-7b-chat-4k", 128): (0.9, 2.3),
    ("llama2-13b-chat-4k", 1024): (0.5, 0.4), ("llama2-13b-chat-4k", 128): (1.8, 2.0),
    ("mistral-0.3-7b-32k", 1024): (0.8, 0.5), ("mistral-0.3-7b-32k", 128): (1.0, 0.8),
    ("qwen2.5-7b-instruct", 1024): (1.5, 0.6), ("qwen2.5-7b-instruct", 128): (0.4, 0.6),
}


def cake_tau(model: str | None, cache_size: int) -> tuple[float, float]:
    """(tau1, tau2) from CAKE's table, (1.0, 1.0) when the (model, budget) pair is not in it."""
    return CAKE_TAU.get((model or "", cache_size), (1.0, 1.0))


def _spread(budgets: list[int], amount: int, valid: list[bool], sign: int) -> None:
    """Add (sign=+1) or subtract amount // n_valid to every valid layer, the remainder 1 each to the lowest-numbered."""
    idx = [i for i, ok in enumerate(valid) if ok]
    if not idx:
        return
    each, rem = divmod(amount, len(idx))
    for j, i in enumerate(idx):
        budgets[i] += sign * (each + (1 if j < rem else 0))


def adjust_budgets(budgets: list[float], total: int, cap: int) -> list[int]:
    """CAKE's integer repair: truncate toward zero, cap at `cap` (= n - S_w) spreading the clamped excess over the
    layers still below the cap, then add/subtract the difference to `total` over the layers that can take it. As in the
    official code the last step does not re-cap, so a budget may exceed `cap`; callers clamp at eviction time."""
    out = [int(b) for b in budgets]                     # numpy dtype=int truncation
    excess = sum(max(b - cap, 0) for b in out)
    out = [min(b, cap) for b in out]
    if excess > 0:
        _spread(out, excess, [b < cap for b in out], +1)
    diff = total - sum(out)
    if diff > 0:
        _spread(out, diff, [b < cap for b in out], +1)
    elif diff < 0:
        _spread(out, -diff, [b > 1 for b in out], -1)
    return out


def preference_budgets(prefs: list[float], total: int, cap: int) -> list[int]:
    """B_l = P_l / sum(P) * total over the given layers, repaired by `adjust_budgets`."""
    norm = sum(prefs)
    if not norm > 0:                                   # all-zero preference (degenerate attention): split evenly
        raw = [total / len(prefs)] * len(prefs)
    else:
        raw = [p / norm * total for p in prefs]
    return adjust_budgets(raw, total, cap)


def uniform_budgets(per_layer: int, num_layers: int) -> list[int]:
    return [per_layer] * num_layers


def pyramid_budgets(n: int, capacity: int, window: int, num_layers: int, beta: int = 20) -> list[int] | None:
    """PyramidKV (`PyramidKVCluster.update_kv`): None when n < capacity (no compression); the uniform SnapKV budget
    capacity - window when n < 2 (capacity - window); otherwise max_num - l * steps for layer l (lower layers keep
    more), with min_num = (C - S_w) // beta, max_num = 2 (C - S_w) - min_num, both re-anchored when max_num reaches
    n - S_w, and steps = (max_num - min_num) // (L - 1)."""
    if n < capacity:
        return None
    base = capacity - window
    if n < 2 * base:
        return uniform_budgets(base, num_layers)
    min_num = base // beta
    max_num = 2 * base - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = 2 * base - max_num
    steps = (max_num - min_num) // max(num_layers - 1, 1)
    return [max_num - layer * steps for layer in range(num_layers)]


def random_budgets(num_layers: int, total: int, cap: int, seed: int) -> list[int]:
    """CAKE's random-allocation ablation: preferences drawn uniformly from a generator seeded by `seed` alone, so every
    sample (and every rerun) gets the same allocation, then the same proportional split and repair as CAKE."""
    g = torch.Generator().manual_seed(seed)
    prefs = torch.rand(num_layers, generator=g, dtype=torch.float64).tolist()
    return preference_budgets(prefs, total, cap)


def layer_preference(window_attn: torch.Tensor, tau1: float, tau2: float) -> float:
    """CAKE's P_l from window attention A_w [Hq, S_w, n - S_w] (window queries x prefix keys, rows not renormalized):
    H = -sum A log(A + 1e-10) over heads, queries and keys; V = sum over heads and keys of the unbiased variance
    across the window queries; P = H^(1/tau1) * V^(1/tau2)."""
    a = window_attn.float()
    entropy = -(a * torch.log(a + 1e-10)).sum()
    variance = a.var(dim=1).sum() if a.shape[1] > 1 else a.new_zeros(())
    return float(entropy.clamp(min=0) ** (1.0 / tau1) * variance ** (1.0 / tau2))


def prefill_blocks_bound(prompt_len: int, kept_per_layer: list[int], page_size: int, num_kv_heads: int) -> int:
    """Device blocks a layer-by-layer prefill eviction can hold at once: the earlier layers at their kept sizes (each
    head's pages rounded up) plus one whole layer just stored at full length."""
    pages = lambda t: -(-t // page_size)  # noqa: E731
    held = sum(pages(min(t, prompt_len)) for t in kept_per_layer) - pages(min(min(kept_per_layer), prompt_len))
    return num_kv_heads * (held + pages(prompt_len))


def cascading_blocks_bound(prompt_len: int, total: int, window: int, num_layers: int, page_size: int,
                           num_kv_heads: int) -> int:
    """CAKE with cascading: the seen layers together never hold more than total + L * S_w tokens (their budgets sum to
    `total`), each head's pages round up once per layer, plus the layer being stored at full length."""
    kept = min(total + num_layers * window, num_layers * prompt_len)
    return num_kv_heads * (math.ceil(kept / page_size) + num_layers + math.ceil(prompt_len / page_size))
