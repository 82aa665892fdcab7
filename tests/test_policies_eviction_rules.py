"""Eviction policies on the real KV view without a model: CAKE's Theorem 1 (cascading == one-shot), cascading's prefill
memory bound, and every decode-time rule (TOVA, H2O, StreamingLLM, CAKE) against a brute-force reference."""
from __future__ import annotations

import pytest
import torch

from systems.engine.kv_cache import TieredKVCache
from systems.policies import load_policy
from systems.policies.base import DecodeStep, SeqInfo
from systems.policy_support import indicators as ind

HQ, HKV, D, P = 4, 2, 8, 4
G = HQ // HKV
SCALE = D ** -0.5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronization, badly so on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kv(layers: int) -> TieredKVCache:
    return TieredKVCache(num_layers=layers, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P, max_seqs=2,
                         max_model_len=512, device_memory_gb=0.002, host_memory_gb=1e-4, dtype=torch.float32,
                         device=torch.device("cpu"))


def _info(n: int, seq_len: int | None = None, step: int = 0) -> SeqInfo:
    return SeqInfo(slot=0, request_id="r", prefill_len=n, seq_len=seq_len or n, decode_step=step, max_new_tokens=64)


def _prefill(policy, kv, layers, n, seed):
    """Random post-RoPE q/k per layer; V carries each token's position so kept positions can be read back."""
    g = torch.Generator().manual_seed(seed)
    qs, ks = [], []
    policy.bind(kv)
    policy.reset(0)
    v = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, HKV, D).contiguous()
    for layer in range(layers):
        q, k = torch.randn(n, HQ, D, generator=g) * 2, torch.randn(n, HKV, D, generator=g)
        kv.store_prefill(0, layer, k, v)
        policy.after_prefill_layer(kv, _info(n), layer, q, k)
        qs.append(q)
        ks.append(k)
    return qs, ks


def _kept(kv, layer) -> list[set[int]]:
    _, v, counts = kv.gather_tokens(torch.tensor([0]), layer)
    return [set(v[0, h, :int(counts[0, h]), 0].long().tolist()) for h in range(HKV)]


def test_cascading_equals_one_shot_and_bounds_prefill_memory():
    layers, n = 8, 120
    for seed in range(6):
        kept, peaks, budgets = {}, {}, {}
        for cascading in (True, False):
            kv = _kv(layers)
            policy = load_policy("cake", dict(budget=24, window=8, cascading=cascading))
            _prefill(policy, kv, layers, n, seed)
            kept[cascading] = [_kept(kv, layer) for layer in range(layers)]
            peaks[cascading] = kv.device_blocks.peak_used
            budgets[cascading] = policy.kv_stats(kv, _info(n))["layer_budgets"]
            assert policy.device_blocks_needed(n, 0) >= kv.device_blocks.peak_used
        assert budgets[True] == budgets[False] and sum(budgets[True]) == (24 - 8) * layers
        assert kept[True] == kept[False]                                   # CAKE's Theorem 1
        for layer in range(layers):
            assert all(len(s) == budgets[True][layer] + 8 for s in kept[True][layer])
            assert all(set(range(n - 8, n)) <= s for s in kept[True][layer])   # the window always stays
        full_layer = HKV * -(-n // P)
        assert peaks[False] == layers * full_layer                         # one-shot holds the whole prefill
        assert peaks[True] <= HKV * (-(-(16 * layers + 8 * layers) // P) + layers) + full_layer


def _decode(policy, kv, n, steps, seed, layers=1):
    """Append random tokens one at a time; yields (q, k_new) after the append and before the hook runs on it."""
    g = torch.Generator().manual_seed(seed + 100)
    slots = torch.tensor([0])
    for t in range(steps):
        q, k = torch.randn(1, HQ, D, generator=g) * 2, torch.randn(1, HKV, D, generator=g)
        need = kv.decode_blocks_needed(slots)
        kv.allocate_decode(slots, need)
        for layer in range(layers):
            kv.append_decode(slots, layer, k, torch.full((1, HKV, D), float(n + t)))
            yield q, k
            policy.after_append(kv, DecodeStep(layer=layer, slots=slots, seqs=[_info(n, n + t + 1, t + 1)], q=q))


def _probs(q, keys, h):
    """Brute-force softmax of query head h over the listed keys [m, D]."""
    return torch.softmax(torch.tensor([float(q[0, h] @ kk) * SCALE for kk in keys], dtype=torch.float64), 0)


def test_tova_decode_drops_the_least_attended_token():
    n, budget = 30, 20
    kv = _kv(1)
    policy = load_policy("tova", dict(budget=budget))
    qs, ks = _prefill(policy, kv, 1, n, seed=1)
    keys = {p: ks[0][p] for p in range(n)}
    score = sum(torch.softmax((qs[0][-1, h] @ ks[0][:, h // G].T) * SCALE, 0) for h in range(HQ)) / HQ
    ref = set(score.topk(budget).indices.tolist())
    assert _kept(kv, 0) == [ref] * HKV
    for t, (q, k) in enumerate(_decode(policy, kv, n, 12, seed=1)):
        keys[n + t] = k[0]
        ref.add(n + t)
        order = sorted(ref)
        mean = sum(_probs(q, [keys[p][h // G] for p in order], h) for h in range(HQ)) / HQ
        ref.discard(order[int(mean.argmin())])
    assert _kept(kv, 0) == [ref] * HKV


def test_h2o_accumulates_over_prefill_and_decode():
    n, budget, recent = 30, 16, 6
    kv = _kv(1)
    policy = load_policy("h2o", dict(budget=budget, recent_size=recent, aggregation="sum"))
    qs, ks = _prefill(policy, kv, 1, n, seed=2)
    q0, k0 = qs[0], ks[0]
    keys = {p: k0[p] for p in range(n)}
    refs = []
    for hk in range(HKV):
        score = {p: 0.0 for p in range(n)}
        for h in range(hk * G, hk * G + G):
            for i in range(n):
                for p, a in zip(range(i + 1), _probs(q0[i:i + 1], [k0[j, hk] for j in range(i + 1)], h)):
                    score[p] += float(a)
        heavy = sorted(range(n - recent), key=lambda p: -score[p])[:budget - recent]
        refs.append((set(heavy) | set(range(n - recent, n)), score))
    assert _kept(kv, 0) == [r[0] for r in refs]
    for t, (q, k) in enumerate(_decode(policy, kv, n, 10, seed=2)):
        keys[n + t] = k[0]
        for hk, (kept, score) in enumerate(refs):
            kept.add(n + t)
            score[n + t] = 0.0
            order = sorted(kept)
            for h in range(hk * G, hk * G + G):
                for p, a in zip(order, _probs(q, [keys[p][hk] for p in order], h)):
                    score[p] += float(a)
            old = [p for p in order if p < n + t + 1 - recent]
            kept.discard(min(old, key=lambda p: score[p]))
    assert _kept(kv, 0) == [r[0] for r in refs]


def test_streaming_keeps_sinks_and_the_most_recent():
    n, budget = 30, 12
    kv = _kv(2)
    policy = load_policy("streaming", dict(budget=budget, sink_size=4))
    _prefill(policy, kv, 2, n, seed=3)
    for _ in _decode(policy, kv, n, 9, seed=3, layers=2):
        pass
    expect = set(range(4)) | set(range(n + 9 - (budget - 4), n + 9))
    assert _kept(kv, 0) == _kept(kv, 1) == [expect] * HKV


@pytest.mark.parametrize("order", ["storage", "position"])
def test_cake_decode_follows_the_official_cache_order(order):
    """Reference = the official cache as a list: prefill keeps top-k (descending score) + window; each decode step
    appends, avg-pools (kernel 5) the prefix's attention in list order, re-stores top-k descending + the window.
    `position` mode keeps the list in position order instead."""
    n, budget, window = 40, 20, 6
    kv = _kv(1)
    policy = load_policy("cake", dict(budget=budget, window=window, decode_pool_order=order))
    qs, ks = _prefill(policy, kv, 1, n, seed=4)
    keys = {p: ks[0][p] for p in range(n)}
    prefill = ind.window_indicator(ind.window_attention(qs[0], ks[0], window, SCALE), HKV)
    caches = [prefill[h].topk(budget - window).indices.tolist() + list(range(n - window, n)) for h in range(HKV)]
    for t, (q, k) in enumerate(_decode(policy, kv, n, 12, seed=4)):
        keys[n + t] = k[0]
        for cache in caches:
            cache.append(n + t)
            if order == "position":
                cache.sort()
        assert _kept(kv, 0) == [set(c) for c in caches]    # the previous step's eviction, plus the appended token
        for hk, cache in enumerate(caches):
            prefix = cache[:-window]
            pooled = torch.zeros(len(prefix), dtype=torch.float64)
            for h in range(hk * G, hk * G + G):
                a = _probs(q, [keys[p][hk] for p in cache], h)[:len(prefix)]
                padded = torch.cat([torch.zeros(2, dtype=torch.float64), a, torch.zeros(2, dtype=torch.float64)])
                pooled += torch.stack([padded[j:j + 5].sum() / 5 for j in range(len(prefix))]) / G
            top = pooled.topk(len(prefix) - 1).indices.tolist()
            cache[:] = [prefix[j] for j in top] + cache[-window:]
    assert _kept(kv, 0) == [set(c) for c in caches]
