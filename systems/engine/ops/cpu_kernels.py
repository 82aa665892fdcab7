"""The CPU path's fused kernels (cpu_attention.cpp, cpu_prefill.cpp, cpu_scoring.cpp, cpu_model.cpp, cpu_gemm.cpp,
cpu_decoder.cpp, cpu_mixed.cpp and the rest of _SOURCES), built once per checkout on first use."""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import threading
import warnings
from pathlib import Path

import torch

from systems.engine.ops import torch_attention, torch_kv, torch_scoring

_SOURCES = [Path(__file__).with_name(name) for name in (
    "cpu_attention.cpp", "cpu_prefill.cpp", "cpu_scoring.cpp", "cpu_model.cpp", "cpu_gemm.cpp", "cpu_gemm_pairs.cpp",
    "cpu_decoder.cpp", "cpu_token_probs.cpp", "cpu_kv.cpp", "cpu_mixed.cpp", "cpu_prefill_tiles.cpp")]
_lock = threading.Lock()
_state: dict[str, object] = {}
HEAD_DIMS = (16, 32, 64, 96, 128, 256)          # compiled instantiations (cpu_attention.cpp)
MAX_PAGE, MAX_GROUP = 256, 16
_POOLINGS = {"none": 0, "avgpool": 1, "maxpool": 2}      # pooled_victims' pooling codes


BUILD_WAIT_S = float(os.environ.get("KVHARNESS_BUILD_WAIT_S", "600"))


def build_dir() -> Path:
    """One build folder per checkout, torch version and CPU (another clone's build never blocks or replaces this one's,
    and a home folder shared by machines of different CPU types never loads a -march=native build made elsewhere):
    $KVHARNESS_CACHE/torch_extensions/<hash of this source folder, torch's version and the CPU's flags>."""
    from systems.hardware import cpu_flags

    cache = Path(os.environ.get("KVHARNESS_CACHE", Path.home() / ".cache" / "kvharness"))
    cpu = " ".join(sorted(cpu_flags()))
    key = hashlib.sha1(f"{Path(__file__).resolve().parent}|{torch.__version__}|{cpu}".encode()).hexdigest()[:12]
    return cache / "torch_extensions" / key


def _build() -> bool:
    """Compile and register torch.ops.kvharness_cpu under build_dir() (~20 s the first time).

    torch's own build lock is a plain file: a process killed while holding it (even when the .so is built, Ctrl-C
    at start-up is enough) leaves it behind and every later build waits forever. So builds are serialized by an
    flock on our own lock file, which the kernel releases when its holder dies; whoever holds it removes torch's
    leftover lock, which then can only be stale. A waiter says why it waits, and gives up after BUILD_WAIT_S with
    the torch path."""
    import fcntl
    import time

    from torch.utils.cpp_extension import load

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "kvharness.lock", "a+") as handle:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                handle.seek(0)
                owner = handle.read().strip() or "unknown"
                if waited > BUILD_WAIT_S:
                    # the flock is the kernel's: its holder is alive (a dead one releases it), so say who it is
                    raise BuildLockHeld(f"process {owner} still holds {folder / 'kvharness.lock'} after {waited:.0f} "
                                        f"s of waiting, building the kernels; let it finish, stop it if it hangs "
                                        f"(kill {owner}), or raise KVHARNESS_BUILD_WAIT_S") from None
                if not told and waited > 2:
                    print(f"[kernels] waiting for process {owner} to finish building the CPU kernels in {folder}",
                          flush=True)
                    told = True
                time.sleep(0.5)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        (folder / "lock").unlink(missing_ok=True)       # torch's baton: stale, since we hold the flock
        # -march=native is safe: the build folder lives on the machine that runs it.
        # -fopenmp makes at::parallel_for use torch's own OpenMP pool (the same libgomp.so.1 is already loaded).
        # torch keys its build cache on the sources and flags only, so the shared headers' hash goes into the flags
        headers = sorted(_SOURCES[0].parent.glob("cpu_*.h"))
        header = hashlib.sha1(b"".join(h.read_bytes() for h in headers)).hexdigest()[:12]
        load(name="kvharness_cpu_kernels", sources=[str(p) for p in _SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DKVH_COMMON_H={header}"],
             extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    return hasattr(torch.ops.kvharness_cpu, "decode_attention") and hasattr(torch.ops.kvharness_cpu, "resident_pages")


class BuildLockHeld(TimeoutError):
    """Another live process has held the build lock longer than BUILD_WAIT_S; the message names it."""


def build_fix(exc: Exception) -> str:
    """What gets the fused kernels back after a failed build, by what failed (a compiler only when one is missing)."""
    if isinstance(exc, BuildLockHeld):
        return "The next run builds or loads them once that process is done."
    if isinstance(exc, OSError):
        return "Set KVHARNESS_CACHE to a folder you can write (the kernels are built under it)."
    if not toolchain():
        return "Install gcc/g++ and ninja to get the fused kernels."
    return "The compiler failed: run `python -c \"import systems.engine.ops.cpu_kernels as k; k._build()\"` to see why."


def toolchain() -> bool:
    """Whether this machine can build the kernels (a C++ compiler and ninja, and KVHARNESS_CPU_KERNELS not 0):
    where it can, a failed build is a bug, not a reason to fall back quietly."""
    from torch.utils.cpp_extension import is_ninja_available

    return os.environ.get("KVHARNESS_CPU_KERNELS", "1") != "0" and compiler() is not None and is_ninja_available()


def compiler() -> str | None:
    """The C++ compiler torch's extension builder runs ($CXX, else c++), or None where there is none."""
    words = shlex.split(os.environ.get("CXX", "c++"))       # "ccache g++" names its compiler second
    return next((found for w in words if Path(w).name != "ccache" and (found := shutil.which(w))), None)


def available() -> bool:
    """Whether the kernels are built (building them if needed); KVHARNESS_CPU_KERNELS=0 forces the torch path."""
    if os.environ.get("KVHARNESS_CPU_KERNELS", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            try:
                _state["ok"] = _build()
            except Exception as exc:  # no compiler or headers: the torch path is correct, only slower
                warnings.warn(f"CPU kernels not built ({type(exc).__name__}: {str(exc).splitlines()[0]}); using "
                              f"the torch path. {build_fix(exc)}", stacklevel=2)
                _state["ok"] = False
        return bool(_state["ok"])


def _fits(q: torch.Tensor, pool: torch.Tensor, num_kv_heads: int) -> bool:
    return (pool.dtype in (torch.bfloat16, torch.float32) and q.shape[-1] in HEAD_DIMS and pool.shape[1] <= MAX_PAGE
            and q.shape[1] // num_kv_heads <= MAX_GROUP and pool.is_contiguous() and available())


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Same contract as torch_attention.prompt_attention. bf16 with 64- or 128-dim heads takes this project's kernel
    (cpu_prefill.cpp: on AMX tiles where the CPU has them, else bf16 dot products on AVX512-BF16), which beats torch's
    flash attention on both; other shapes and dtypes, and windowed layers, take the torch path."""
    if (window is None and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and q.shape[-1] in (64, 128)
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and bf16_prompt_kernel()):
        return torch.ops.kvharness_cpu.prompt_attention(q, k, v, float(scale))
    return torch_attention.prompt_attention(q, k, v, scale, window)


def has_model_steps() -> bool:
    """Whether the build registered the fused decoder steps (add_rms_norm, rope_, silu_mul)."""
    return available() and hasattr(torch.ops.kvharness_cpu, "silu_mul")


def has_fused_decode() -> bool:
    """Whether the build registered the fused decode step (cpu_decoder.cpp, cpu_gemm.cpp)."""
    return available() and hasattr(torch.ops.kvharness_cpu, "decode_layers")



def bf16_prompt_kernel() -> bool:
    """Whether bf16 prompt attention takes this project's kernel: built (CPUs with AVX512-BF16), and on a CPU with AMX
    the tile kernel runs (else torch's flash attention, which multiplies on the tiles itself, is the faster one)."""
    if "prompt" not in _state:
        from systems.hardware import cpu_flags

        _state["prompt"] = (available() and hasattr(torch.ops.kvharness_cpu, "prompt_attention")
                            and ("amx_bf16" not in cpu_flags() or bool(torch.ops.kvharness_cpu.prompt_tiles())))
    return bool(_state["prompt"])


def prompt_kernel_name() -> str:
    """Which kernel bf16 prompt attention runs here, in words (for the summaries' execution line)."""
    if not bf16_prompt_kernel():
        return "torch's flash attention"
    return "AMX tile kernel" if torch.ops.kvharness_cpu.prompt_tiles() else "AVX512-BF16 kernel"


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           num_tokens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Same contract as torch_attention.paged_decode_attention; reads the listed pages in place (with a window,
    only the tokens in it)."""
    if not _fits(q, k_pool, block_table.shape[1]):
        return torch_attention.paged_decode_attention(q, k_pool, v_pool, block_table, num_tokens, scale, window)
    return torch.ops.kvharness_cpu.decode_attention(q, k_pool, v_pool, block_table.to(torch.int32),
                                                    num_tokens.to(torch.int32), None, float(scale), window or 0)


def sparse_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                            num_tokens: torch.Tensor, selected_pages: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """Same contract as torch_attention.sparse_decode_attention; the selected pages are read in the order given
    (no gathered table), unselected pages never."""
    if not _fits(q, k_pool, block_table.shape[1]):
        return torch_attention.sparse_decode_attention(q, k_pool, v_pool, block_table, num_tokens, selected_pages,
                                                       scale, window)
    return torch.ops.kvharness_cpu.decode_attention(q, k_pool, v_pool, block_table.to(torch.int32),
                                                    num_tokens.to(torch.int32), selected_pages, float(scale),
                                                    window or 0)


def append_decode(k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor, num_tokens: torch.Tensor,
                  kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor, layer: int, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """Same contract as torch_kv.append_decode; the fused decode step's append (one call, the same values)."""
    if not (_storage_fits(k_pool, block_table, num_tokens, kmin, kmax) and k.dtype == v.dtype == k_pool.dtype):
        return torch_kv.append_decode(k_pool, v_pool, block_table, num_tokens, kmin, kmax, slots, layer, k, v)
    torch.ops.kvharness_cpu.append_decode_kv(k_pool, v_pool, block_table, num_tokens, kmin, kmax,
                                             slots.to(torch.int64).contiguous(), int(layer), k, v)


def layer_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           num_tokens: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor,
                           layer: int, selected: torch.Tensor | None, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """Same contract as torch_attention.layer_decode_attention; the fused decode step's attention, reading the
    engine's tables in place (no per-step table copy)."""
    if not (_storage_fits(k_pool, block_table, num_tokens, kmin, kmax) and q.dtype == k_pool.dtype
            and _fits(q, k_pool, block_table.shape[2])):
        return torch_attention.layer_decode_attention(q, k_pool, v_pool, block_table, num_tokens, kmin, kmax, slots,
                                                      layer, selected, scale, window)
    out = torch.ops.kvharness_cpu.decode_layer_attend(q.contiguous(), selected, k_pool, v_pool, block_table,
                                                      num_tokens, kmin, kmax, slots.to(torch.int64).contiguous(),
                                                      int(layer), float(scale), window or 0)
    return out.view(q.shape)


def _storage_fits(k_pool: torch.Tensor, block_table: torch.Tensor, num_tokens: torch.Tensor, kmin: torch.Tensor,
                  kmax: torch.Tensor) -> bool:
    """Whether the engine's storage is what the fused decode step's ops read (contiguous, int32 tables)."""
    return (k_pool.dtype in (torch.bfloat16, torch.float32) and all(t.is_contiguous() for t in (
        k_pool, block_table, num_tokens, kmin, kmax)) and block_table.dtype == num_tokens.dtype == torch.int32
        and has_fused_decode())


def store_prompt(k_pool: torch.Tensor, v_pool: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 table: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """Same contract as torch_kv.store_prompt; one call, the same values (copies, and exact mins and maxes)."""
    if (k_pool.dtype not in (torch.bfloat16, torch.float32) or k.dtype != k_pool.dtype or v.dtype != k_pool.dtype
            or kmin.dtype != k_pool.dtype or kmin.stride(-1) != 1 or not k_pool.is_contiguous() or not available()
            or not hasattr(torch.ops.kvharness_cpu, "store_prompt")):
        return torch_kv.store_prompt(k_pool, v_pool, kmin, kmax, table, k, v, start)
    torch.ops.kvharness_cpu.store_prompt(k_pool, v_pool, kmin, kmax, table.to(torch.int32), k, v, int(start))


def page_minmax(k_pool: torch.Tensor, block_ids: torch.Tensor, n_tokens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as torch_kv.page_minmax, in one call: the same values for finite keys (exact mins and maxes;
    a NaN or an all-infinite lane may differ, as in store_prompt)."""
    if (k_pool.dtype not in (torch.bfloat16, torch.float32) or not k_pool.is_contiguous() or not available()
            or not hasattr(torch.ops.kvharness_cpu, "page_minmax")):
        return torch_kv.page_minmax(k_pool, block_ids, n_tokens)
    return torch.ops.kvharness_cpu.page_minmax(k_pool, block_ids, n_tokens)


def token_probs(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, scale: float,
                width: int) -> torch.Tensor:
    """Same contract as torch_attention.token_probs; one task per (row, KV head), keys read in place."""
    if (k_pool.dtype not in (torch.bfloat16, torch.float32) or not k_pool.is_contiguous() or not available()
            or not hasattr(torch.ops.kvharness_cpu, "token_probs")):
        return torch_attention.token_probs(q, k_pool, tables, counts, scale, width)
    return torch.ops.kvharness_cpu.token_probs(q, k_pool, tables.to(torch.int32), counts.to(torch.int32),
                                               float(scale), int(width))


def pooled_victims(probs: torch.Tensor, counts: torch.Tensor, key: torch.Tensor, window: int, kernel: int,
                   pooling: str, new_keys: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as torch_attention.pooled_victims; one task per (row, KV head), sorted and pooled in place."""
    # the kernel sums a query group head by head, which is torch's order for a mean over at most 4 heads
    if (probs.dtype != torch.float32 or key.dtype != torch.float32 or probs.shape[1] > 4 * counts.shape[1]
            or not available() or not hasattr(torch.ops.kvharness_cpu, "pooled_victims")):
        return torch_attention.pooled_victims(probs, counts, key, window, kernel, pooling, new_keys)
    index, keys = torch.ops.kvharness_cpu.pooled_victims(probs, counts, key, int(window), int(kernel),
                                                         _POOLINGS[pooling], bool(new_keys))
    return index, keys if new_keys else None


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor,
                rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as torch_scoring.page_scores; reads kmin/kmax in place through rows and heads."""
    if (kmin.dtype not in (torch.bfloat16, torch.float32) or kmin.stride(-1) != 1 or kmin.stride() != kmax.stride()
            or not available()):
        return torch_scoring.page_scores(q, kmin, kmax, num_pages, rows, heads)
    rows = torch.arange(kmin.shape[0]) if rows is None else rows
    heads = torch.arange(kmin.shape[1]) if heads is None else heads
    return torch.ops.kvharness_cpu.page_scores(q, kmin, kmax, num_pages, rows, heads)


def ranked_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor,
                 rows: torch.Tensor | None, heads: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
    """Same contract as torch_scoring.ranked_pages; scores and ranks in one call, no score tensor."""
    if (kmin.dtype not in (torch.bfloat16, torch.float32) or kmin.stride(-1) != 1 or kmin.stride() != kmax.stride()
            or not available() or not hasattr(torch.ops.kvharness_cpu, "ranked_pages")):
        return torch_scoring.ranked_pages(q, kmin, kmax, num_pages, rows, heads, k, scorer=page_scores)
    rows = torch.arange(kmin.shape[0]) if rows is None else rows
    heads = torch.arange(kmin.shape[1]) if heads is None else heads
    return torch.ops.kvharness_cpu.ranked_pages(q, kmin, kmax, num_pages, rows, heads, k)


def top_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_tokens: torch.Tensor, page_size: int,
              k: int, keep_last: bool, rows: torch.Tensor | None = None,
              heads: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as torch_scoring.top_pages (pages ascending here); scores never leave the kernel."""
    if (kmin.dtype not in (torch.bfloat16, torch.float32) or kmin.stride(-1) != 1 or kmin.stride() != kmax.stride()
            or not available()):
        return torch_scoring.top_pages(q, kmin, kmax, num_tokens, page_size, k, keep_last, rows, heads)
    rows = torch.arange(kmin.shape[0]) if rows is None else rows
    heads = torch.arange(kmin.shape[1]) if heads is None else heads
    return torch.ops.kvharness_cpu.top_pages(q, kmin, kmax, num_tokens, int(page_size), int(k), bool(keep_last), rows,
                                             heads)


def resident_pages(table: torch.Tensor, num_pages: torch.Tensor) -> torch.Tensor:
    """Same contract as torch_scoring.resident_pages; one scan of the table rows, no sort or scatter."""
    if table.dtype != torch.int32 or not available():
        return torch_scoring.resident_pages(table, num_pages)
    return torch.ops.kvharness_cpu.resident_pages(table, num_pages)
