"""The fused CPU kernels (ops/cpu_*.cpp) against the torch references, fp32 and bf16."""
from __future__ import annotations

import pytest
import torch

from systems.engine.ops import cpu_kernels, load_ops
from systems.engine.ops.torch_attention import paged_decode_attention, sparse_decode_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.toolchain(), reason="no C++ compiler: the torch path is used")


def test_kernels_build_where_a_compiler_is_present():
    """A compile error must fail the suite, not turn every kernel test into a skip."""
    assert cpu_kernels.available(), "the CPU kernels did not build: the warning above has the compiler's error"


def _case(B, Hq, Hkv, D, P, M, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nblocks = 1 + B * Hkv * M
    k_pool = torch.randn(nblocks, P, D, generator=g).to(dtype)
    v_pool = torch.randn(nblocks, P, D, generator=g).to(dtype)
    table = (torch.randperm(nblocks - 1, generator=g) + 1).view(B, Hkv, M).to(torch.int32)
    counts = torch.randint(1, M * P + 1, (B, Hkv), generator=g).to(torch.int32)
    counts[0, 0] = 1                                          # a head with a single token
    counts[-1, -1] = M * P                                    # and one with every page full
    q = (3 * torch.randn(B, Hq, D, generator=g)).to(dtype)   # peaked softmax: exercises the running max
    return q, k_pool, v_pool, table, counts


@pytest.mark.parametrize("Hq,Hkv,D,P", [(6, 2, 64, 16), (9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 16),
                                        (6, 2, 16, 4), (7, 1, 96, 32)])
def test_fp32_equals_reference(Hq, Hkv, D, P):
    q, k_pool, v_pool, table, counts = _case(3, Hq, Hkv, D, P, 9, torch.float32, seed=D + Hq)
    ref = paged_decode_attention(q, k_pool, v_pool, table, counts, D ** -0.5)
    out = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, counts, D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", [64, 128, 32])
def test_bf16_matches_fp32_reference(D):
    """bf16 pools (the AVX512-BF16 path for D = 64/128): close to the fp32 result of the same bf16 values."""
    q, k_pool, v_pool, table, counts = _case(4, 9, 3, D, 16, 12, torch.bfloat16, seed=D)
    ref = paged_decode_attention(q.float(), k_pool.float(), v_pool.float(), table, counts, D ** -0.5)
    out = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, counts, D ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    # and no worse than the torch bf16 path is against the same fp32 result
    torch_bf16 = paged_decode_attention(q, k_pool, v_pool, table, counts, D ** -0.5).float()
    assert (out.float() - ref).abs().max() <= (torch_bf16 - ref).abs().max() + 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_heads_split_exactly_and_do_not_depend_on_batch_or_threads(dtype):
    """Heads of up to 1,000 tokens span several fixed splits of pages (their partial softmaxes combined in order):
    the result is the attention, and each row's bits are the same alone, in any batch and on 1 or 2 threads."""
    q, k_pool, v_pool, table, counts = _case(4, 9, 3, 64, 16, 63, dtype, seed=11)
    counts[1] = torch.tensor([1000, 257, 256], dtype=torch.int32)       # split edges and a partial last page
    ref = paged_decode_attention(q.float(), k_pool.float(), v_pool.float(), table, counts, 0.125)
    out = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, counts, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    alone = torch.cat([cpu_kernels.paged_decode_attention(q[b:b + 1], k_pool, v_pool, table[b:b + 1],
                                                          counts[b:b + 1], 0.125) for b in range(4)])
    assert torch.equal(alone, out)
    windowed = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, counts, 0.125, 300)
    wref = paged_decode_attention(q.float(), k_pool.float(), v_pool.float(), table, counts, 0.125, 300)
    torch.testing.assert_close(windowed.float(), wref, rtol=tol, atol=tol)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        assert torch.equal(cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, counts, 0.125), out)
        assert torch.equal(cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, counts, 0.125, 300), windowed)
    finally:
        torch.set_num_threads(threads)


def test_sparse_equals_reference_and_reads_only_selected_pages():
    q, k_pool, v_pool, table, counts = _case(3, 6, 2, 64, 16, 10, torch.float32, seed=3)
    counts[:] = 10 * 16 - 5                                   # partial last page
    sel = torch.tensor([[[0, 9, 4, -1], [2, 3, -1, -1]], [[9, 1, 5, 7], [8, -1, -1, -1]],
                        [[6, -1, -1, -1], [9, 0, -1, -1]]])
    ref = sparse_decode_attention(q, k_pool, v_pool, table, counts, sel, 0.125)
    torch.testing.assert_close(cpu_kernels.sparse_decode_attention(q, k_pool, v_pool, table, counts, sel, 0.125),
                               ref, rtol=1e-5, atol=1e-5)
    poisoned_k, poisoned_v = k_pool.clone(), v_pool.clone()
    keep = torch.zeros(k_pool.shape[0], dtype=torch.bool)
    for b in range(3):
        for h in range(2):
            pages = [p for p in sel[b, h].tolist() if p >= 0]
            keep[table[b, h, pages].long()] = True
    poisoned_k[~keep] = float("nan")
    poisoned_v[~keep] = float("nan")
    out = cpu_kernels.sparse_decode_attention(q, poisoned_k, poisoned_v, table, counts, sel, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cpu_op_set_uses_the_kernel():
    assert load_ops("cpu").paged_decode_attention is cpu_kernels.paged_decode_attention
    assert load_ops("cpu").sparse_decode_attention is cpu_kernels.sparse_decode_attention
    assert load_ops("cpu").page_scores is cpu_kernels.page_scores
    assert load_ops("cpu").top_pages is cpu_kernels.top_pages
    assert load_ops("cpu").resident_pages is cpu_kernels.resident_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_scores_read_rows_and_heads_in_place(dtype):
    """The C++ scorer on a strided one-layer view of a [S, L, Hkv, M, D] cache equals the torch reference."""
    from systems.engine.ops import torch_scoring
    g = torch.Generator().manual_seed(1)
    S, L, Hkv, M, D, G = 5, 3, 4, 20, 64, 3
    a, b = torch.randn(S, L, Hkv, M, D, generator=g), torch.randn(S, L, Hkv, M, D, generator=g)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    rows, heads = torch.tensor([4, 0, 2]), torch.tensor([3, 1])
    q = torch.randn(3, 2 * G, D, generator=g)
    num_pages = torch.tensor([[20, 7], [1, 13], [19, 20]])
    layer = 1
    ref = torch_scoring.page_scores(q, kmin[:, layer, :, :18], kmax[:, layer, :, :18], num_pages, rows, heads)
    out = cpu_kernels.page_scores(q, kmin[:, layer, :, :18], kmax[:, layer, :, :18], num_pages, rows, heads)
    assert out.shape == (3, 2, 18)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-4, atol=1e-3)


def _brute_top(scores, n, k, keep_last):
    """The reference rule on one row of exact scores: ties to the lower page index."""
    others = sorted(range(max(n - 1, 0)), key=lambda m: (-float(scores[m]), m))
    if keep_last:
        return set(range(n)) if n <= k else set(others[:k - 1]) | {n - 1}
    return set(others[:k])


def _minmax_case(dtype, seed, S=5, L=3, Hkv=4, M=45, D=64):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(S, L, Hkv, M, D, generator=g), torch.randn(S, L, Hkv, M, D, generator=g)
    return torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep_last", [True, False])
@pytest.mark.parametrize("k", [1, 3, 16, 64])
def test_top_pages_equal_brute_force_on_a_strided_view(dtype, keep_last, k):
    """The fused scorer + top-K (C++) picks exactly the brute-force set of its own bounds (bf16 queries take the
    vdpbf16ps path), reading rows and heads of one layer in place; pages come ascending, padding last."""
    from systems.engine.ops import torch_scoring
    kmin, kmax, g = _minmax_case(dtype, seed=k)
    rows, heads = torch.tensor([4, 0, 2, 1]), torch.tensor([3, 1])
    q = torch.randn(4, 2 * 3, 64, generator=g).to(dtype)
    num_pages = torch.tensor([[45, 7], [1, 13], [39, 40], [2, 17]])
    view = (kmin[:, 1, :, :45], kmax[:, 1, :, :45])
    scores = cpu_kernels.page_scores(q, *view, num_pages, rows, heads)
    ref_scores = torch_scoring.page_scores(q, *view, num_pages, rows, heads)
    finite = ~torch.isinf(ref_scores)
    torch.testing.assert_close(scores[finite], ref_scores[finite], rtol=1e-4, atol=1e-3)
    # the op takes the layer's token counts [S, Hkv] (a strided slice) and reads them through rows and heads
    num_tokens = torch.zeros(5, 3, 4, dtype=torch.int32)
    partial = torch.randint(0, 16, num_pages.shape, generator=g, dtype=torch.int32)
    num_tokens[rows.unsqueeze(1), 1, heads] = (num_pages * 16 - partial).int()
    out = cpu_kernels.top_pages(q, *view, num_tokens[:, 1], 16, k, keep_last, rows, heads)
    ref = torch_scoring.top_pages(q, *view, num_tokens[:, 1], 16, k, keep_last, rows, heads)
    assert out.shape == ref.shape == (4, 2, min(k, 45))
    for b in range(4):
        for h in range(2):
            row = out[b, h].tolist()
            pages = [p for p in row if p >= 0]
            assert row == pages + [-1] * (len(row) - len(pages)) and pages == sorted(set(pages))
            n = int(num_pages[b, h])
            assert set(pages) == _brute_top(scores[b, h], n, k, keep_last)
            ref_set = {p for p in ref[b, h].tolist() if p >= 0}
            assert len(ref_set) == len(pages)                           # the torch reference agrees up to ties
            assert len(ref_set & set(pages)) >= len(pages) - 1


@pytest.mark.parametrize("keep_last", [True, False])
def test_top_pages_break_ties_to_the_lower_page(keep_last):
    """Pages with equal bounds (repeated MinMax rows, and all-zero rows whose bound is -0.0 or +0.0) are taken
    lowest index first, and exactly k of them: the threshold search counts equal scores as equal."""
    g = torch.Generator().manual_seed(3)
    S, Hkv, M, D = 2, 1, 40, 64
    a, b = torch.randn(S, 1, Hkv, 4, D, generator=g), torch.randn(S, 1, Hkv, 4, D, generator=g)
    kmin, kmax = torch.minimum(a, b).repeat(1, 1, 1, M // 4, 1), torch.maximum(a, b).repeat(1, 1, 1, M // 4, 1)
    kmin[1, :, :, ::3] = 0.0                                  # row 1: every third page has a zero bound
    kmax[1, :, :, ::3] = 0.0
    q = torch.randn(S, 3, D, generator=g).abs().neg()        # q <= 0, so zero rows give -0.0 sums in places
    num_tokens = torch.full((S, Hkv), M * 16, dtype=torch.int32)
    rows, heads = torch.arange(S), torch.arange(Hkv)
    scores = cpu_kernels.page_scores(q, kmin[:, 0], kmax[:, 0], torch.full((S, Hkv), M), rows, heads)
    for k in (2, 5, 11, 17):
        out = cpu_kernels.top_pages(q, kmin[:, 0], kmax[:, 0], num_tokens, 16, k, keep_last, rows, heads)
        for r in range(S):
            got = [p for p in out[r, 0].tolist() if p >= 0]
            assert len(got) == k and got == sorted(got)
            assert set(got) == _brute_top(scores[r, 0], M, k, keep_last)


def test_resident_pages_equal_reference_on_strided_tables():
    from systems.engine.ops import torch_scoring
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(1, 100, (4, 5, 3, 30), generator=g, dtype=torch.int32)
    table = torch.where(torch.rand(4, 5, 3, 30, generator=g) < 0.3, blocks, 0)[:, 2]      # one layer: strided
    num_pages = torch.randint(0, 31, (4, 3), generator=g)
    num_pages[0, 0] = 30
    out = cpu_kernels.resident_pages(table, num_pages)
    assert torch.equal(out, torch_scoring.resident_pages(table, num_pages))
    for b in range(4):
        for h in range(3):
            want = [m for m in range(int(num_pages[b, h])) if table[b, h, m] != 0]
            assert out[b, h].tolist() == want + [-1] * (out.shape[-1] - len(want))


def test_a_killed_lock_holder_does_not_block_the_next_run(tmp_path):
    """A process killed while it holds the build lock (and leaves torch's own lock file behind) does not hang the
    next process: the flock dies with its holder and the stale torch lock is cleared."""
    import os
    import signal
    import subprocess
    import sys

    from systems.engine.ops import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no C++ toolchain: the torch path needs no lock")
    folder = cpu_kernels.build_dir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"h = open({str(folder / 'kvharness.lock')!r}, 'a+'); fcntl.flock(h, fcntl.LOCK_EX)\n"
        f"open({str(folder / 'lock')!r}, 'w').close()\n"     # torch's baton, left behind by the kill
        "print('held', flush=True); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert (folder / "lock").exists()
    env = {**os.environ, "KVHARNESS_BUILD_WAIT_S": "60"}
    proc = subprocess.run([sys.executable, "-c", "from systems.engine.ops import cpu_kernels as k; "
                           "print(k.available())"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("True"), proc.stderr[-2000:]
    assert not (folder / "lock").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_prompt_equals_the_torch_path_bit_for_bit(dtype):
    """Chunks of a prompt stored one after another (the first page shared by two chunks, a partial last page)
    leave the same pools and MinMax bounds as the torch reference."""
    from systems.engine.ops import torch_kv
    assert cpu_kernels.available() and hasattr(torch.ops.kvharness_cpu, "store_prompt")
    P, H, D, M = 16, 3, 64, 8
    g = torch.Generator().manual_seed(0)
    table = (torch.randperm(40, generator=g)[:H * M].view(H, M) + 1).int()
    state = {}
    for name, op in (("torch", torch_kv.store_prompt), ("cpu", cpu_kernels.store_prompt)):
        pools = [torch.zeros(41, P, D, dtype=dtype) for _ in range(2)]
        bounds = [torch.zeros(2, H, M, D, dtype=dtype)[1] for _ in range(2)]       # a strided (slot, layer) view
        gen = torch.Generator().manual_seed(1)
        start = 0
        for n in (21, 40, 50):
            k, v = (torch.randn(n, H, D, generator=gen).to(dtype) for _ in range(2))
            op(*pools, *bounds, table[:, :-(-(start + n) // P)], k, v, start)
            start += n
        state[name] = pools + bounds
    assert all(torch.equal(a, b) for a, b in zip(state["torch"], state["cpu"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_steps_decode_rows_take_the_fused_steps_append_and_attention(dtype):
    """The per-op path's decode rows (a mixed step's) append through the fused step's op, with the torch path's
    values bit for bit, and attend through its attention op, with the decode_attention op's bits (all pages, or
    per-query-head page sets)."""
    import copy

    from systems.engine.kv_cache import TieredKVCache
    from systems.engine.ops import torch_kv
    assert cpu_kernels.has_fused_decode()
    kv = TieredKVCache(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16, max_seqs=3,
                       max_model_len=1024, device_memory_gb=0.01, host_memory_gb=0.001, dtype=dtype,
                       device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for slot, n in ((0, 600), (2, 47)):
        kv.store_prefill(slot, 1, *(torch.randn(n, 2, 64, generator=g).to(dtype) for _ in range(2)))
    slots = torch.tensor([2, 0])
    kv.allocate_decode(slots, kv.decode_blocks_needed(slots))
    k, v = (torch.randn(2, 2, 64, generator=g).to(dtype) for _ in range(2))
    ref = copy.deepcopy([kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin, kv.kmax])
    torch_kv.append_decode(*ref, slots, 1, k, v)
    cpu_kernels.append_decode(kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin, kv.kmax, slots, 1, k, v)
    # bit patterns, not values: the MinMax cache is allocated empty, and its untouched rows may hold NaNs
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.int32: torch.int32}
    assert all(torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype])) for a, b in zip(
        ref, [kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin, kv.kmax]))
    q = torch.randn(2, 6, 64, generator=g).to(dtype)
    store = (kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin, kv.kmax, slots, 1)
    table, counts = kv.decode_tables(slots, 1)
    assert torch.equal(cpu_kernels.layer_decode_attention(q, *store, None, kv.scale),
                       cpu_kernels.paged_decode_attention(q, kv.k_pool, kv.v_pool, table, counts, kv.scale))
    selected = torch.tensor([[[0, 2, -1]] * 6, [[37, 5, 1]] * 6])                    # per query head, padded
    full, cnt = kv.block_table[slots, 1].repeat_interleave(3, 1), kv.num_tokens[slots, 1].repeat_interleave(3, 1)
    assert torch.equal(cpu_kernels.layer_decode_attention(q, *store, selected, kv.scale),
                       cpu_kernels.sparse_decode_attention(q, kv.k_pool, kv.v_pool, full, cnt, selected, kv.scale))
