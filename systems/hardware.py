"""What the machine computes with: CPU flags, the matrix ISA torch's kernels will use, and the dtype `auto` means.

Results differ across matrix ISAs (AMX tiles, AVX512-BF16, AVX2, CUDA architectures accumulate in different orders),
so the harness records `matrix_isa()` with every result and keys stored cells on it.
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


@functools.lru_cache(maxsize=1)
def allowed_cpus() -> list[int]:
    """The cores this process may run on (its affinity), ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_list_text(cpus: list[int] | set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (the kernel's and VLLM_CPU_OMP_THREADS_BIND's list format)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_matrix_isa(flags: frozenset[str] | set[str] | None = None) -> str:
    """The widest matrix instruction set the CPU offers (what oneDNN dispatches bf16/fp32 GEMMs to)."""
    flags = cpu_flags() if flags is None else flags
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx-bf16"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return platform.machine() or "unknown"


def matrix_isa(device: str | torch.device = "cpu") -> str:
    """`cuda-sm90` style for a CUDA device, else the CPU's matrix ISA."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return cpu_matrix_isa()


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name to torch; 'auto' is bf16 where the hardware multiplies it fast (CUDA, or CPUs with avx512_bf16
    or AMX), else fp32."""
    if dtype in DTYPES:
        return DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}: use one of {list(DTYPE_CHOICES)}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_matrix_isa() in ("amx-bf16", "avx512-bf16") else torch.float32


def dtype_bytes(dtype: str, device: str | torch.device = "cpu") -> int:
    """Bytes per element of the dtype a name resolves to on this machine."""
    return torch.empty((), dtype=resolve_dtype(dtype, device)).element_size()


def dtype_name(dtype: str, device: str | torch.device = "cpu") -> str:
    """The concrete dtype name 'auto' (or an alias) resolves to on this machine, e.g. 'bfloat16'."""
    return str(resolve_dtype(dtype, device)).removeprefix("torch.")
