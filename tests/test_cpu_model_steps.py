"""The fused decoder steps (ops/cpu_model.cpp) round where the torch expressions round: bf16 results equal torch's."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from systems.engine.models.llama import LlamaModel, rotate_half
from systems.engine.ops import cpu_kernels
from systems.hardware import cpu_flags

pytestmark = pytest.mark.skipif(not cpu_kernels.toolchain(), reason="no C++ compiler: the torch path is used")


def test_model_steps_are_built():
    assert cpu_kernels.has_model_steps()


def _ops():
    return torch.ops.kvharness_cpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_residual_add_equal_torch_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    T, H, D = 37, 12, 64
    qkv = torch.randn(T, H * D + 3 * D, generator=g).to(dtype)
    qk = qkv[:, :H * D].view(T, H, D)               # a strided view of the projection, rotated in place
    cos, sin = torch.randn(T, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype)
    want = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    _ops().rope_(qk, cos, sin)
    assert torch.equal(qk, want)
    h, delta = torch.randn(T, 576, generator=g).to(dtype), torch.randn(T, 576, generator=g).to(dtype)
    summed = h + delta
    _ops().add_rms_norm(h, delta, torch.ones(576, dtype=dtype), 1e-5)
    assert torch.equal(h, summed)


def test_bf16_norm_and_gate_equal_torch():
    """RMSNorm's fp32 sum of squares and SiLU's exp are computed differently from torch's, but both are rounded to
    bf16 at the same points, so the outputs agree to the bit (one ulp allowed on a handful of ties)."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(64, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()
    xf = h.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    got = _ops().add_rms_norm(h.clone(), None, w, 1e-5)
    gate_up = (3 * torch.randn(64, 2 * 1536, generator=g)).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    for out, ref in ((got, want), (_ops().silu_mul(gate_up), F.silu(gate) * up)):
        assert (out != ref).float().mean() < 1e-3
        torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=1e-6)


@pytest.mark.skipif(not ({"avx2"} <= cpu_flags() and "avx512_bf16" not in cpu_flags()),
                    reason="the 8-lane gate is built only for AVX2 CPUs without AVX512-BF16")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_avx2_gate_computes_what_the_scalar_loop_computes(dtype):
    """Rows of 15 values: lanes 0-7 take the 8-lane path, 8-14 the scalar loop; the same inputs in both places must
    give the same bits, so the vector path changes speed only."""
    g = torch.Generator().manual_seed(3)
    gate = (4 * torch.randn(4096, 8, generator=g)).to(dtype)
    gate[:7, 0] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, 87.5, -88.5]).to(dtype)   # clamps, zeros, tiny
    up = torch.randn(4096, 8, generator=g).to(dtype)
    gate_up = torch.cat([gate, gate[:, :7], up, up[:, :7]], dim=1)
    out = _ops().silu_mul(gate_up)
    assert torch.equal(out[:, 8:], out[:, :7])


def test_fp32_steps_match_torch():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(9, 64, generator=g), torch.randn(64, generator=g)
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(_ops().add_rms_norm(h.clone(), None, w, 1e-6), want, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(9, 256, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(_ops().silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_forward_with_fused_steps_matches_torch_steps(tiny_llama_dir, dtype):
    model = LlamaModel(tiny_llama_dir, dtype, torch.device("cpu"))
    assert model.fused is not None
    ids, positions = torch.randint(3, 1000, (40,)), torch.arange(40)

    def attend(layer, q, k, v):     # plain causal attention: the steps around it are what is compared
        out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                             v.transpose(0, 1).float(), is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).to(dtype)

    with torch.inference_mode():
        fused = model.forward(ids, positions, attend)
    with pytest.raises(RuntimeError, match="autograd=True"):
        model.forward(ids, positions, attend)           # gradients on: the kernels would silently drop them
    plain = LlamaModel(tiny_llama_dir, dtype, torch.device("cpu"), autograd=True).forward(ids, positions, attend)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused.float(), plain.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 5, 16, 300])
def test_prepacked_bf16_weights_compute_what_f_linear_computes(rows):
    """The oneDNN-prepacked copy of a bf16 weight gives F.linear's bits at every row count (with and without a
    bias), so packing changes speed only; a CPU whose oneDNN has no bf16 kernels (AVX2-only) keeps F.linear."""
    from systems.engine.models.linear import Linear

    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(320, 96, generator=g).bfloat16(), torch.randn(320, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    for b in (None, bias):
        linear = Linear(weight, b)
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            assert linear.packed is not None and linear.wide is None
            assert linear.weight is weight          # kept for the fused decode step
        else:
            assert linear.packed is None and linear.weight is not None
            linear.wide = None          # the widened fp32 path has its own test below
        assert torch.equal(linear(x), F.linear(x, weight, b))
        padded = torch.cat([x, x.new_zeros(-rows % 16, 96)])
        with _one_thread():          # each tile is one call on one thread (test_prompt_tiles_...)
            want = torch.cat([F.linear(c, weight, b) for c in padded.split(16)])[:rows]
        assert torch.equal(linear(x, tile=16), want)
    assert Linear(weight.float()).packed is None        # fp32 keeps F.linear (MKL's kernel, not oneDNN's)



@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_prompt_tiles_do_not_depend_on_the_thread_count():
    """oneDNN splits a product among threads by their count, and on AMX CPUs it splits the sum over K of a narrow
    output (SmolLM2's down projection: 576 outputs of 1536 terms), so batch-invariant tiles run one per thread: each
    row's bits are the same at 1 and 2 threads, in any tile, and equal a one-thread call on its tile."""
    from systems.engine.models.linear import Linear

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(576, 1536, generator=g).bfloat16()
    x = torch.randn(700, 1536, generator=g).bfloat16()
    linear = Linear(weight)
    before = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = linear(x, tile=256), linear(x[256:300], tile=256)
            assert torch.get_num_threads() == threads          # the workers' one-thread setting stays inside
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1][0], got[2][0]) and torch.equal(got[1][1], got[2][1])
    assert torch.equal(got[2][0][256:300], got[2][1])            # a row's tile neighbours do not matter
    with _one_thread():
        padded = torch.cat([x, x.new_zeros(-700 % 256, 1536)])
        assert torch.equal(got[2][0], torch.cat([linear._mm(c) for c in padded.split(256)])[:700])

def test_emulated_bf16_runs_as_an_fp32_gemm_of_the_same_values(monkeypatch):
    """Where oneDNN has no bf16 kernels, prompt-sized GEMMs run in fp32 on the bf16 values and round once: a bf16
    GEMM with fp32 accumulation (within one bf16 rounding of the exact result); few rows keep the bf16 weight; and a
    row's result never depends on what shares its tile."""
    from systems.engine.models import linear as lin

    monkeypatch.setattr(lin, "emulates_bf16", lambda w: w.dtype == torch.bfloat16)
    monkeypatch.setattr(lin, "prepacked", lambda w, b: None)
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(320, 96, generator=g).bfloat16(), torch.randn(320, generator=g).bfloat16()
    layer = lin.Linear(weight, bias)
    assert layer.wide is not None and layer.wide[0].dtype == torch.float32
    few = torch.randn(lin.WIDEN_MIN_ROWS - 1, 96, generator=g).bfloat16()
    assert torch.equal(layer(few), F.linear(few, weight, bias))
    x = torch.randn(40, 96, generator=g).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), weight.float(), bias.float()).bfloat16())
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()     # one bf16 rounding
    # batch-invariant mode: a row gives the same bits wherever it sits in its tile and whatever shares it, and
    # every tile the engine uses is wide enough to take the widened path (no mix of paths within the mode)
    from systems.engine.config import DECODE_TILE, PREFILL_TILE
    assert min(DECODE_TILE, PREFILL_TILE) >= lin.WIDEN_MIN_ROWS
    row = x[5:6]
    alone = layer(row, tile=DECODE_TILE)
    for others, at in ((x[:20], 0), (torch.randn(30, 96, generator=g).bfloat16(), 11), (x[20:], 17)):
        batch = torch.cat([others[:at], row, others[at:]])
        assert torch.equal(layer(batch, tile=DECODE_TILE)[at:at + 1], alone)
    assert lin.Linear(weight, bias, prepack=False).wide is None        # the autograd path stays plain F.linear
