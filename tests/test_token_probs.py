"""token_probs (a decode-time eviction's scores): the attention of each row's query over the tokens its KV heads hold,
read through a paged table; torch reference and CPU kernel, exact per row whatever the batch or thread count."""
from __future__ import annotations

import pytest
import torch

from systems.engine.ops import cpu_kernels, torch_attention

P, HKV, G, D = 16, 3, 3, 64
SCALE = D ** -0.5
IMPLS = {"torch": torch_attention.token_probs, "cpu": cpu_kernels.token_probs}


def _rows(dtype: torch.dtype, lengths: list[list[int]], seed: int = 0, page: int = P):
    """A shuffled paged pool holding rows of the given per-head lengths: (q, pool, tables, counts, keys per row)."""
    g = torch.Generator().manual_seed(seed)
    pages = max(-(-n // page) for row in lengths for n in row)
    blocks = torch.randperm(len(lengths) * HKV * pages, generator=g).view(len(lengths), HKV, pages).int() + 1
    pool = torch.randn(int(blocks.max()) + 1, page, D, generator=g).to(dtype)
    q = torch.randn(len(lengths), HKV * G, D, generator=g).to(dtype)
    counts = torch.tensor(lengths, dtype=torch.int32)
    keys = [[pool[blocks[r, h].long()].reshape(-1, D)[:n] for h, n in enumerate(row)] for r, row in enumerate(lengths)]
    return q, pool, blocks, counts, keys


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# pages of 16 tokens, fewer (8) and more than the kernel's 16-token chunks, 24 of them not a multiple of the chunk
@pytest.mark.parametrize("page", [16, 8, 24])
def test_probabilities_are_each_heads_softmax_over_its_own_tokens(impl, dtype, page):
    if impl == "cpu" and not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    lengths = [[300, 17, 256], [1, 40, 129]]                   # page edges, a partial last page, uneven heads
    q, pool, tables, counts, keys = _rows(dtype, lengths, page=page)
    got = IMPLS[impl](q, pool, tables, counts, SCALE, 310)
    assert got.shape == (2, HKV * G, 310) and got.dtype == torch.float32
    for r, row in enumerate(lengths):
        for h in range(HKV * G):
            n = row[h // G]
            expect = (q[r, h].double() @ keys[r][h // G].double().T * SCALE).softmax(-1)
            assert torch.allclose(got[r, h, :n].double(), expect, atol=2e-6)
            assert bool((got[r, h, n:] == 0).all())


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_rows_probabilities_do_not_depend_on_the_batch_or_threads(impl):
    """Eviction compares these probabilities, so a row must be bit-identical alone, beside longer rows and (the
    kernel) on 1 or 2 threads: decoding must not depend on batch composition."""
    if impl == "cpu" and not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    lengths = [[37, 37, 30], [301, 290, 301], [129, 129, 129]]
    q, pool, tables, counts, _ = _rows(torch.bfloat16, lengths, seed=3)
    together = IMPLS[impl](q, pool, tables, counts, SCALE, 301)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for r, row in enumerate(lengths):
                width = max(row)
                alone = IMPLS[impl](q[r:r + 1], pool, tables[r:r + 1, :, :-(-width // P)], counts[r:r + 1], SCALE,
                                    width)
                assert torch.equal(together[r, :, :width], alone[0])
    finally:
        torch.set_num_threads(threads)


def test_kernel_equals_the_torch_reference_closely():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    assert hasattr(torch.ops.kvharness_cpu, "token_probs")         # built: the cpu cases above ran the kernel
    q, pool, tables, counts, _ = _rows(torch.bfloat16, [[500, 333, 64], [2, 2, 2]], seed=5)
    ref = torch_attention.token_probs(q, pool, tables, counts, SCALE, 500)
    got = cpu_kernels.token_probs(q, pool, tables, counts, SCALE, 500)
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_groups_larger_than_the_vector_kernel_holds_take_the_general_path(impl):
    """17 query heads on one KV head: more than the AVX512-BF16 path keeps (16), so the kernel takes its general
    path; both still return each head's softmax."""
    if impl == "cpu" and not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    g = torch.Generator().manual_seed(9)
    pool = torch.randn(5, P, D, generator=g).to(torch.bfloat16)
    tables = torch.tensor([[[3, 1, 4]]], dtype=torch.int32)
    q = torch.randn(1, 17, D, generator=g).to(torch.bfloat16)
    keys = pool[tables[0, 0].long()].reshape(-1, D)[:40]
    got = IMPLS[impl](q, pool, tables, torch.tensor([[40]], dtype=torch.int32), SCALE, 48)
    expect = (q[0].double() @ keys.double().T * SCALE).softmax(-1)
    assert torch.allclose(got[0, :, :40].double(), expect, atol=2e-6) and bool((got[0, :, 40:] == 0).all())
