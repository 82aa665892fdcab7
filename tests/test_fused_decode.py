"""The fused CPU decode step (ops/cpu_decoder.cpp + cpu_gemm.cpp) against the per-op path, and its skinny GEMM.

The per-op path multiplies decode rows with the same skinny product (Linear.rows), so the two paths must agree bit
for bit: every chosen token and the bits of its log-probability, for every policy, in bf16 and fp32, with and
without a sliding window.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.ops import cpu_kernels
from systems.hardware import cpu_flags
from systems.policies import load_policy
from tests.test_engine_invariants import MODULE, POLICIES

pytestmark = pytest.mark.skipif(not cpu_kernels.has_fused_decode(), reason="CPU kernels not built")


def _reference_product(x, w, b):
    return x.double() @ w.double().T + (0 if b is None else b.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_rows_do_not_depend_on_the_batch_or_threads(dtype):
    """Each output row is computed from its own input row alone: the same bits alone, in any batch of 1-37 rows, in
    any split of the batch and on 1 or 2 threads; and it is the product, within one rounding of the dtype."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(203, 100, generator=g).to(dtype)      # 203 outputs, K 100: partial panels, odd K
    b = torch.randn(203, generator=g).to(dtype)
    x = torch.randn(37, 100, generator=g).to(dtype)
    packed = torch.ops.kvharness_cpu.skinny_pack(w)

    def op(rows, bias=b):
        return torch.ops.kvharness_cpu.skinny_linear(rows, packed, bias, 203)

    assert op(x[:0]).shape == (0, 203)
    full = op(x)
    alone = torch.cat([op(x[i:i + 1]) for i in range(37)])
    assert torch.equal(full, alone)
    for split in (2, 3, 5, 7, 9):
        assert torch.equal(torch.cat([op(c) for c in x.split(split)]), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        assert torch.equal(op(x), full)
    finally:
        torch.set_num_threads(threads)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full.double(), _reference_product(x, w, b), rtol=tol, atol=tol * 10)
    torch.testing.assert_close(op(x, None).double(), _reference_product(x, w, None), rtol=tol, atol=tol * 10)


def test_skinny_product_is_one_fma_chain_per_output():
    """The documented order, checked in fp32 against a scalar emulation: acc = fma(x_k, w_k, acc) for k = 0..K-1
    from zero (exact products rounded with the running sum once each, as math.fma would), then + bias."""
    import numpy as np

    g = torch.Generator().manual_seed(5)
    w, x, b = torch.randn(40, 33, generator=g), torch.randn(2, 33, generator=g), torch.randn(40, generator=g)
    y = torch.ops.kvharness_cpu.skinny_linear(x, torch.ops.kvharness_cpu.skinny_pack(w), b, 40)
    for m in range(2):
        for n in range(40):
            acc = np.float32(0)
            for k in range(33):     # an fp32 fma, emulated in float64 (which holds the product exactly)
                acc = np.float32(np.float64(x[m, k].item()) * np.float64(w[n, k].item()) + np.float64(acc))
            assert y[m, n].item() == np.float32(acc + np.float32(b[n].item()))


def _skinny(x, w, b, n):
    return torch.ops.kvharness_cpu.skinny_linear(x, torch.ops.kvharness_cpu.skinny_pack(w), b, n)


@pytest.mark.parametrize("K", [2, 64, 576, 1536])
def test_bf16_pairs_are_the_fma_chain_bit_for_bit(K):
    """On CPUs with AVX512-BF16 a bf16 weight is packed in pairs of k for vdpbf16ps, which must compute exactly the
    fp32 FMA chain: the fp32 product of the same (bf16) values, rounded once to bf16, for any row count; bf16 rows
    and fp32 rows holding bf16 values alike. Elsewhere the bf16 weight keeps the FMA chain, and this holds too."""
    g = torch.Generator().manual_seed(K)
    N = 203
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    x = torch.randn(37, K, generator=g).bfloat16()
    x[3, : K // 2] = 0                                             # zeros are fine factors
    packed = torch.ops.kvharness_cpu.skinny_pack(w)
    P = torch.ops.kvharness_cpu.skinny_pack(torch.zeros(1, 2)).shape[-1]
    pairs = "avx512_bf16" in cpu_flags()
    assert packed.shape == ((N + P - 1) // P, K // 2, 2 * P) if pairs else ((N + P - 1) // P, K, P)
    chain = _skinny(x.float(), w.float(), b.float(), N).bfloat16()     # the fp32 path: the same chain, then rounded
    for rows in (1, 4, 6, 7, 16, 37):
        assert torch.equal(_skinny(x[:rows], w, b, N), chain[:rows])
        assert torch.equal(_skinny(x[:rows].float(), w, b, N), chain[:rows])
    assert torch.equal(_skinny(x, w, None, N), _skinny(x.float(), w.float(), None, N).bfloat16())


def test_bf16_pairs_fall_back_to_the_fma_chain_where_a_subnormal_could_appear():
    """A factor below 2^-56 could make a product or a partial sum subnormal, which vdpbf16ps flushes to zero: rows
    holding one run the FMA chain over the same pairs, a weight holding one is packed for the FMA chain, and fp32
    rows that are not bf16 values run the FMA chain of their fp32 values; each is still the chain, bit for bit."""
    g = torch.Generator().manual_seed(11)
    N, K = 70, 64
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    x = torch.randn(5, K, generator=g).bfloat16()
    x[1, 7], x[2, 0] = 2.0 ** -60, -(2.0 ** -130)                 # tiny, and subnormal
    x[2, 1] = 2.0 ** -70                                           # their product with x[2, 0]'s weight: subnormal
    chain = _skinny(x.float(), w.float(), None, N).bfloat16()
    assert torch.equal(_skinny(x, w, None, N), chain)
    assert torch.equal(_skinny(x[1:3], w, None, N), chain[1:3])
    tiny_w = w.clone()
    tiny_w[5, 9] = 2.0 ** -100
    assert torch.ops.kvharness_cpu.skinny_pack(tiny_w).shape[1] == K            # not pairs
    assert torch.equal(_skinny(x, tiny_w, None, N), _skinny(x.float(), tiny_w.float(), None, N).bfloat16())
    odd = w[:, :63].contiguous()                                                  # an odd K keeps the FMA chain
    assert torch.ops.kvharness_cpu.skinny_pack(odd).shape[1] == 63
    assert torch.equal(_skinny(x[:, :63], odd, None, N), _skinny(x[:, :63].float(), odd.float(), None, N).bfloat16())
    wide = torch.randn(3, K, generator=g)                                        # fp32 rows, not bf16 values
    assert torch.equal(_skinny(wide, w, None, N), _skinny(wide, w.float(), None, N).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_product_on_two_threads_is_the_one_thread_product(dtype):
    """Decode runs its products on every core: with 48 panels the second thread surely takes some, and its rows must
    read the caller's activations and bias (a buffer kept per thread is the caller's, never the worker's own)."""
    g = torch.Generator().manual_seed(17)
    w = (torch.randn(3072, 576, generator=g) * 0.05).to(dtype)
    b = torch.randn(3072, generator=g).to(dtype)
    packed = torch.ops.kvharness_cpu.skinny_pack(w)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 5, 32):
            x = torch.randn(rows, 576, generator=g).to(dtype)
            torch.set_num_threads(1)
            alone = torch.ops.kvharness_cpu.skinny_linear(x, packed, b, 3072)
            torch.set_num_threads(2)
            assert torch.equal(torch.ops.kvharness_cpu.skinny_linear(x, packed, b, 3072), alone)
    finally:
        torch.set_num_threads(threads)


def test_skinny_product_rejects_what_the_packing_did_not_make():
    """One entry reads the packed layout for every caller, and refuses, by name, an unpacked weight, an n its panels
    cannot hold, a bias of another length or dtype and rows of another K."""
    w = torch.randn(70, 64).bfloat16()
    packed = torch.ops.kvharness_cpu.skinny_pack(w)
    x = torch.randn(2, 64).bfloat16()
    op = torch.ops.kvharness_cpu.skinny_linear
    with pytest.raises(RuntimeError, match="packed by skinny_pack"):
        op(x, w, None, 70)                                          # 2-D: never packed
    with pytest.raises(RuntimeError, match="n does not match"):
        op(x, packed, None, 300)
    with pytest.raises(RuntimeError, match=r"bias \[n\]"):
        op(x, packed, torch.zeros(69).bfloat16(), 70)
    with pytest.raises(RuntimeError, match=r"bias \[n\]"):
        op(x, packed, torch.zeros(70), 70)
    with pytest.raises(RuntimeError, match="packed weight's K"):
        op(x[:, :32], packed, None, 70)
    assert torch.equal(op(x, packed, None, 70), op(x.float(), packed, None, 70))    # same chain from bf16 or fp32


@pytest.fixture(scope="module")
def tiny_window_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Mistral with a 24-token sliding window (shorter than the prompts)."""
    from transformers import MistralConfig

    from tests.conftest import _save_tiny
    cfg = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                        sliding_window=24, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return _save_tiny(tmp_path_factory.mktemp("tiny_window"), cfg, tokenizer_dir)


def _run(path, policy_name: str, dtype: str, fused: bool) -> tuple[list, bool]:
    P = 4
    cfg = SimpleNamespace(page_size=P, device_memory_gb=4096 * 2 * P * 16 * 4 / 2 ** 30,
                          host_memory_gb=4096 * 2 * P * 16 * 4 / 2 ** 30, max_num_seqs=4,
                          max_num_batched_tokens=512, batch_invariant=True, fused_decode=fused)
    policy = load_policy(MODULE.get(policy_name, policy_name), POLICIES[policy_name])
    engine = Engine(str(path), policy, cfg, dtype=dtype)
    rng = random.Random(11)
    requests = [GenerationRequest(f"r{i}", [rng.randrange(3, 49000) for _ in range(rng.randint(30, 70))], 14,
                                  ignore_eos=True, logprob_steps=0) for i in range(3)]
    seqs = engine.generate(requests)
    return [(s.output_ids, s.token_logprobs) for s in seqs], engine.runner.fused is not None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_fused_step_equals_the_per_op_step(tiny_llama_dir, name, dtype):
    """Every policy's hooks (page selection, decode-time eviction, promotion) run between the fused halves of each
    layer exactly as between the per-op layer's ops: identical tokens and log-probability bits."""
    fused, active = _run(tiny_llama_dir, name, dtype, fused=True)
    per_op, inactive = _run(tiny_llama_dir, name, dtype, fused=False)
    assert active and not inactive
    assert fused == per_op


@pytest.mark.parametrize("name", ["dense", "quest", "streaming"])
def test_fused_step_honours_sliding_windows(tiny_window_dir, name):
    fused, active = _run(tiny_window_dir, name, "float32", fused=True)
    per_op, _ = _run(tiny_window_dir, name, "float32", fused=False)
    assert active
    assert fused == per_op


def test_fused_step_states_why_it_cannot_run(tiny_llama_dir):
    """A model the fused layer does not cover (here: fp16) keeps the per-op path and says why."""
    from systems.engine import fused_decode
    from systems.engine.kv_cache import TieredKVCache
    from systems.engine.models.llama import LlamaModel

    model = LlamaModel(tiny_llama_dir, torch.float16, torch.device("cpu"))
    s = model.spec
    kv = TieredKVCache(num_layers=s.num_layers, num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
                       head_dim=s.head_dim, page_size=4, max_seqs=1, max_model_len=64, device_memory_gb=0.001,
                       host_memory_gb=0.001, dtype=torch.float16, device=torch.device("cpu"))
    assert "dtype" in fused_decode.unsupported(model, kv)
