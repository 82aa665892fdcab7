"""Sliding-window attention in the engine's ops: the torch references against a naive per-query softmax, and the
CPU and Triton (interpreted) decode kernels against the references, never reading a key outside the window."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

from systems.engine.ops import cpu_kernels, torch_attention  # noqa: E402

P, D = 4, 16


def _naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float):
    """q [Hq, D] over keys/values [S, Hkv, D] where visible [S] is True; fp32 softmax."""
    group = q.shape[0] // keys.shape[1]
    k = keys[visible].float().repeat_interleave(group, 1)             # [n, Hq, D]
    v = values[visible].float().repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q.float(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", probs, v)


@pytest.mark.parametrize("window", [1, 5, 13, 100])
@pytest.mark.parametrize("T", [30, 7])                 # the whole prompt, or a later chunk of it
def test_prompt_attention_sees_the_last_window_keys(window, T):
    g = torch.Generator().manual_seed(window + T)
    S, Hq, Hkv = 30, 4, 2
    q = torch.randn(T, Hq, D, generator=g)
    k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    out = torch_attention.prompt_attention(q, k, v, 0.3, window=window)
    for t in range(T):
        i = S - T + t
        pos = torch.arange(S)
        want = _naive(q[t], k, v, (pos <= i) & (pos > i - window), 0.3)
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)
    # the CPU op set's prompt attention honours the window too (its bf16 kernel has none and steps aside)
    torch.testing.assert_close(cpu_kernels.prompt_attention(q, k, v, 0.3, window=window), out)


def _paged(seed: int, B=3, Hq=4, Hkv=2, M=9, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nblocks = 1 + B * Hkv * M
    k_pool, v_pool = (torch.randn(nblocks, P, D, generator=g).to(dtype) for _ in range(2))
    table = (torch.randperm(nblocks - 1, generator=g) + 1).view(B, Hkv, M).to(torch.int32)
    counts = torch.tensor([[1, 2 * P + 3], [M * P, 17], [11, M * P - 1]], dtype=torch.int32)[:B, :Hkv]
    q = (3 * torch.randn(B, Hq, D, generator=g)).to(dtype)
    return q, k_pool, v_pool, table, counts


def _tokens(pool, table, b, h, n):
    """The first n tokens of row (b, h) in logical order [n, D]."""
    return pool[table[b, h].long()].reshape(-1, D)[:n]


def _poison_outside(pool, table, counts, window):
    """NaN on every token a windowed decode must not read (before the window or past the last token)."""
    bad = torch.full_like(pool, float("nan"))
    for b in range(table.shape[0]):
        for h in range(table.shape[1]):
            n = int(counts[b, h])
            for t in range(max(0, n - window), n):
                blk = int(table[b, h, t // P])
                bad[blk, t % P] = pool[blk, t % P]
    return bad


@pytest.mark.parametrize("window", [1, 6, 9, 1000])
def test_paged_decode_reads_the_window_only(window):
    q, k_pool, v_pool, table, counts = _paged(window)
    scale = D ** -0.5
    ref = torch_attention.paged_decode_attention(q, k_pool, v_pool, table, counts, scale, window=window)
    for b in range(q.shape[0]):
        for h in range(table.shape[1]):
            n = int(counts[b, h])
            ks, vs = _tokens(k_pool, table, b, h, n), _tokens(v_pool, table, b, h, n)
            visible = torch.arange(n) >= n - window
            heads = slice(h * 2, h * 2 + 2)
            want = _naive(q[b, heads], ks[:, None], vs[:, None], visible, scale)
            torch.testing.assert_close(ref[b, heads], want, rtol=1e-5, atol=1e-5)
    if cpu_kernels.available():
        k_bad, v_bad = (_poison_outside(p, table, counts, window) for p in (k_pool, v_pool))
        out = cpu_kernels.paged_decode_attention(q, k_bad, v_bad, table, counts, scale, window=window)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [3, 6, 10])
def test_sparse_decode_applies_the_window_to_the_selected_pages(window):
    q, k_pool, v_pool, table, counts = _paged(40 + window)
    counts[:] = 9 * P - 2                                     # 34 tokens: the window starts inside page 7 or 8
    sel = torch.tensor([[[8, 0, 7, -1], [8, 6, 7, -1]], [[7, 8, -1, -1], [3, 8, 5, -1]],
                        [[8, -1, -1, -1], [0, 1, 8, 7]]])
    scale = D ** -0.5
    ref = torch_attention.sparse_decode_attention(q, k_pool, v_pool, table, counts, sel, scale, window=window)
    n = int(counts[0, 0])
    for b in range(q.shape[0]):
        for h in range(table.shape[1]):
            pages = [p for p in sel[b, h].tolist() if p >= 0]
            pos = torch.arange(n)
            visible = torch.isin(pos // P, torch.tensor(pages)) & (pos >= n - window)
            ks, vs = _tokens(k_pool, table, b, h, n), _tokens(v_pool, table, b, h, n)
            heads = slice(h * 2, h * 2 + 2)
            want = _naive(q[b, heads], ks[:, None], vs[:, None], visible, scale)
            torch.testing.assert_close(ref[b, heads], want, rtol=1e-5, atol=1e-5)
    if cpu_kernels.available():
        k_bad, v_bad = (_poison_outside(p, table, counts, window) for p in (k_pool, v_pool))
        out = cpu_kernels.sparse_decode_attention(q, k_bad, v_bad, table, counts, sel, scale, window=window)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D_bf16", [64, 128])
def test_bf16_decode_kernel_honours_the_window(D_bf16):
    """The bf16 decode kernels (AVX512-BF16 where the CPU has it) against the fp32 reference of the same values."""
    if not cpu_kernels.available():
        pytest.skip("no CPU kernels on this machine: the torch path is the one checked above")
    g = torch.Generator().manual_seed(D_bf16)
    B, Hq, Hkv, M, Pb = 2, 6, 2, 6, 16
    nblocks = 1 + B * Hkv * M
    k_pool, v_pool = (torch.randn(nblocks, Pb, D_bf16, generator=g).bfloat16() for _ in range(2))
    table = (torch.randperm(nblocks - 1, generator=g) + 1).view(B, Hkv, M).to(torch.int32)
    counts = torch.tensor([[M * Pb, 37], [20, M * Pb - 3]], dtype=torch.int32)
    q = torch.randn(B, Hq, D_bf16, generator=g).bfloat16()
    for window in (5, 21, 40):
        ref = torch_attention.paged_decode_attention(q.float(), k_pool.float(), v_pool.float(), table, counts,
                                                     0.1, window=window)
        out = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, counts, 0.1, window=window)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_triton_decode_kernels_honour_the_window():
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    from systems.engine.ops import triton_attention

    dev = torch.device("cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda")
    q, k_pool, v_pool, table, counts = _paged(7, B=2)
    sel = torch.tensor([[[8, 0, 7, -1], [4, 3, -1, -1]], [[2, 8, -1, -1], [3, 1, 2, -1]]])
    counts = torch.tensor([[9 * P - 2, 17], [9 * P, 15]], dtype=torch.int32)
    for window in (1, 6, 9):
        k_bad, v_bad = (_poison_outside(p, table, counts, window) for p in (k_pool, v_pool))
        args = [t.to(dev) for t in (q, k_bad, v_bad, table, counts)]
        ref = torch_attention.paged_decode_attention(q, k_pool, v_pool, table, counts, 0.25, window=window)
        out = triton_attention.paged_decode_attention(*args, 0.25, window=window)
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-5, atol=2e-5)
        out = triton_attention._decode(*args, None, 0.25, window=window, pages_per_split=2)   # split-K, merged
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-5, atol=2e-5)
    window = 9       # every row keeps at least one selected page in its window
    ref = torch_attention.sparse_decode_attention(q, k_pool, v_pool, table, counts, sel, 0.25, window=window)
    k_bad, v_bad = (_poison_outside(p, table, counts, window) for p in (k_pool, v_pool))
    out = triton_attention.sparse_decode_attention(*[t.to(dev) for t in (q, k_bad, v_bad, table, counts, sel)],
                                                   0.25, window=window)
    torch.testing.assert_close(out.cpu(), ref, rtol=2e-5, atol=2e-5)
