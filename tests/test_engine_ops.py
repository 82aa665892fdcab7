"""Engine torch ops against naive per-token / per-head references on random tensors."""
from __future__ import annotations

import math

import pytest
import torch

from systems.engine.ops.torch_attention import gather_selected, paged_decode_attention
from systems.engine.ops.torch_kv import page_minmax, store_kv, update_minmax
from systems.engine.ops.torch_scoring import page_scores


def _paged_case(B=3, Hq=6, Hkv=2, D=8, P=4, M=5, seed=0):
    """Random pools with every (seq, head) owning M distinct blocks and a random token count."""
    g = torch.Generator().manual_seed(seed)
    nblocks = 1 + B * Hkv * M
    k_pool = torch.randn(nblocks, P, D, generator=g)
    v_pool = torch.randn(nblocks, P, D, generator=g)
    perm = torch.randperm(nblocks - 1, generator=g) + 1
    table = perm.view(B, Hkv, M).to(torch.int32)
    counts = torch.randint(1, M * P + 1, (B, Hkv), generator=g).to(torch.int32)
    q = torch.randn(B, Hq, D, generator=g)
    return q, k_pool, v_pool, table, counts


def _naive_attention(q, k_pool, v_pool, table, counts, scale):
    B, Hq, D = q.shape
    Hkv = table.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            n = int(counts[b, g])
            keys = torch.cat([k_pool[int(i)] for i in table[b, g]])[:n]
            vals = torch.cat([v_pool[int(i)] for i in table[b, g]])[:n]
            w = torch.softmax((keys @ q[b, h]) * scale, dim=0)
            out[b, h] = w @ vals
    return out


def test_store_kv_writes_each_token_to_its_slot():
    k_pool, v_pool = torch.zeros(6, 4, 3), torch.zeros(6, 4, 3)
    k, v = torch.randn(5, 3), torch.randn(5, 3)
    blocks, offsets = torch.tensor([1, 1, 5, 2, 5]), torch.tensor([0, 3, 2, 1, 0])
    store_kv(k_pool, v_pool, k, v, blocks, offsets)
    for i in range(5):
        assert torch.equal(k_pool[blocks[i], offsets[i]], k[i]) and torch.equal(v_pool[blocks[i], offsets[i]], v[i])
    assert k_pool[0].abs().sum() == 0 and k_pool[3].abs().sum() == 0


def test_minmax_incremental_equals_recomputed():
    g = torch.Generator().manual_seed(1)
    P, D = 4, 5
    k_pool = torch.zeros(4, P, D)
    kmin, kmax = torch.full((3, D), 7.0), torch.full((3, D), 7.0)
    fill = [0, 0, 0]
    for step in range(10):
        row = step % 3
        key = torch.randn(1, D, generator=g)
        k_pool[row + 1, fill[row]] = key[0]
        update_minmax(kmin, kmax, key, torch.tensor([row]), torch.tensor([fill[row] == 0]))
        fill[row] += 1
    lo, hi = page_minmax(k_pool, torch.tensor([1, 2, 3]), torch.tensor(fill))
    assert torch.equal(lo, kmin) and torch.equal(hi, kmax)
    assert torch.equal(lo[0], k_pool[1, :fill[0]].amin(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_page_minmax_equals_the_torch_reference(dtype):
    """The CPU op (a decode-time eviction recomputes two pages' bounds per head and layer) returns torch's values:
    every listed block's bounds over its first n tokens, 1 to a full page, blocks listed twice or out of order."""
    from systems.engine.ops import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    assert hasattr(torch.ops.kvharness_cpu, "page_minmax")
    g = torch.Generator().manual_seed(2)
    k_pool = torch.randn(9, 16, 64, generator=g).to(dtype)
    blocks = torch.tensor([3, 1, 8, 3, 5, 2])
    fill = torch.tensor([1, 16, 7, 16, 2, 15])
    want = page_minmax(k_pool, blocks, fill)
    got = cpu_kernels.page_minmax(k_pool, blocks, fill)
    assert all(w.dtype == x.dtype == dtype and torch.equal(w, x) for w, x in zip(want, got))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_naive(dtype):
    q, k_pool, v_pool, table, counts = _paged_case()
    scale = 1 / math.sqrt(q.shape[-1])
    ref = _naive_attention(q, k_pool, v_pool, table, counts, scale)
    out = paged_decode_attention(q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), table, counts, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_sparse_decode_reads_exactly_the_selected_pages():
    q, k_pool, v_pool, table, counts = _paged_case(seed=3)
    P = k_pool.shape[1]
    B, Hkv, M = table.shape
    g = torch.Generator().manual_seed(4)
    selected = torch.full((B, Hkv, 3), -1, dtype=torch.long)
    expect_keys = {}
    for b in range(B):
        for h in range(Hkv):
            n_pages = -(-int(counts[b, h]) // P)
            pick = torch.randperm(n_pages, generator=g)[:3]
            selected[b, h, :pick.numel()] = pick[torch.randperm(pick.numel(), generator=g)]  # any order
            expect_keys[b, h] = sorted(pick.tolist())
    sel_table, sel_counts = gather_selected(table, counts, selected, P)
    for (b, h), pages in expect_keys.items():
        fill = [min(P, int(counts[b, h]) - p * P) for p in pages]
        assert sel_table[b, h, :len(pages)].tolist() == [int(table[b, h, p]) for p in pages]
        assert int(sel_counts[b, h]) == sum(fill) and sel_table[b, h, len(pages):].eq(0).all()
    scale = 0.3
    out = paged_decode_attention(q, k_pool, v_pool, sel_table, sel_counts, scale)
    for b in range(B):
        for hq in range(q.shape[1]):
            h = hq // (q.shape[1] // Hkv)
            pages = expect_keys[b, h]
            keys = torch.cat([k_pool[int(table[b, h, p]), :min(P, int(counts[b, h]) - p * P)] for p in pages])
            vals = torch.cat([v_pool[int(table[b, h, p]), :min(P, int(counts[b, h]) - p * P)] for p in pages])
            ref = torch.softmax(keys @ q[b, hq] * scale, 0) @ vals
            torch.testing.assert_close(out[b, hq], ref, atol=1e-5, rtol=1e-5)


def test_page_scores_matches_brute_force():
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, M, D = 2, 6, 3, 7, 8
    q = torch.randn(B, Hq, D, generator=g)
    a, b = torch.randn(B, Hkv, M, D, generator=g), torch.randn(B, Hkv, M, D, generator=g)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    num_pages = torch.randint(1, M + 1, (B, Hkv), generator=g)
    scores = page_scores(q, kmin, kmax, num_pages)
    for bb in range(B):
        for h in range(Hkv):
            for m in range(M):
                if m >= num_pages[bb, h]:
                    assert scores[bb, h, m] == float("-inf")
                    continue
                per_q = [sum(max(float(q[bb, hq, d] * kmin[bb, h, m, d]), float(q[bb, hq, d] * kmax[bb, h, m, d]))
                             for d in range(D)) for hq in range(h * 2, h * 2 + 2)]
                assert abs(float(scores[bb, h, m]) - max(per_q)) < 1e-4


@pytest.mark.parametrize("keep_last", [True, False])
def test_top_pages_reference_matches_brute_force(keep_last):
    """torch_scoring.top_pages (the CUDA path, over the Triton scorer there): the brute-force page set."""
    from systems.engine.ops.torch_scoring import top_pages
    g = torch.Generator().manual_seed(6)
    B, Hq, Hkv, M, D, k = 3, 6, 3, 11, 8, 4
    q = torch.randn(B, Hq, D, generator=g)
    a, b = torch.randn(B, Hkv, M, D, generator=g), torch.randn(B, Hkv, M, D, generator=g)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    num_pages = torch.randint(1, M + 1, (B, Hkv), generator=g)
    num_pages[0, 0] = 1
    scores = page_scores(q, kmin, kmax, num_pages)
    num_tokens = num_pages * 4 - torch.randint(0, 4, num_pages.shape, generator=g)        # page size 4, partial
    out = top_pages(q, kmin, kmax, num_tokens, 4, k, keep_last)
    for bb in range(B):
        for h in range(Hkv):
            n = int(num_pages[bb, h])
            others = sorted(range(n - 1), key=lambda m: -float(scores[bb, h, m]))
            want = (set(range(n)) if n <= k else set(others[:k - 1]) | {n - 1}) if keep_last else set(others[:k])
            got = [int(p) for p in out[bb, h] if p >= 0]
            assert len(got) == len(set(got)) and set(got) == want


def test_cuda_op_set_ranks_pages_with_the_devices_scorer():
    """Without a fused top-K kernel, the reference top_pages is bound to the device's page scorer."""
    triton_scoring = pytest.importorskip("systems.engine.ops.triton_scoring")
    from systems.engine.ops import load_ops
    ops = load_ops("cuda")
    assert ops.top_pages.keywords["scorer"] is ops.page_scores is triton_scoring.page_scores


@pytest.mark.parametrize("device_ops", ["torch", "cpu"])
def test_per_query_head_pages_attend_only_to_their_own_set(device_ops):
    """Quest's official path: each query head of a group attends to its own pages; the grouped pools are shared
    (the table row is repeated per query head, never the K/V)."""
    from systems.engine.ops import cpu_kernels, torch_attention
    if device_ops == "cpu" and not cpu_kernels.available():
        pytest.skip("no C++ compiler")
    ops = cpu_kernels if device_ops == "cpu" else torch_attention
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D, P, M = 2, 6, 2, 16, 4, 6
    G = Hq // Hkv
    k_pool, v_pool = torch.randn(1 + B * Hkv * M, P, D, generator=g), torch.randn(1 + B * Hkv * M, P, D, generator=g)
    table = (torch.arange(B * Hkv * M) + 1).view(B, Hkv, M).to(torch.int32)
    counts = torch.full((B, Hkv), M * P - 2, dtype=torch.int32)
    q = torch.randn(B, Hq, D, generator=g)
    sel = torch.stack([torch.randperm(M, generator=g)[:3] for _ in range(B * Hq)]).view(B, Hq, 3)
    out = ops.sparse_decode_attention(q, k_pool, v_pool, table.repeat_interleave(G, 1),
                                      counts.repeat_interleave(G, 1), sel, D ** -0.5)
    for b in range(B):
        for h in range(Hq):
            kvh, pages = h // G, sorted(sel[b, h].tolist())
            keys = torch.cat([k_pool[table[b, kvh, p]][:min(P, int(counts[b, kvh]) - p * P)] for p in pages])
            vals = torch.cat([v_pool[table[b, kvh, p]][:min(P, int(counts[b, kvh]) - p * P)] for p in pages])
            want = torch.softmax(keys @ q[b, h] * D ** -0.5, -1) @ vals
            torch.testing.assert_close(out[b, h], want, rtol=1e-5, atol=1e-5)
