"""The bf16 prompt-attention kernel (ops/cpu_prefill.cpp) against the fp32 reference, and its chunk invariance."""
from __future__ import annotations

import subprocess

import pytest
import torch

from systems.engine.ops import cpu_kernels, load_ops
from systems.engine.ops.torch_attention import prompt_attention
from systems.hardware import cpu_flags


def _builds_prompt_kernel() -> bool:
    """Whether the kernel gets compiled here: the CPU has AVX512-BF16 and the compiler targets it (-march=native)."""
    if not cpu_kernels.toolchain() or "avx512_bf16" not in cpu_flags():
        return False
    try:
        macros = subprocess.run([str(cpu_kernels.compiler()), "-march=native", "-dM", "-E", "-x", "c++", "-"],
                                input="", capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "__AVX512BF16__" in macros and "__AVX512F__" in macros


pytestmark = pytest.mark.skipif(not _builds_prompt_kernel(),
                                reason="the prompt kernel is built only for CPUs (and compilers) with AVX512-BF16")


def test_prompt_kernel_is_built():
    assert cpu_kernels.available() and hasattr(torch.ops.kvharness_cpu, "prompt_attention")


def _qkv(S, Hq, Hkv, D, seed):
    """q, k, v as strided views of one packed projection, as the model hands them over."""
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(S, Hq + 2 * Hkv, D, generator=g)).to(torch.bfloat16)
    return qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]


@pytest.mark.parametrize("T,S,Hq,Hkv,D", [(37, 37, 9, 3, 64), (100, 250, 9, 3, 64), (1, 65, 4, 1, 128),
                                          (130, 130, 8, 2, 128), (64, 64, 3, 3, 64), (17, 1000, 9, 3, 64)])
def test_matches_fp32_reference(T, S, Hq, Hkv, D):
    """Within bf16 rounding of the fp32 result on the same bf16 inputs, for whole prompts and later chunks (the
    queries are the last T of S positions), GQA groups of 1 to 4, odd row counts and partial key blocks."""
    q, k, v = _qkv(S, Hq, Hkv, D, seed=T + S + D)
    q = q[S - T:]
    ref = prompt_attention(q.float(), k.float(), v.float(), D ** -0.5)
    out = torch.ops.kvharness_cpu.prompt_attention(q, k, v, D ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (T, Hq, D)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_chunks_and_threads_give_identical_bits():
    """A row's numbers depend only on its query and the keys up to it: prefilling whole, in uneven chunks, or on
    one thread gives the same bits."""
    q, k, v = _qkv(300, 9, 3, 64, seed=1)
    whole = torch.ops.kvharness_cpu.prompt_attention(q, k, v, 0.125)
    parts = torch.cat([torch.ops.kvharness_cpu.prompt_attention(q[a:b], k[:b], v[:b], 0.125)
                       for a, b in [(0, 77), (77, 200), (200, 201), (201, 300)]])
    assert torch.equal(whole, parts)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.kvharness_cpu.prompt_attention(q, k, v, 0.125), whole)
    finally:
        torch.set_num_threads(threads)


def test_cpu_op_set_routes_bf16_prompts_to_the_kernel():
    """The engine's CPU op set calls the kernel for bf16 (unless the CPU has AMX tiles, where torch's flash
    attention multiplies on them) and the reference for fp32."""
    ops = load_ops("cpu")
    q, k, v = _qkv(50, 9, 3, 64, seed=2)
    out = ops.prompt_attention(q, k, v, 0.125)
    if cpu_kernels.bf16_prompt_kernel():
        assert torch.equal(out, torch.ops.kvharness_cpu.prompt_attention(q, k, v, 0.125))
    assert torch.equal(ops.prompt_attention(q.float(), k.float(), v.float(), 0.125),
                       prompt_attention(q.float(), k.float(), v.float(), 0.125))
