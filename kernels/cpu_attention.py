"""The CPU attention kernels (``cpu_decode.c``: decode and prefill), built with the system C compiler
on first use.

PyTorch cannot attend over a paged cache without first gathering every sequence's blocks into a
padded copy; at a few hundred running requests that copy, not the matrix multiplies, bounds a CPU
decode step. The C kernel reads each cached key and value once, in place. Its prefill replaces the
reference's loop of ``scaled_dot_product_attention`` calls, one a sequence over K/V repeated for each
query head of a group, with one call for the step that loads each key and value row once for many
query rows (every query head of a group, several tokens). It is compiled once per
source, compiler and CPU into the folder its caller names (the worker passes
``$BERTH_CACHE_DIR/kernels``, by default ``~/.cache/berth/kernels``) and shares PyTorch's OpenMP
runtime. ``load(folder)`` gives None where no compiler works; the engine then keeps the PyTorch path.

The build targets the CPU it runs on (``-march=native``), which picks the vector path: AVX-512 where
the CPU has it, else AVX2 + FMA (AMD Zen 2/3, older Xeons), else plain C. ``load(folder, isa="avx2")``
builds the AVX2 path on an AVX-512 CPU too, so that path is tested and measured on either kind.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import kv_quant, reference
from kernels.c_build import build, isa_flags
from kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_decode.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# uint8: int8 rows with their scales (kernels/kv_quant.py); fp8 rows are left to the reference
_KV_DTYPES = {**_DTYPES, kv_quant.FORMATS["int8"].storage_dtype: 2}


@dataclass(frozen=True)
class DecodeKernel:
    """The built kernel: ``paged_decode_attention`` and ``paged_prefill_attention`` have
    ``kernels.reference``'s contracts."""

    lib: ctypes.CDLL
    isa: str  # the vector path built for head_dim 64: "avx512", "avx2" or "none"
    max_group: int
    max_dim: int
    max_block: int

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        if (q.device.type != "cpu" or q.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype
                or not (k_cache.dtype == q.dtype or k_cache.dtype == kv_quant.FORMATS["int8"].storage_dtype)
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return False
        return (q.shape[1] // k_cache.shape[2] <= self.max_group and q.shape[2] <= self.max_dim
                and k_cache.shape[1] <= self.max_block)

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               window: int | None = None) -> torch.Tensor:
        """Same contract as ``kernels.reference.paged_decode_attention``: with a ``window``, each
        sequence's loop starts at its window's first position."""
        if not self.supports(q, k_cache, v_cache):
            return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window)
        q = q.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, head_dim = q.shape
        self.lib.berth_paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], tables.shape[1], scale,
            _DTYPES[q.dtype], _KV_DTYPES[k_cache.dtype], window or 0, torch.get_num_threads())
        return out

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, window: int | None = None,
                                key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``kernels.reference.paged_prefill_attention``. The kernel reads every key and
        value from the cache, which holds the chunks' own rows (written before attention runs), so it
        ignores ``key`` and ``value``; the reference, where the kernel cannot run (another dtype or head
        size, no vector path built), reads them."""
        if self.supports(q, k_cache, v_cache):
            qc = q.contiguous()
            tables = block_tables.to(torch.int32).contiguous()
            starts = query_start_loc.to(torch.int32).contiguous()
            lens = context_lens.to(torch.int32).contiguous()
            out = torch.empty_like(qc)
            _, num_heads, head_dim = qc.shape
            if self.lib.berth_paged_prefill(
                    qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(),
                    lens.data_ptr(), out.data_ptr(), lens.shape[0], num_heads, k_cache.shape[2], head_dim,
                    k_cache.shape[1], tables.shape[1], scale, _DTYPES[q.dtype], _KV_DTYPES[k_cache.dtype],
                    window or 0, torch.get_num_threads()) == 0:
                return out
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                                 scale, window, key, value)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """``kernels.reference.write_kv``: into an int8 cache, quantized in C (the same bytes as
        ``kv_quant.quantize``); any other cache by the reference."""
        if not self._writes_int8(key, value, k_cache, v_cache):
            return reference.write_kv(key, value, k_cache, v_cache, slot_mapping)
        slots = slot_mapping.to(torch.int64).contiguous()
        tokens, kv_heads, head_dim = key.shape
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if self.lib.berth_write_kv_int8(
                key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), k_cache.data_ptr(),
                v_cache.data_ptr(), slots.data_ptr(), tokens, kv_heads, head_dim, num_slots, _DTYPES[key.dtype],
                torch.get_num_threads()) != 0:
            raise IndexError(f"a slot of slot_mapping lies outside the cache's {num_slots} slots")

    def _writes_int8(self, key, value, k_cache, v_cache) -> bool:
        int8 = kv_quant.FORMATS["int8"].storage_dtype
        rows_ok = all(x.device.type == "cpu" and x.dtype in _DTYPES and x.dtype == key.dtype and x.dim() == 3
                      and x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (key, value))
        return (rows_ok and k_cache.dtype == int8 and v_cache.dtype == int8 and k_cache.is_contiguous()
                and v_cache.is_contiguous() and key.shape[2] <= self.max_dim
                and tuple(k_cache.shape[2:]) == (key.shape[1], kv_quant.row_bytes(key.shape[2]))
                and key.shape == value.shape and k_cache.shape == v_cache.shape)


@functools.cache
def load(folder: Path, isa: str | None = None) -> DecodeKernel | None:
    """The kernel, built into ``folder`` on first use (once per source, compiler, CPU and ``isa``),
    or None where it cannot be built (logged). ``isa`` None builds for what the CPU has; "avx2"
    builds the AVX2 + FMA path even where the CPU has AVX-512 (None if it has not AVX2 and FMA)."""
    flags = isa_flags(isa)
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        log.warning("this CPU has no AVX2 + FMA: the AVX2 decode-attention path cannot run here")
        return None
    lib = build(SOURCE, folder, flags, "CPU decode attention uses the PyTorch path")
    if lib is None:
        return None
    lib.berth_paged_decode.restype = None
    lib.berth_paged_decode.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [
        ctypes.c_int] * 4
    lib.berth_paged_prefill.restype = ctypes.c_int
    lib.berth_paged_prefill.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float] + [
        ctypes.c_int] * 4
    lib.berth_write_kv_int8.restype = ctypes.c_int
    lib.berth_write_kv_int8.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [
        ctypes.c_int] * 3 + [ctypes.c_int64] + [ctypes.c_int] * 2
    lib.berth_isa.restype = ctypes.c_char_p
    built_isa = lib.berth_isa().decode()
    limits = [ctypes.c_int() for _ in range(3)]
    lib.berth_limits(*[ctypes.byref(x) for x in limits])
    log.info("CPU decode attention: the C kernel with the %s path for head_dim 64", built_isa)
    return DecodeKernel(lib, built_isa, *(x.value for x in limits))
