"""The decode hooks' cheaper paths equal what they replaced: key-only gathers, a shared-k top-k, batched counters."""
from __future__ import annotations

import pytest
import torch

from systems.engine.kv_cache import TieredKVCache
from systems.engine.ops import cpu_kernels, torch_scoring
from systems.policies import load_policy
from systems.policies.base import SeqInfo
from systems.policy_support import indicators as ind
from systems.policy_support import selection

P, H, D = 4, 2, 8


def _cache() -> TieredKVCache:
    return TieredKVCache(num_layers=2, num_q_heads=4, num_kv_heads=H, head_dim=D, page_size=P, max_seqs=3,
                         max_model_len=64, device_memory_gb=1e-4, host_memory_gb=1e-4, dtype=torch.float32,
                         device=torch.device("cpu"))


def test_stored_keys_equal_gather_tokens_keys_with_uneven_heads():
    kv = _cache()
    gen = torch.Generator().manual_seed(0)
    for slot, n in ((0, 13), (2, 6)):
        k = torch.randn(n, H, D, generator=gen)
        kv.store_prefill(slot, 1, k, k + 1)
    # heads of one sequence hold different counts after drops, and the dropped slots keep stale keys in the pool
    kv.drop_tokens(torch.tensor([0, 2]), 1, torch.tensor([1, 0]), torch.tensor([3, 0]))
    kv.drop_tokens(torch.tensor([0]), 1, torch.tensor([1]), torch.tensor([5]))
    slots = torch.tensor([0, 2])
    k_ref, _, counts_ref = kv.gather_tokens(slots, 1)
    k, counts = ind.stored_keys(kv, slots, 1)
    assert torch.equal(counts, counts_ref) and counts.tolist() == [[13, 11], [5, 6]]
    assert k.shape == k_ref.shape and torch.equal(k, k_ref)
    # the decode queries' attention reads the same tokens in place: a softmax over each head's own count
    q = torch.randn(2, 4, D, generator=gen)
    probs = kv.attention_probs(slots, 1, q)
    for b in range(2):
        for h in range(4):
            n = int(counts[b, h // 2])
            expect = (q[b, h] @ k_ref[b, h // 2, :n].T * kv.scale).softmax(-1)
            assert torch.allclose(probs[b, h, :n], expect, atol=1e-6) and bool((probs[b, h, n:] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranked_pages_kernel_equals_a_stable_sort_of_the_scores_with_ties_and_short_heads(dtype):
    """Quest attends to its pages in this order, so the CPU op must give the torch path's order exactly: best
    first, ties to the lower page, per-sequence k, padding past k and past a head's pages."""
    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    gen = torch.Generator().manual_seed(1)
    kmin = torch.randint(-2, 1, (4, 5, 9, 16), generator=gen).to(dtype)       # small integers: exact scores, and
    kmax = kmin + torch.randint(0, 2, kmin.shape, generator=gen).to(dtype)     # many ties the lower page must win
    q = torch.randint(-1, 2, (3, 5, 16), generator=gen).to(dtype)
    rows, heads = torch.tensor([3, 0, 2]), torch.tensor([0, 1, 2, 3, 4])
    num_pages = torch.tensor([[9] * 5, [9, 9, 4, 9, 9], [2] * 5])               # a short head, a short sequence
    for k in ([1, 1, 1], [3, 5, 2], [9, 9, 9], [12, 4, 12]):
        kk = torch.tensor(k)
        expected = torch_scoring.ranked_pages(q, kmin, kmax, num_pages, rows, heads, kk,
                                              scorer=cpu_kernels.page_scores)
        assert torch.equal(cpu_kernels.ranked_pages(q, kmin, kmax, num_pages, rows, heads, kk), expected)


def test_quest_union_counter_batched_per_step_equals_per_layer_count():
    """Quest counts the union of each KV head's query-head sets once per step over all layers; the total equals
    counting each layer's union on its own."""
    policy = load_policy("quest", dict(budget=2 * P, skip_layers=0))
    kv = _cache()
    policy.configure(kv)
    policy.bind(kv)
    gen = torch.Generator().manual_seed(2)
    width, expected = 6, torch.zeros(3, dtype=torch.long)
    for step in range(4):
        slots = torch.tensor([0, 2]) if step < 2 else torch.tensor([2])
        for layer in range(2):
            w = width - 1 if step == 3 and layer == 1 else width             # a width change mid-step flushes
            chosen = torch.randint(-1, w, (len(slots), 4, 2), generator=gen)
            union = selection.as_mask(chosen.view(len(slots), H, -1), w)
            expected.index_add_(0, slots, union.sum((1, 2)))
            policy._defer_union(slots, chosen, w)
    policy.kv_stats(kv, SeqInfo(2, "r", 4, 8, 4, 4))                      # kv_stats counts what is pending
    assert torch.equal(policy._union_read, expected)
