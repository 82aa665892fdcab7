"""Every Triton engine kernel against its torch reference, under TRITON_INTERPRET=1 on CPU (real GPU if set to 0)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.7.1 --no-deps)")

from systems.base import GenerationRequest  # noqa: E402
from systems.engine.engine import Engine  # noqa: E402
from systems.engine.ops import torch_attention, torch_kv, torch_scoring, triton_attention, triton_kv, triton_scoring  # noqa: E402  # noqa: E402
from systems.policies.base import Policy  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEV = torch.device("cpu" if INTERPRET else "cuda")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}
# fp16 pools take the kernels' tensor-core branch (low-precision tl.dot), which bf16 takes on a GPU; the interpreter
# cannot run bf16 dots, so fp16 is how that branch is checked here
PAGE_DTYPES = [pytest.param(P, dt, id=f"P{P}-{str(dt)[6:]}")
               for P, dt in [(16, torch.float32), (16, torch.bfloat16), (16, torch.float16),
                             (32, torch.float32), (32, torch.bfloat16)]]

# (batch, query heads, KV heads): GQA groups 1, 3 (SmolLM2's 9/3) and 4; the interpreter runs programs one by one,
# so batches stay small
SHAPES = [(1, 2, 2), (2, 9, 3), (3, 8, 2)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _paged(B, Hq, Hkv, D, P, M, dtype, seed):
    """Pools with every (seq, KV head) owning M shuffled blocks, ragged token counts (a partial last page, a
    single-token head, a head filling whole pages), and one decode query per sequence."""
    g = _gen(seed)
    nblocks = 1 + B * Hkv * M
    k_pool = torch.randn(nblocks, P, D, generator=g).to(dtype)
    v_pool = torch.randn(nblocks, P, D, generator=g).to(dtype)
    table = (torch.randperm(nblocks - 1, generator=g) + 1).view(B, Hkv, M).to(torch.int32)
    counts = torch.randint(1, M * P + 1, (B, Hkv), generator=g).to(torch.int32)
    counts.view(-1)[0] = 1
    if counts.numel() > 1:
        counts.view(-1)[1] = 2 * P + 5
    if counts.numel() > 2:
        counts.view(-1)[2] = M * P
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    return q, k_pool, v_pool, table, counts


def _poison_unread(pool, table, counts, P, selected=None):
    """A copy of the pool with NaN wherever a correct kernel must not read: the null block, unlisted (or unselected)
    pages and the slots past the last token of each head's last page."""
    M = table.shape[-1]
    fill = (counts.long().unsqueeze(-1) - torch.arange(M) * P).clamp(0, P)          # [B, Hkv, M] valid slots
    if selected is not None:
        chosen = (selected.unsqueeze(-1) == torch.arange(M)).any(-2)                 # [B, Hkv, M]
        fill = torch.where(chosen, fill, 0)
    readable = torch.zeros(pool.shape[:2], dtype=torch.bool)
    readable[table.long()] = torch.arange(P) < fill.unsqueeze(-1)
    return torch.where(readable.unsqueeze(-1), pool, float("nan")).to(pool.dtype)


def _to(dev, *ts):
    return [t.to(dev) for t in ts]


def test_available_means_compiled_on_cuda():
    assert triton_attention.available() == (torch.cuda.is_available() and not INTERPRET)
    assert triton_kv.available() == triton_scoring.available() == triton_attention.available()


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.bfloat16)])
def test_store_kv_matches_reference(src, dst):
    g = _gen(1)
    P, D, T = 16, 48, 45                           # D not a power of two: the column mask is exercised
    ref_k, ref_v = torch.zeros(8, P, D, dtype=dst), torch.zeros(8, P, D, dtype=dst)
    k, v = torch.randn(T, D, generator=g).to(src), torch.randn(T, D, generator=g).to(src)
    flat = torch.randperm(7 * P, generator=g)[:T] + P          # unique (block, offset), never block 0
    blocks, offsets = (flat // P).to(torch.int32), (flat % P).to(torch.int32)
    torch_kv.store_kv(ref_k, ref_v, k, v, blocks, offsets)
    out_k, out_v, kd, vd, bd, od = _to(DEV, torch.zeros_like(ref_k), torch.zeros_like(ref_v), k, v, blocks, offsets)
    triton_kv.store_kv(out_k, out_v, kd, vd, bd, od)
    # the interpreter's fp32 -> bf16 cast is not torch's round-to-nearest: at most one bf16 ulp apart
    tol = dict(atol=0, rtol=0) if src == dst else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(out_k.cpu(), ref_k, **tol)
    torch.testing.assert_close(out_v.cpu(), ref_v, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_minmax_and_page_minmax_match_reference(dtype):
    g = _gen(2)
    P, D, rows = 16, 64, 6
    k_pool = torch.zeros(rows + 1, P, D, dtype=dtype)
    ref_lo, ref_hi = torch.full((rows, D), 3.0, dtype=dtype), torch.full((rows, D), -3.0, dtype=dtype)
    lo, hi = _to(DEV, ref_lo, ref_hi)
    fill = [0] * rows
    for _ in range(5):                             # batched appends, some rows starting a fresh page
        r = torch.randperm(rows, generator=g)[:4]
        keys = torch.randn(4, D, generator=g).to(dtype)
        first = torch.tensor([fill[int(i)] == 0 for i in r])
        for i, row in enumerate(r.tolist()):
            k_pool[row + 1, fill[row]] = keys[i]
            fill[row] += 1
        torch_kv.update_minmax(ref_lo, ref_hi, keys, r, first)
        triton_kv.update_minmax(lo, hi, *_to(DEV, keys, r, first))
        assert torch.equal(lo.cpu(), ref_lo) and torch.equal(hi.cpu(), ref_hi)
    listed = [i for i in range(rows) if fill[i] > 0]
    blocks, n = torch.tensor(listed) + 1, torch.tensor([fill[i] for i in listed])
    want = torch_kv.page_minmax(k_pool, blocks, n)
    got = triton_kv.page_minmax(*_to(DEV, k_pool, blocks, n))
    assert got[0].dtype == dtype
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert torch.equal(got[0].cpu(), ref_lo[listed]) and torch.equal(got[1].cpu(), ref_hi[listed])


@pytest.mark.parametrize("P,dtype", PAGE_DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv", SHAPES)
def test_paged_decode_attention_matches_reference(B, Hq, Hkv, P, dtype):
    D, M = 32, 6
    q, k_pool, v_pool, table, counts = _paged(B, Hq, Hkv, D, P, M, dtype, seed=10 * B + P)
    scale = D ** -0.5
    ref = torch_attention.paged_decode_attention(q, k_pool, v_pool, table, counts, scale)
    k_bad, v_bad = _poison_unread(k_pool, table, counts, P), _poison_unread(v_pool, table, counts, P)
    args = _to(DEV, q, k_bad, v_bad, table, counts)
    out = triton_attention.paged_decode_attention(*args, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])
    out = triton_attention._decode(*args, None, scale, pages_per_split=4)     # split-K: 6 pages = 4 + 2, merged
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])


def _selection(table, counts, P, K, seed):
    """Random distinct logical pages per head (any order, the last page sometimes in), padded with -1 to K."""
    g = _gen(seed)
    B, Hkv, _ = table.shape
    selected = torch.full((B, Hkv, K), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(Hkv):
            n_pages = -(-int(counts[b, h]) // P)
            pick = torch.randperm(n_pages, generator=g)[:int(torch.randint(1, K + 1, (1,), generator=g))]
            selected[b, h, :pick.numel()] = pick
            selected[b, h] = selected[b, h, torch.randperm(K, generator=g)]     # padding interleaved too
    return selected


@pytest.mark.parametrize("P,dtype", PAGE_DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv", SHAPES)
def test_sparse_decode_reads_only_selected_pages(B, Hq, Hkv, P, dtype):
    D, M, K = 32, 7, 4
    q, k_pool, v_pool, table, counts = _paged(B, Hq, Hkv, D, P, M, dtype, seed=100 + 10 * B + P)
    selected = _selection(table, counts, P, K, seed=B + P)
    scale = D ** -0.5
    sel_table, sel_counts = torch_attention.gather_selected(table, counts, selected, P)
    ref = torch_attention.paged_decode_attention(q, k_pool, v_pool, sel_table, sel_counts, scale)
    k_bad = _poison_unread(k_pool, table, counts, P, selected)
    v_bad = _poison_unread(v_pool, table, counts, P, selected)
    qd, kd, vd, td, cd, sd = _to(DEV, q, k_bad, v_bad, table, counts, selected)
    out = triton_attention.sparse_decode_attention(qd, kd, vd, td, cd, sd, scale)
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])
    out = triton_attention._decode(qd, kd, vd, td, cd, sd, scale, pages_per_split=2)
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])
    # the reference sparse path (the dense kernel over the gathered table) agrees too
    out = triton_attention.paged_decode_attention(qd, kd, vd, *_to(DEV, sel_table, sel_counts), scale)
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv", SHAPES)
def test_page_scores_matches_reference(B, Hq, Hkv, dtype):
    g = _gen(7 + B)
    D, M = 64, 45                                  # M spans two page blocks, the second one partial
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    a, b = torch.randn(B, Hkv, M, D, generator=g), torch.randn(B, Hkv, M, D, generator=g)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    num_pages = torch.randint(1, M + 1, (B, Hkv), generator=g)
    num_pages.view(-1)[0] = 1
    ref = torch_scoring.page_scores(q, kmin, kmax, num_pages)
    out = triton_scoring.page_scores(*_to(DEV, q, kmin, kmax, num_pages))
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(torch.isinf(out.cpu()), torch.isinf(ref))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-5)
    # the output feeds torch.topk directly: the same page sets as the reference's (rows with k real pages)
    k = 3
    full = num_pages >= k
    pick = lambda s: s.topk(k, -1).indices.sort(-1).values[full]  # noqa: E731
    assert torch.equal(pick(out.cpu()), pick(ref))


class _FirstAndLastPages(Policy):
    """Test policy: each head reads only its first and its (partial) last page, so decode takes the sparse path."""

    name = "first_and_last"

    def select_pages(self, kv, step):
        last = (kv.num_tokens[step.slots, step.layer].long() - 1) // kv.page_size           # [B, Hkv]
        return torch.stack([torch.zeros_like(last), torch.where(last > 0, last, -1)], -1)


def _swap_in_triton(engine):
    """Point the engine's op table at the Triton kernels."""
    ops = engine.ops
    for name in ("store_kv", "update_minmax", "page_minmax"):
        setattr(ops, name, getattr(triton_kv, name))
    ops.paged_decode_attention = triton_attention.paged_decode_attention
    ops.sparse_decode_attention = triton_attention.sparse_decode_attention


@pytest.mark.skipif(not INTERPRET, reason="the engine here runs on CPU tensors")
def test_engine_generates_the_same_tokens_with_triton_ops(tmp_path):
    """Prefill stores, decode appends + MinMax, sparse attention over gathered tables: torch ops vs Triton ops."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, head_dim=16, initializer_range=0.15,
                                 max_position_embeddings=256)).save_pretrained(tmp_path)
    cfg = SimpleNamespace(page_size=16, device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=4,
                          max_num_batched_tokens=128)
    g = _gen(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 7, 16)]

    def run(triton_ops: bool):
        engine = Engine(str(tmp_path), _FirstAndLastPages(), cfg, dtype="float32", device="cpu")
        if triton_ops:
            _swap_in_triton(engine)
        reqs = [GenerationRequest(str(i), p, 6, ignore_eos=True) for i, p in enumerate(prompts)]
        return [s.output_ids for s in engine.generate(reqs)]

    assert run(triton_ops=True) == run(triton_ops=False)


GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu_check runs for real")
def test_gpu_check_refuses_without_cuda(tmp_path):
    run = subprocess.run([sys.executable, str(GPU_CHECK), "--out", str(tmp_path)], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=120)
    assert run.returncode == 2 and len(run.stdout.strip().splitlines()) == 1 and "CUDA" in run.stdout
    assert not any(tmp_path.iterdir())


def test_gpu_kernels_compile_for_hopper():
    """The GPU branches (bf16 tensor-core dots, split-K merge, every kernel) built to sm_90 cubins without a GPU."""
    run = subprocess.run([sys.executable, str(GPU_CHECK), "--compile-only", "--arch", "90"], capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    built = [line for line in run.stdout.splitlines() if line.startswith("compiled ")]
    assert len(built) == 8 and all("sm_90" in line for line in built), run.stdout
    assert sum("tensor-core" in line for line in built) == 2, run.stdout     # bf16 dense and sparse attention


@pytest.mark.slow
def test_gpu_check_cpu_smoke_run_writes_a_passing_report(tmp_path):
    run = subprocess.run([sys.executable, str(GPU_CHECK), "--interpret", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# gpu-check: PASS") and "sparse_decode_attention | pass" in report
    assert (tmp_path / "report.json").exists()


def test_page_scores_read_rows_and_heads_in_place():
    """kv.score_pages' call: one layer's strided MinMax view, a subset of slots and KV heads, read in place."""
    g = _gen(11)
    S, L, Hkv, M, D, G = 5, 3, 4, 20, 64, 3
    a, b = torch.randn(S, L, Hkv, M, D, generator=g), torch.randn(S, L, Hkv, M, D, generator=g)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    rows, heads = torch.tensor([4, 0, 2]), torch.tensor([3, 1])
    q = torch.randn(3, 2 * G, D, generator=g)
    num_pages = torch.tensor([[20, 7], [1, 13], [19, 20]])
    ref = torch_scoring.page_scores(q, kmin[:, 1, :, :18], kmax[:, 1, :, :18], num_pages, rows, heads)
    qd, kd, hd, nd, rd, head_d = _to(DEV, q, kmin, kmax, num_pages, rows, heads)
    out = triton_scoring.page_scores(qd, kd[:, 1, :, :18], hd[:, 1, :, :18], nd, rd, head_d)
    assert out.shape == (3, 2, 18)
    assert torch.equal(torch.isinf(out.cpu()), torch.isinf(ref))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-5)
