"""Budget allocation: CAKE's adjust_budgets on hand-computed cases, PyramidKV's three regimes, CAKE preference."""
from __future__ import annotations

import pytest
import torch

from systems.policy_support import allocation as alloc


@pytest.mark.parametrize("raw, total, cap, expect", [
    # truncation loses 2 tokens; the remainder goes +1 to the lowest-numbered layers
    ([10.7, 20.2, 30.9, 38.2], 100, 1000, [11, 21, 30, 38]),
    # two layers capped at 40: their excess 13 goes to layer 0, then the truncation loss 2 as well
    ([5.5, 50.9, 43.6], 100, 40, [20, 40, 40]),
    # sum above total: subtract 10 // 3 = 3 from every layer above 1, remainder 1 from layer 0
    ([30.0, 30.0, 30.0], 80, 100, [26, 27, 27]),
    # every layer capped: nothing can take the excess, budgets stay at the cap
    ([300.0, 300.0], 600, 50, [50, 50]),
])
def test_adjust_budgets_hand_computed(raw, total, cap, expect):
    out = alloc.adjust_budgets(raw, total, cap)
    assert out == expect
    assert all(isinstance(b, int) for b in out)
    if cap * len(raw) >= total:
        assert sum(out) == total and max(out) <= cap


def test_adjust_budgets_official_overflow_quirk():
    """As cakekv's utils.py: the spread of a capped layer's excess is not re-capped (layer 2 ends at 115 > 100); the
    eviction-time clamp then keeps 100, which is what the policy records as realized."""
    assert alloc.adjust_budgets([150.0, 60.0, 90.0], 300, 100) == [100, 85, 115]


def test_preference_budgets_sum_exact_on_random_preferences():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        layers = int(torch.randint(2, 40, (1,), generator=g))
        per_layer = int(torch.randint(8, 600, (1,), generator=g))
        prefs = (torch.rand(layers, generator=g, dtype=torch.float64) ** 3).tolist()
        total = per_layer * layers
        out = alloc.preference_budgets(prefs, total, cap=10_000)
        assert sum(out) == total and min(out) >= 0
        exact = [p / sum(prefs) * total for p in prefs]
        assert all(abs(b - e) <= 1.0 + 1e-9 for b, e in zip(out, exact))     # rounding moves at most one token


def test_pyramid_three_regimes():
    # C 64, S_w 8, L 4, beta 20: base 56, min 56 // 20 = 2, max 2 * 56 - 2 = 110, steps (110 - 2) // 3 = 36
    assert alloc.pyramid_budgets(60, 64, 8, 4) is None                               # n < C: no compression
    assert alloc.pyramid_budgets(100, 64, 8, 4) == [56, 56, 56, 56]                  # n < 2 (C - S_w): SnapKV
    assert alloc.pyramid_budgets(1000, 64, 8, 4) == [110, 74, 38, 2]                 # the pyramid
    # max_num >= n - S_w (115 - 8 = 107): re-anchored max 107, min 112 - 107 = 5, steps 34
    assert alloc.pyramid_budgets(115, 64, 8, 4) == [107, 73, 39, 5]


def test_uniform_random_and_tau_table():
    assert alloc.uniform_budgets(24, 3) == [24, 24, 24]
    a = alloc.random_budgets(8, 800, 10_000, seed=3)
    assert a == alloc.random_budgets(8, 800, 10_000, seed=3) and sum(a) == 800
    assert a != alloc.random_budgets(8, 800, 10_000, seed=4)
    assert alloc.cake_tau("llama3.1-8b-128k", 1024) == (1.6, 0.4)
    assert alloc.cake_tau("qwen2.5-7b-instruct", 128) == (0.4, 0.6)
    assert alloc.cake_tau("smollm2-135m-instruct", 1024) == (1.0, 1.0)
    assert alloc.cake_tau("llama3.1-8b-128k", 256) == (1.0, 1.0)


def test_layer_preference_against_loops():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(3, 4, 6, generator=g, dtype=torch.float64)
    a = a / a.sum(-1, keepdim=True) * 0.7                                    # window rows, not renormalized
    entropy = 0.0
    variance = 0.0
    for h in range(3):
        for j in range(6):
            col = [float(a[h, i, j]) for i in range(4)]
            entropy -= sum(x * torch.log(torch.tensor(x + 1e-10, dtype=torch.float64)).item() for x in col)
            mean = sum(col) / 4
            variance += sum((x - mean) ** 2 for x in col) / 3
    for tau1, tau2 in [(1.0, 1.0), (1.6, 0.4)]:
        expect = entropy ** (1 / tau1) * variance ** (1 / tau2)
        assert alloc.layer_preference(a, tau1, tau2) == pytest.approx(expect, rel=1e-5)


def test_block_bounds():
    # page 4, 2 heads: layers keep 10, 6, 6 tokens (3, 2, 2 pages); the 30-token layer being stored takes 8 pages
    assert alloc.prefill_blocks_bound(30, [10, 6, 6], 4, 2) == 2 * (3 + 2 + 8)
    # cascading: total 24 + 3 layers * window 2 = 30 tokens -> 8 pages, + 3 per-layer roundings, + 8 for the new layer
    assert alloc.cascading_blocks_bound(30, 24, 2, 3, 4, 2) == 2 * (8 + 3 + 8)
