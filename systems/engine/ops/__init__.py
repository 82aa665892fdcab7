"""Engine ops: torch references, the fused CPU decode kernel (CPU path) and Triton kernels (GPU path), one signature."""
from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

import torch

from systems.engine.ops import torch_attention, torch_kv, torch_scoring

_FUNCTIONS = {
    "kv": ("store_kv", "update_minmax", "page_minmax", "store_prompt", "append_decode"),
    "attention": ("prompt_attention", "paged_decode_attention", "sparse_decode_attention", "gather_selected",
                  "token_probs", "pooled_victims", "layer_decode_attention"),
    "scoring": ("page_scores", "top_pages", "ranked_pages", "resident_pages"),
}


def load_ops(device: torch.device | str) -> SimpleNamespace:
    """The op set for a device: Triton kernels on CUDA where a triton_<group> module provides them, the fused C++
    kernels on CPU where cpu_kernels has one (they fall back to torch when they cannot be built), torch otherwise."""
    torch_modules = {"kv": torch_kv, "attention": torch_attention, "scoring": torch_scoring}
    kind = torch.device(device).type
    chosen = {}
    for group, names in _FUNCTIONS.items():
        fast_module = None
        if kind == "cuda":
            try:
                fast_module = importlib.import_module(f"systems.engine.ops.triton_{group}")
            except ImportError:
                fast_module = None
        elif kind == "cpu":
            fast_module = importlib.import_module("systems.engine.ops.cpu_kernels")
            fast_module.available()     # build (or fall back) now: a server's first request must not wait for it
        for name in names:
            chosen[name] = getattr(fast_module, name, None) or getattr(torch_modules[group], name)
    if chosen["top_pages"] is torch_scoring.top_pages:             # the reference top-K over the device's scorer
        chosen["top_pages"] = functools.partial(torch_scoring.top_pages, scorer=chosen["page_scores"])
    if chosen["ranked_pages"] is torch_scoring.ranked_pages:
        chosen["ranked_pages"] = functools.partial(torch_scoring.ranked_pages, scorer=chosen["page_scores"])
    return SimpleNamespace(**chosen)
