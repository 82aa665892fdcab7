"""The engine's knobs, typed, with their defaults in one place (the harness's config schema reuses this class)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

# Rows per matrix-multiply call in batch-invariant mode. Every call has exactly this many rows (the last one is
# padded), so a row's result never depends on how many other rows share the forward: the GEMM library picks its
# kernel and reduction order from the shape, and the shape is now fixed. Prefill uses wide tiles (close to the
# untiled speed on long prompts); decode batches are small, so their tile is small too.
PREFILL_TILE = 256
DECODE_TILE = 16


@dataclass
class EngineConfig:
    """Knobs of the paged engine (systems/engine). The vllm backend takes device_memory_gb (its KV cache),
    max_num_seqs and max_num_batched_tokens from here too, so a comparison gives both the same capacity; hf ignores
    them."""

    page_size: int = 16                  # tokens per KV page (one block = one page of one layer and KV head)
    device_memory_gb: float = 2.0        # device-tier KV pool capacity
    host_memory_gb: float = 8.0          # host-tier KV pool capacity
    max_num_seqs: int = 16               # sequences decoded together
    max_num_batched_tokens: int = 8192   # prompt tokens packed into one prefill step
    threads: Optional[int] = None        # torch CPU threads; null = torch's setting (one per core by default)
    batch_invariant: bool = False        # fixed-shape matmuls: greedy tokens independent of batch and threads
    chunked_prefill: bool = True         # decodes share each step with prompt chunks (off in batch-invariant mode)
    fused_decode: bool = True            # CPU decode (and mixed) steps as fused C++ layers (false: op by op)
    max_kept_prefixes: Optional[int] = None   # shared contexts / kept prefills parked at once; null = max_num_seqs

    @classmethod
    def coerce(cls, cfg: Any) -> EngineConfig:
        """An EngineConfig from a dataclass, an OmegaConf node, a dict or a namespace; missing keys take the
        defaults, unknown ones fail. Then `validate`."""
        if isinstance(cfg, cls):
            out = dataclasses.replace(cfg)
        else:
            if cfg is None:
                items: dict = {}
            elif isinstance(cfg, dict):
                items = dict(cfg)
            elif hasattr(cfg, "items") and callable(cfg.items):      # OmegaConf DictConfig
                items = dict(cfg.items())
            else:
                items = dict(vars(cfg))
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(items) - names)
            if unknown:
                raise ValueError(f"engine config: unknown key(s) {unknown}; valid: {sorted(names)}")
            out = cls(**items)
        out.validate()
        return out

    def validate(self) -> None:
        """One-line errors naming the key to fix (run before any tensor is allocated)."""
        for key in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"system.engine.{key} must be a positive integer, got {value!r}")
        for key in ("device_memory_gb", "host_memory_gb"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"system.engine.{key} must be a positive number of GB, got {value!r}")
        if self.chunked_prefill and self.max_num_batched_tokens <= self.max_num_seqs:
            raise ValueError(f"system.engine.max_num_batched_tokens={self.max_num_batched_tokens} leaves no room for "
                             f"prompt chunks beside {self.max_num_seqs} decodes; raise it above max_num_seqs")
        for key in ("batch_invariant", "chunked_prefill", "fused_decode"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"system.engine.{key} must be true or false, got {getattr(self, key)!r}")
        if self.max_kept_prefixes is not None and (not isinstance(self.max_kept_prefixes, int)
                                                   or isinstance(self.max_kept_prefixes, bool)
                                                   or self.max_kept_prefixes < 0):
            raise ValueError(f"system.engine.max_kept_prefixes must be an integer >= 0 or null, got "
                             f"{self.max_kept_prefixes!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"system.engine.threads must be a positive integer or null, got {self.threads!r}")
