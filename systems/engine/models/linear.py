"""The decoder's weight matrices as callables: fixed-shape tiles on request, oneDNN-prepacked bf16 weights on CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prepacked(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`weight` re-laid out once in oneDNN's blocked format, where that computes exactly what F.linear computes.

    F.linear on a bf16 CPU weight hands oneDNN the plain matrix, which re-lays it out on every call: for the few
    rows of a decode step that costs as much as the multiply itself (the 49k-row LM head took 2.5x longer). The
    packed weight runs the same kernel, so the numbers are unchanged; a probe checks that, bit for bit, and
    anything else (fp32, CUDA, a torch without oneDNN) keeps F.linear.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError):
        return None
    return packed if torch.equal(got, F.linear(probe, weight, bias)) else None


class Linear:
    """y = x W^T (+ b)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True):
        """`prepack=False` keeps F.linear, which has gradients."""
        self.bias = bias
        self.packed = prepacked(weight, bias) if prepack else None
        self.weight = weight if self.packed is None else None      # the packed copy replaces the plain one

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor, tile: int | None = None) -> torch.Tensor:
        """With `tile`, every GEMM call gets exactly `tile` rows (the last chunk zero-padded), so each row's result
        depends only on that row, not on how many rows the batch has (GEMM libraries choose kernels, and with them
        the reduction order, by shape)."""
        if tile is None:
            return self._mm(x)
        n = x.shape[0]
        pad = -n % tile
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        if x.shape[0] == tile:
            return self._mm(x)[:n]
        return torch.cat([self._mm(chunk) for chunk in x.split(tile)])[:n]
