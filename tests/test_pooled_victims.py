"""pooled_victims (CAKE's decode eviction: attention pooled along an order of the tokens): the torch reference equals
a plain loop over the rule, and the CPU kernel equals the reference bit for bit, whatever the batch or threads."""
from __future__ import annotations

import itertools

import pytest
import torch

from systems.engine.ops import cpu_kernels, torch_attention

CODES = {"none": 0, "avgpool": 1, "maxpool": 2}


def _case(g: torch.Generator, rows: int, hkv: int, group: int, n: int, window: int):
    counts = torch.randint(window + 1, n + 1, (rows, hkv), generator=g)
    probs = torch.rand(rows, hkv * group, n, generator=g).softmax(-1)
    held = torch.arange(n).view(1, 1, n) < counts.repeat_interleave(group, 1).unsqueeze(-1)
    probs = torch.where(held, probs, 0.0)
    # distinct keys, as a ledger's ranks and appended positions are; some far above the rest (decode tokens)
    key = torch.stack([torch.randperm(n, generator=g).float() for _ in range(rows * hkv)]).view(rows, hkv, n)
    key[:, :, :3] += 1e7
    return probs, counts, key


def _loop(probs, counts, key, window, kernel, pooling):
    """The rule, one head at a time in plain Python floats-in-tensors: (victim index, next keys)."""
    rows, hkv = counts.shape
    n, group = probs.shape[-1], probs.shape[1] // hkv
    victims, keys = torch.zeros(rows, hkv, dtype=torch.long), torch.zeros(rows, hkv, n)
    for r, h in itertools.product(range(rows), range(hkv)):
        c = int(counts[r, h])
        order = sorted(range(c), key=lambda i: float(key[r, h, i])) + list(range(c, n))
        inside = c - window
        pooled = torch.zeros(group, n)
        for q in range(group):
            ranked = torch.tensor([float(probs[r, h * group + q, order[m]]) if m < inside else 0.0 for m in range(n)])
            for m in range(n):
                span = ranked[max(m - kernel // 2, 0):min(m - kernel // 2 + kernel, n)]
                pooled[q, m] = (ranked[m] if pooling == "none" or kernel == 1 else
                                span.sum() / kernel if pooling == "avgpool" else span.max())
        score = pooled.mean(0)
        victim = min(range(inside), key=lambda m: (float(score[m]), m))
        victims[r, h] = order[victim]
        by_score = sorted(range(inside), key=lambda m: (-float(score[m]), m))
        for j, m in enumerate(by_score):
            keys[r, h, order[m]] = j
        for m in range(inside, n):
            keys[r, h, order[m]] = m
    return victims, keys


@pytest.mark.parametrize("pooling", ["avgpool", "maxpool", "none"])
def test_reference_is_the_rule(pooling):
    g = torch.Generator().manual_seed(1)
    probs, counts, key = _case(g, rows=2, hkv=2, group=3, n=24, window=4)
    index, keys = torch_attention.pooled_victims(probs, counts, key, 4, 5, pooling, new_keys=True)
    want_index, want_keys = _loop(probs, counts, key, 4, 5, pooling)
    assert torch.equal(index, want_index)
    held = torch.arange(24).view(1, 1, 24) < counts.unsqueeze(-1)
    assert torch.equal(keys[held], want_keys[held])


def test_kernel_equals_the_reference_bit_for_bit():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    g = torch.Generator().manual_seed(0)
    for group, kernel, pooling, window in itertools.product([1, 2, 3, 4], [1, 4, 5], list(CODES), [0, 3, 32]):
        n = 300 if window == 32 else 90
        probs, counts, key = _case(g, rows=5, hkv=3, group=group, n=n, window=window)
        ref_index, ref_keys = torch_attention.pooled_victims(probs, counts, key, window, kernel, pooling, True)
        index, keys = torch.ops.kvharness_cpu.pooled_victims(probs, counts, key, window, kernel, CODES[pooling], True)
        assert torch.equal(index, ref_index), (group, kernel, pooling, window)
        assert torch.equal(keys, ref_keys), (group, kernel, pooling, window)      # padding slots included
        alone, none = cpu_kernels.pooled_victims(probs, counts, key, window, kernel, pooling, False)
        assert torch.equal(alone, index) and none is None


def test_kernel_rows_do_not_depend_on_the_batch_or_threads():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    probs, counts, key = _case(torch.Generator().manual_seed(2), rows=6, hkv=3, group=3, n=200, window=8)
    together = cpu_kernels.pooled_victims(probs, counts, key, 8, 5, "avgpool", True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for r in range(6):
            index, keys = cpu_kernels.pooled_victims(probs[r:r + 1], counts[r:r + 1], key[r:r + 1], 8, 5, "avgpool",
                                                     True)
            assert torch.equal(index[0], together[0][r]) and torch.equal(keys[0], together[1][r])
    finally:
        torch.set_num_threads(threads)


def test_larger_groups_take_the_torch_path():
    """torch's mean over 5 or more heads does not add them in order, so the op set sends those groups to torch."""
    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    g = torch.Generator().manual_seed(4)
    for group in (5, 8, 16):
        probs, counts, key = _case(g, rows=3, hkv=2, group=group, n=121, window=4)
        probs = (probs * 8).round() / 8                                   # ties between candidates
        ref = torch_attention.pooled_victims(probs, counts, key, 4, 5, "avgpool", True)
        got = cpu_kernels.pooled_victims(probs, counts, key, 4, 5, "avgpool", True)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        with pytest.raises(RuntimeError, match="at most 4"):
            torch.ops.kvharness_cpu.pooled_victims(probs, counts, key, 4, 5, 1, True)


def test_a_head_without_a_token_outside_its_window_is_refused():
    probs, counts, key = _case(torch.Generator().manual_seed(3), rows=1, hkv=1, group=1, n=10, window=2)
    counts[0, 0] = 2
    with pytest.raises(ValueError, match="outside its window"):
        torch_attention.pooled_victims(probs, counts, key, 2, 5, "avgpool", False)
    if cpu_kernels.available():
        with pytest.raises(RuntimeError, match="outside its window"):
            torch.ops.kvharness_cpu.pooled_victims(probs, counts, key, 2, 5, 1, False)
