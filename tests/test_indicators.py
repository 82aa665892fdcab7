"""Token indicators against brute-force loops, and the ledger against the real KV view's keep/drop moves."""
from __future__ import annotations

import math

import pytest
import torch

from systems.policy_support import indicators as ind

N, HQ, HKV, D = 11, 4, 2, 8
G = HQ // HKV
SCALE = D ** -0.5


@pytest.fixture(scope="module")
def qk():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, HQ, D, generator=g), torch.randn(N, HKV, D, generator=g)


def _softmax_row(q, k, h, i, keys):
    """Attention of query position i, head h over the listed key positions (brute force)."""
    logits = [float(q[i, h] @ k[j, h // G]) * SCALE for j in keys]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return {j: x / sum(e) for j, x in zip(keys, e)}


def _attn(q, k, window):
    """A[h][i][j] for window query i (position N - window + i), zero above the diagonal."""
    out = [[[0.0] * N for _ in range(window)] for _ in range(HQ)]
    for h in range(HQ):
        for i in range(window):
            p = N - window + i
            for j, a in _softmax_row(q, k, h, p, list(range(p + 1))).items():
                out[h][i][j] = a
    return out


def _pool(row, kernel, kind):
    pad = kernel // 2
    out = []
    for j in range(len(row)):
        vals = [row[t] if 0 <= t < len(row) else None for t in range(j - pad, j + pad + 1)]
        if kind == "avgpool":
            out.append(sum(v or 0.0 for v in vals) / kernel)          # zero padding counted, as F.avg_pool1d
        else:
            out.append(max(v for v in vals if v is not None))
    return out


def _group(rows, how):
    out = []
    for h in range(HKV):
        members = rows[h * G:(h + 1) * G]
        cols = list(zip(*members))
        out.append([sum(c) / G if how == "mean" else max(c) if how == "max" else sum(c) for c in cols])
    return out


def test_window_attention_brute_force(qk):
    q, k = qk
    got = ind.window_attention(q, k, 4, SCALE)
    assert got.shape == (HQ, 4, N)
    assert torch.allclose(got, torch.tensor(_attn(q, k, 4)), atol=1e-6)


@pytest.mark.parametrize("kind", ind.WINDOW_INDICATORS)
@pytest.mark.parametrize("pooling, kernel, agg", [("avgpool", 5, "mean"), ("maxpool", 3, "max"), ("none", 1, "sum")])
def test_window_indicator_brute_force(qk, kind, pooling, kernel, agg):
    q, k = qk
    w, gamma = 4, 200.0
    a = _attn(q, k, w)
    rows = []
    for h in range(HQ):
        row = []
        for j in range(N - w):
            col = [a[h][i][j] for i in range(w)]
            mean = sum(col) / w
            var = sum((x - mean) ** 2 for x in col) / (w - 1)
            row.append({"mean_plus_var": mean + gamma * var, "mean": mean, "var": var,
                        "mean_times_var": mean * var, "sum": sum(col)}[kind])
        rows.append(row if pooling == "none" else _pool(row, kernel, pooling))
    expect = torch.tensor(_group(rows, agg))
    got = ind.window_indicator(ind.window_attention(q, k, w, SCALE), HKV, kind, gamma, kernel, pooling, agg)
    assert got.shape == (HKV, N - w)
    assert torch.allclose(got, expect, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("agg", ind.AGGREGATIONS)
def test_accumulated_attention_brute_force(qk, agg):
    q, k = qk
    rows = [[0.0] * N for _ in range(HQ)]
    for h in range(HQ):
        for i in range(N):
            for j, x in _softmax_row(q, k, h, i, list(range(i + 1))).items():
                rows[h][j] += x
    got = ind.accumulated_attention(q, k, SCALE, agg, chunk=3)                  # chunks of 3 queries
    assert torch.allclose(got, torch.tensor(_group(rows, agg)), atol=1e-5)


def test_last_query_attention_brute_force(qk):
    q, k = qk
    rows = [_softmax_row(q, k, h, N - 1, list(range(N))) for h in range(HQ)]
    expect = torch.tensor([sum(r[j] for r in rows) / HQ for j in range(N)])
    assert torch.allclose(ind.last_query_attention(q, k, SCALE), expect, atol=1e-6)


def test_top_keep_and_pool_lengths():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.0, 0.2, 0.7]])
    keep = ind.top_keep(scores, 2, 3, 7)
    assert [t.tolist() for t in keep] == [[1, 2, 4, 5, 6], [0, 3, 4, 5, 6]]
    assert [t.tolist() for t in ind.top_keep(scores, 0, 3, 7)] == [[4, 5, 6], [4, 5, 6]]
    assert ind.pool1d(torch.rand(3, 9), 4, "avgpool").shape == (3, 9)       # even kernels keep the length too


def test_ledger_mirrors_keep_and_drop_on_the_kv_view():
    from systems.engine.kv_cache import TieredKVCache
    kv = TieredKVCache(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=4, max_seqs=2,
                       max_model_len=64, device_memory_gb=1e-4, host_memory_gb=1e-4, dtype=torch.float32,
                       device=torch.device("cpu"))
    ledger = ind.TokenLedger(2, 1, HKV, torch.device("cpu"), with_scores=True, capacity=8)   # grows
    n = 14
    k = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, HKV, D).contiguous()   # key value = position
    kv.store_prefill(1, 0, k, k)
    keep = torch.tensor([[0, 2, 3, 7, 9, 10, 11, 12, 13], [1, 4, 5, 6, 8, 10, 11, 12, 13]])
    kv.keep_tokens(1, 0, list(keep))
    ledger.set(1, 0, keep, keep.float() * 10)                      # 9 tokens: the ledger grows past capacity 8
    slots = torch.tensor([1])
    for step in range(6):
        kv.append_decode(slots, 0, torch.full((1, HKV, D), float(n + step)), torch.zeros(1, HKV, D))
        ledger.append(slots, 0, torch.tensor([n + step]), torch.full((1, HKV), 10.0 * (n + step)))
        ledger.drop(kv, torch.tensor([1, 1]), 0, torch.tensor([0, 1]), torch.tensor([step % 3, (2 * step) % 5]))
        gk, _, counts = kv.gather_tokens(slots, 0)
        pos, cnt = ledger.view(slots, 0, gk.shape[2])
        assert torch.equal(cnt, counts)
        for h in range(HKV):
            c = int(counts[0, h])
            assert torch.equal(gk[0, h, :c, 0].long(), pos[0, h, :c])
            assert torch.equal(ledger.score[1, 0, h, :c], pos[0, h, :c].float() * 10)


def test_gqa_pool_orders_differ_under_max_pooling_and_match_their_definitions():
    torch.manual_seed(3)
    attn = torch.rand(6, 4, 40).softmax(-1)                 # [Hq, S_w, n]: 6 query heads in 2 groups
    a = ind.window_indicator(attn, 2, "sum", kernel=5, pooling="maxpool", gqa_pool="pool_then_group")
    b = ind.window_indicator(attn, 2, "sum", kernel=5, pooling="maxpool", gqa_pool="group_then_pool")
    s = attn.sum(1)[:, :36]
    torch.testing.assert_close(a, ind.pool1d(s, 5, "maxpool").view(2, 3, 36).mean(1))
    torch.testing.assert_close(b, ind.pool1d(s.view(2, 3, 36).mean(1), 5, "maxpool"))
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="gqa_pool"):
        ind.window_indicator(attn, 2, "sum", gqa_pool="sideways")
