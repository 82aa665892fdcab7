"""The bf16 prompt-attention kernels (ops/cpu_prefill.cpp on vectors, ops/cpu_prefill_tiles.cpp on AMX tiles) against
the fp32 reference, and their chunk and thread invariance."""
from __future__ import annotations

import subprocess

import pytest
import torch

from systems.engine.ops import cpu_kernels, load_ops
from systems.engine.ops.torch_attention import prompt_attention
from systems.hardware import cpu_flags


def _native_macros() -> str:
    """The compiler's predefined macros for this CPU (-march=native), '' where there is no toolchain."""
    if not cpu_kernels.toolchain():
        return ""
    try:
        return subprocess.run([str(cpu_kernels.compiler()), "-march=native", "-dM", "-E", "-x", "c++", "-"],
                              input="", capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _builds_prompt_kernel() -> bool:
    """Whether the kernel gets compiled here: the CPU has AVX512-BF16 and the compiler targets it (-march=native)."""
    macros = _native_macros() if "avx512_bf16" in cpu_flags() else ""
    return "__AVX512BF16__" in macros and "__AVX512F__" in macros


def _builds_tile_kernel() -> bool:
    """Whether the AMX tile kernel gets compiled here too (the CPU and the compiler have AMX-BF16)."""
    macros = _native_macros() if "amx_bf16" in cpu_flags() else ""
    return _builds_prompt_kernel() and "__AMX_TILE__" in macros and "__AMX_BF16__" in macros


pytestmark = pytest.mark.skipif(not _builds_prompt_kernel(),
                                reason="the prompt kernel is built only for CPUs (and compilers) with AVX512-BF16")


def test_prompt_kernel_is_built():
    assert cpu_kernels.available() and hasattr(torch.ops.kvharness_cpu, "prompt_attention")
    assert cpu_kernels.bf16_prompt_kernel()


def test_tile_kernel_runs_where_the_cpu_has_amx():
    """On an AMX CPU the build has the tile kernel and Linux grants the process the tile state; elsewhere the op
    says it has none and multiplies on vectors."""
    assert bool(torch.ops.kvharness_cpu.prompt_tiles()) == _builds_tile_kernel()
    assert cpu_kernels.prompt_kernel_name() == ("AMX tile kernel" if _builds_tile_kernel() else "AVX512-BF16 kernel")


# tiles=False forces the vector kernel; tiles=True is the tile kernel where it runs (else the vector kernel again)
KERNELS = [pytest.param(False, id="vectors"),
           pytest.param(True, id="tiles", marks=pytest.mark.skipif(not _builds_tile_kernel(), reason="no AMX tiles"))]


def _qkv(S, Hq, Hkv, D, seed):
    """q, k, v as strided views of one packed projection, as the model hands them over."""
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(S, Hq + 2 * Hkv, D, generator=g)).to(torch.bfloat16)
    return qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]


@pytest.mark.parametrize("tiles", KERNELS)
@pytest.mark.parametrize("T,S,Hq,Hkv,D", [(37, 37, 9, 3, 64), (100, 250, 9, 3, 64), (1, 65, 4, 1, 128),
                                          (130, 130, 8, 2, 128), (64, 64, 3, 3, 64), (17, 1000, 9, 3, 64),
                                          (129, 300, 16, 1, 64), (200, 200, 2, 2, 128)])
def test_matches_fp32_reference(T, S, Hq, Hkv, D, tiles):
    """Within bf16 rounding of the fp32 result on the same bf16 inputs, for whole prompts and later chunks (the
    queries are the last T of S positions), GQA groups of 1 to 16, odd row counts and partial key blocks."""
    q, k, v = _qkv(S, Hq, Hkv, D, seed=T + S + D)
    q = q[S - T:]
    ref = prompt_attention(q.float(), k.float(), v.float(), D ** -0.5)
    out = torch.ops.kvharness_cpu.prompt_attention(q, k, v, D ** -0.5, tiles)
    assert out.dtype == torch.bfloat16 and out.shape == (T, Hq, D)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tiles", KERNELS)
def test_chunks_and_threads_give_identical_bits(tiles):
    """A row's numbers depend only on its query and the keys up to it: prefilling whole, in uneven chunks, or on
    one thread gives the same bits."""
    q, k, v = _qkv(300, 9, 3, 64, seed=1)
    op = torch.ops.kvharness_cpu.prompt_attention
    whole = op(q, k, v, 0.125, tiles)
    parts = torch.cat([op(q[a:b], k[:b], v[:b], 0.125, tiles) for a, b in [(0, 77), (77, 200), (200, 201), (201, 300)]])
    assert torch.equal(whole, parts)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(q, k, v, 0.125, tiles), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not _builds_tile_kernel(), reason="no AMX tiles")
def test_tiles_and_vectors_agree_within_rounding():
    """The two kernels sum in other orders and round the probabilities alike (bf16), so they differ only in bits."""
    q, k, v = _qkv(500, 9, 3, 64, seed=3)
    q = q[200:]
    tiles = torch.ops.kvharness_cpu.prompt_attention(q, k, v, 0.125, True)
    torch.testing.assert_close(tiles.float(), torch.ops.kvharness_cpu.prompt_attention(q, k, v, 0.125, False).float(),
                               rtol=2e-2, atol=2e-2)


def test_cpu_op_set_routes_bf16_prompts_to_the_kernel():
    """The engine's CPU op set calls the kernel for bf16 (on tiles where the CPU has them) and the reference for
    fp32."""
    ops = load_ops("cpu")
    q, k, v = _qkv(50, 9, 3, 64, seed=2)
    out = ops.prompt_attention(q, k, v, 0.125)
    assert torch.equal(out, torch.ops.kvharness_cpu.prompt_attention(q, k, v, 0.125))
    assert torch.equal(ops.prompt_attention(q.float(), k.float(), v.float(), 0.125),
                       prompt_attention(q.float(), k.float(), v.float(), 0.125))
