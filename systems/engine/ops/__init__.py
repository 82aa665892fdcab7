"""Engine ops: torch reference implementations (CPU path) and Triton kernels (GPU path) with identical signatures."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from systems.engine.ops import torch_attention, torch_kv, torch_scoring

_FUNCTIONS = {
    "kv": ("store_kv", "update_minmax", "page_minmax"),
    "attention": ("paged_decode_attention", "sparse_decode_attention", "gather_selected",
                  "prefix_paged_decode_attention"),
    "scoring": ("page_scores",),
}


def load_ops(device: torch.device | str) -> SimpleNamespace:
    """The op set for a device: Triton kernels on CUDA where a triton_<group> module provides them, torch otherwise."""
    torch_modules = {"kv": torch_kv, "attention": torch_attention, "scoring": torch_scoring}
    chosen = {}
    for group, names in _FUNCTIONS.items():
        triton_module = None
        if torch.device(device).type == "cuda":
            try:
                triton_module = importlib.import_module(f"systems.engine.ops.triton_{group}")
            except ImportError:
                triton_module = None
        for name in names:
            chosen[name] = getattr(triton_module, name, None) or getattr(torch_modules[group], name)
    return SimpleNamespace(**chosen)
