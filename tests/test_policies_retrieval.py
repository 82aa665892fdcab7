"""Retrieval-policy kernels against brute-force references: page scores, top-K sets, swap maps, RCO and TS."""
from __future__ import annotations

import itertools

import pytest
import torch

from systems.engine.ops.torch_scoring import rank_scores
from systems.policy_support import selection


def brute_scores(q, kmin, kmax, num_pages):
    B, Hq, D = q.shape
    Hkv, M = kmin.shape[1], kmin.shape[2]
    G = Hq // Hkv
    out = torch.full((B, Hkv, M), float("-inf"), dtype=torch.float64)
    for b, g, m in itertools.product(range(B), range(Hkv), range(M)):
        if m >= num_pages[b, g]:
            continue
        best = max(sum(max(float(q[b, h, d] * kmin[b, g, m, d]), float(q[b, h, d] * kmax[b, g, m, d]))
                       for d in range(D)) for h in range(g * G, (g + 1) * G))
        out[b, g, m] = best
    return out


def test_page_scores_equal_brute_force_on_random_tensors():
    torch.manual_seed(0)
    B, Hq, Hkv, M, D = 2, 6, 3, 7, 5
    q = torch.randn(B, Hq, D)
    a, b = torch.randn(B, Hkv, M, D), torch.randn(B, Hkv, M, D)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    num_pages = torch.tensor([[7, 3, 1], [5, 7, 2]])
    got = selection.page_scores(q, kmin, kmax, num_pages).double()
    want = brute_scores(q, kmin, kmax, num_pages)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], atol=1e-5)


def brute_topk_with_last(scores, n, k):
    if n <= k:
        return set(range(n))
    others = sorted(range(n - 1), key=lambda m: (-float(scores[m]), m))[:k - 1]
    return set(others) | {n - 1}


@pytest.mark.parametrize("k", [1, 3, 5, 9])
def test_topk_with_last_matches_brute_force(k):
    torch.manual_seed(k)
    B, H, M = 3, 2, 8
    scores = torch.randn(B, H, M)
    num_pages = torch.randint(1, M + 1, (B, H))
    scores = scores.masked_fill(torch.arange(M) >= num_pages.unsqueeze(-1), float("-inf"))
    chosen = selection.topk_with_last(scores, num_pages, k)
    for b, h in itertools.product(range(B), range(H)):
        row = [int(p) for p in chosen[b, h] if p >= 0]
        assert len(row) == len(set(row))
        assert set(row) == brute_topk_with_last(scores[b, h], int(num_pages[b, h]), k)


def test_ranked_pages_take_each_sequences_k_best_pages_last_page_included():
    torch.manual_seed(3)
    B, H, M = 3, 2, 9
    scores = torch.randn(B, H, M)
    num_pages = torch.tensor([[9, 9], [4, 4], [6, 6]])
    scores = scores.masked_fill(torch.arange(M) >= num_pages.unsqueeze(-1), float("-inf"))
    scores[0, 0, 8] = 100.0                                           # a last page that scores best is taken ...
    scores[0, 1, 8] = -100.0                                          # ... one that scores worst is not
    k = torch.tensor([3, 5, 2])
    chosen = rank_scores(scores, k)
    for b, h in itertools.product(range(B), range(H)):
        n = int(num_pages[b, h])
        want = set(sorted(range(n), key=lambda m: (-float(scores[b, h, m]), m))[:min(int(k[b]), n)])
        assert {int(p) for p in chosen[b, h] if p >= 0} == want
    assert 8 in chosen[0, 0].tolist() and 8 not in chosen[0, 1].tolist()
    # a sequence's pages do not depend on its batch mates
    alone = rank_scores(scores[2:], k[2:])
    assert torch.equal(alone[0, :, :2], chosen[2, :, :2])


def test_compact_merge_and_masks_round_trip():
    mask = torch.tensor([[True, False, True, True], [False, False, False, True]])
    pages = selection.compact(mask)
    assert pages.tolist() == [[0, 2, 3], [3, -1, -1]]
    assert torch.equal(selection.as_mask(pages, 4), mask)
    union = selection.merge(torch.tensor([[0, -1]]), torch.tensor([[3, 0]]), 4)
    assert union.tolist() == [[0, 3]]


def test_swap_map_and_recycling_pairs_move_exactly_the_set_difference():
    torch.manual_seed(1)
    R, M = 6, 12
    resident = torch.zeros(R, M, dtype=torch.bool)
    selected = torch.zeros(R, M, dtype=torch.bool)
    for r in range(R):
        resident[r, torch.randperm(M)[:5]] = True
        selected[r, torch.randperm(M)[:4]] = True
    incoming, evicted = selection.swap_map(resident, selected)
    row, page, recycle, left_row, left_page = selection.pair_for_recycling(incoming, evicted)
    for r in range(R):
        old, new = set(resident[r].nonzero().view(-1).tolist()), set(selected[r].nonzero().view(-1).tolist())
        assert set(page[row == r].tolist()) == new - old
        recycled = recycle[row == r].tolist()
        freed = left_page[left_row == r].tolist()
        assert len(set(recycled)) == len(recycled) and set(recycled) | set(freed) == old - new
        assert not set(recycled) & set(freed)


def test_rco_on_hand_made_sets():
    # K = 2 of N = 4 pages: chance overlap K/N = 0.5; identical sets -> 1, one shared page -> 0, disjoint -> 0
    k, n = 2, torch.tensor(4)
    assert float(selection.rco(torch.tensor(2), k, n)) == 1.0
    assert float(selection.rco(torch.tensor(1), k, n)) == 0.0
    assert float(selection.rco(torch.tensor(0), k, n)) == 0.0
    # K = 2 of N = 8: chance 0.25; one shared page -> (0.5 - 0.25) / 0.75 = 1/3
    assert abs(float(selection.rco(torch.tensor(1), k, torch.tensor(8))) - 1 / 3) < 1e-12
    assert torch.isnan(selection.rco(torch.tensor(2), k, torch.tensor(2)))   # N_t <= K: undefined


def test_temporal_stability_on_a_hand_made_trace():
    # W = 3, K = 2, N = 8 at every step; head 0 never changes (TS 1), head 1 keeps one page each step (TS 1/3),
    # head 2 jumps to disjoint pages (TS 0); window 2 is cut off (T = 7)
    W, k = 3, 2
    h0 = [[0, 1]] * 7
    h1 = [[0, 1], [0, 2], [1, 3], [4, 5], [4, 6], [5, 7], [0, 1]]
    h2 = [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5], [6, 7]]
    trace = torch.tensor([h0, h1, h2]).transpose(0, 1)              # [T, H, K]
    ts = selection.temporal_stability(trace, torch.full((7,), 8), k, W)
    assert ts.shape == (2, 3) and ts.dtype == torch.float32
    assert torch.allclose(ts, torch.tensor([[1.0, 1 / 3, 0.0], [1.0, 1 / 3, 0.0]]))
    # a window with a step where N_t <= K is undefined
    n = torch.full((7,), 8)
    n[4] = 2
    assert torch.isnan(selection.temporal_stability(trace, n, k, W)[1]).all()


def test_unstable_by_frequency_and_consensus_on_hand_made_windows():
    ts = torch.tensor([[0.9, 0.1, 0.5, 0.2], [0.8, 0.3, 0.1, 0.9], [0.9, 0.2, 0.6, 0.1], [0.7, 0.1, 0.3, 0.8]])
    heads, freq = selection.unstable_by_frequency(ts, 2)
    assert freq.tolist() == [0, 4, 2, 2]
    assert heads[0] == 1 and heads[1] in (2, 3)                       # 2 and 3 tie on frequency
    chosen, recall, baseline = selection.consensus_split(ts, 2)
    assert 0.0 <= recall <= 1.0 and baseline == 0.5 and len(chosen) == 2
    with pytest.raises(ValueError, match="two complete stability windows"):
        selection.consensus_split(ts[:1], 2)
    with pytest.raises(ValueError, match="no complete stability window"):
        selection.unstable_by_frequency(torch.full((2, 3), torch.nan), 1)


def test_lserve_streaming_split_takes_the_global_low_quantile():
    from systems.policies.lserve import streaming_split
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3]])
    assert sorted(streaming_split(scores, 0.5)) == [(0, 1), (1, 0), (1, 2)]
    assert streaming_split(scores, 0.0) == []
    ties = torch.zeros(2, 2)                                          # the seeded noise still splits ties in half
    assert len(streaming_split(ties, 0.5)) == 2


def test_lserve_streaming_split_over_the_layers_it_manages():
    from systems.policies.lserve import streaming_split
    # a hybrid model's windowed layer 1 holds the lowest scores: over all layers they would take the streaming half
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.0, 0.0, 0.0], [0.2, 0.8, 0.3]])
    assert sorted(streaming_split(scores, 0.5)) == [(0, 1), (1, 0), (1, 1), (1, 2)]
    assert sorted(streaming_split(scores, 0.5, [0, 2])) == [(0, 1), (2, 0), (2, 2)]
