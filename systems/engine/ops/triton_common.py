"""What every Triton op module shares: the availability test, tile-size rounding and the GPU's program budget."""
from __future__ import annotations

import functools
import os

import torch
import triton  # noqa: F401  (an ImportError here is how a machine without triton falls back to the torch ops)


def available() -> bool:
    """True when the Triton kernels run compiled on a GPU: triton imported (above), a CUDA device is visible and
    TRITON_INTERPRET is off (interpreted kernels are for tests, far too slow to serve)."""
    return torch.cuda.is_available() and not interpreting()


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors through numpy (the tests' mode)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int, at_least: int = 1) -> int:
    """Smallest power of two >= max(n, at_least): Triton block shapes must be powers of two."""
    return max(at_least, 1 << max(0, int(n) - 1).bit_length())


@functools.cache
def num_programs_target(device_index: int) -> int:
    """Programs one launch should offer to keep every SM busy (two per SM); a small fixed number off-GPU."""
    if device_index < 0:
        return 4
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int:
    """The CUDA device index of t, -1 off-GPU (the key of num_programs_target)."""
    return t.device.index if t.device.type == "cuda" else -1
