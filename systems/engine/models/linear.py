"""The decoder's weight matrices as callables: fixed-shape tiles on request, oneDNN-prepacked bf16 weights on CPU,
bf16 GEMMs computed as fp32 GEMMs of the same values on CPUs whose oneDNN has no bf16 kernels, and the skinny
row-by-row product (ops/cpu_gemm.cpp) for decode rows."""
from __future__ import annotations

import functools

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


# rows from which a widened fp32 GEMM beats torch's fallback bf16 GEMM (AVX2 EPYC, SmolLM2 shapes: 4x at 16 rows on
# the MLP, 1.3x on the 49k-row LM head); below it the bf16 weight's half-size memory traffic wins (the LM head at one
# row: 4.9 vs 16 ms). Batch-invariant mode pads every call to a fixed tile (prefill 256 rows, decode 16), so all of
# its GEMMs take the widened path and a row's arithmetic still never depends on the batch.
WIDEN_MIN_ROWS = 16


def widens(rows: int) -> bool:
    """Whether a product of `rows` rows takes the widened fp32 GEMM where a Linear has one."""
    return rows >= WIDEN_MIN_ROWS


def emulates_bf16(weight: torch.Tensor) -> bool:
    """True for a bf16 CPU weight where oneDNN has no bf16 kernels (AVX2-only CPUs): torch's fallback GEMM is then
    4-6x slower than fp32 on prompt-sized inputs (a 1k-token SmolLM2 prefill: 14 s vs 2.4 s). bf16 products are
    exact in fp32, so an fp32 GEMM of the same values, rounded to bf16, is a bf16 GEMM with fp32 accumulation, as
    bf16 hardware computes it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and not torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def one_thread_tiles() -> bool:
    """Whether tile_linear can run: a property of the process (its kernels), asked once, since tiled calls are on the
    prompt's hot path."""
    from systems.engine.ops import cpu_kernels

    return cpu_kernels.available() and hasattr(torch.ops.kvharness_cpu, "tile_linear")


class Linear:
    """y = x W^T (+ b)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True):
        """`prepack=False` keeps F.linear, which has gradients."""
        self.bias = bias
        self.packed = prepacked(weight, bias) if prepack else None
        self.weight = weight
        # an fp32 copy beside the bf16 weight (3x the memory) where bf16 is emulated, for prompt-sized inputs
        self.wide = (weight.float(), None if bias is None else bias.float()) if prepack and emulates_bf16(weight) \
            else None

    @property
    def skinny_weight(self) -> torch.Tensor | None:
        """The weight packed for the skinny CPU product (ops/cpu_gemm.cpp), made on first use; None where that
        product cannot run (not CPU, not bf16/fp32, kernels not built)."""
        if not hasattr(self, "_skinny_weight"):
            self._skinny_weight = None
            if self.weight.device.type == "cpu" and self.weight.dtype in (torch.bfloat16, torch.float32):
                from systems.engine.ops import cpu_kernels

                if cpu_kernels.has_fused_decode():
                    self._skinny_weight = torch.ops.kvharness_cpu.skinny_pack(self.weight)
        return self._skinny_weight

    def rows(self, x: torch.Tensor, tile: int | None = None) -> torch.Tensor:
        """Decode rows: the skinny product, where every output is one fused multiply-add chain over its row and its
        weights (batch-invariant by construction, weights streamed once), the same arithmetic as the fused decode
        step; where it cannot run, the GEMM library with `tile`."""
        packed = self.skinny_weight
        if packed is not None:
            return torch.ops.kvharness_cpu.skinny_linear(x, packed, self.bias, self.weight.shape[0])
        return self(x, tile)

    def gemm_operands(self, rows: int) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """How `rows` rows are multiplied, as data (the fused mixed step makes the same call from C++): 0 with the
        prepacked weight (oneDNN), 1 with the fp32 copy (the widened GEMM), or 2 with the weight as stored
        (F.linear); each with the bias that call takes."""
        if self.packed is not None:
            return 0, self.packed, self.bias
        if self.wide is not None and widens(rows):
            return 1, *self.wide
        return 2, self.weight, self.bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        kind, weight, bias = self.gemm_operands(x.shape[0])
        if kind == 0:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        if kind == 1:
            return F.linear(x.float(), weight, bias).to(x.dtype)
        return F.linear(x, weight, bias)

    def __call__(self, x: torch.Tensor, tile: int | None = None) -> torch.Tensor:
        """With `tile`, every GEMM call gets exactly `tile` rows (the last chunk zero-padded), so each row's result
        depends only on that row, not on how many rows the batch has (GEMM libraries choose kernels, and with them
        the reduction order, by shape); oneDNN's prepacked calls also run one tile per thread, as its split among
        threads would otherwise depend on their count."""
        if tile is None:
            return self._mm(x)
        n = x.shape[0]
        pad = -n % tile
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        if self.packed is not None and one_thread_tiles():
            # oneDNN splits a product among threads by their count (on AMX, even the sum over K): one thread per
            # tile keeps a row's bits independent of the thread count too (ops/cpu_gemm.cpp, tile_linear)
            return torch.ops.kvharness_cpu.tile_linear(x, self.packed, self.bias, self.weight.shape[0], tile)[:n]
        if x.shape[0] == tile:
            return self._mm(x)[:n]
        return torch.cat([self._mm(chunk) for chunk in x.split(tile)])[:n]
