"""The CPU path's fused paged decode attention (cpu_attention.cpp), built once per machine on first use."""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from systems.engine.ops import torch_attention

_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}
HEAD_DIMS = (16, 32, 64, 96, 128, 256)          # compiled instantiations (cpu_attention.cpp)


def _build() -> bool:
    """Compile and register torch.ops.kvharness_cpu (cached under TORCH_EXTENSIONS_DIR, ~20 s the first time)."""
    from torch.utils.cpp_extension import load

    # -march=native is safe: the build cache lives on the machine that runs it, keyed by source and flags
    load(name="kvharness_cpu_attention", sources=[str(_SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    return hasattr(torch.ops.kvharness_cpu, "paged_decode_attention")


def available() -> bool:
    """Whether the kernel is built (building it if needed); KVHARNESS_CPU_KERNEL=0 forces the torch path."""
    if os.environ.get("KVHARNESS_CPU_KERNEL", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            try:
                _state["ok"] = _build()
            except Exception as exc:  # no compiler or headers: the torch path is correct, only slower
                warnings.warn(f"CPU decode kernel not built ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                              "using the torch path. Install gcc/g++ to get the fused kernel.")
                _state["ok"] = False
        return bool(_state["ok"])


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           num_tokens: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as torch_attention.paged_decode_attention; reads the listed pages in place."""
    B, Hq, D = q.shape
    supported = (k_pool.dtype in (torch.bfloat16, torch.float32) and D in HEAD_DIMS and k_pool.shape[1] <= 256
                 and Hq // block_table.shape[1] <= 16)
    if not supported or not available():
        return torch_attention.paged_decode_attention(q, k_pool, v_pool, block_table, num_tokens, scale)
    return torch.ops.kvharness_cpu.paged_decode_attention(q, k_pool, v_pool, block_table.to(torch.int32),
                                                          num_tokens.to(torch.int32), float(scale))


def sparse_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                            num_tokens: torch.Tensor, selected_pages: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention over only the selected pages, through the fused kernel."""
    table, counts = torch_attention.gather_selected(block_table, num_tokens, selected_pages, k_pool.shape[1])
    return paged_decode_attention(q, k_pool, v_pool, table, counts, scale)
