"""A decoder layer's elementwise steps on the CPU in float32 or bfloat16 (``cpu_elementwise.c``), each one pass.

PyTorch runs the residual add and RMSNorm as seven operations and rotary plus the KV write as a dozen,
each reading and writing a whole activation and making a new tensor. The C file does each group in one
pass per row: ``add_rms_norm`` (the residual added in place, then the norm), ``rotary_kv`` (the
queries rotated into a tensor of their own, the keys rotated and the values copied into their cache
slots, from the fused Q/K/V projection's output). Their references are ``worker.model.decoder``'s
``rms_norm``, ``apply_rotary`` and ``kernels.reference.write_kv``: the same products and sums per
element, each rounded to bfloat16 where PyTorch's operation rounds it, but for the order in which a row's
squares are summed (tests/kernels/test_cpu_elementwise.py). Built
like the decode-attention kernel (``kernels.c_build``); ``load(folder)`` gives None where no compiler
works, and the decoder keeps PyTorch's operations.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.c_build import build, isa_flags

SOURCE = Path(__file__).with_name("cpu_elementwise.c")
FLAGS = ["-ffp-contract=off"]  # no multiply-add fused into one rounding: PyTorch's elementwise ops round each
DTYPES = (torch.float32, torch.bfloat16)  # the kernel's flag: 0, 1


@dataclass(frozen=True)
class ElementwiseKernel:
    lib: ctypes.CDLL

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``h += delta`` in place (unless None), then ``weight * (h * rsqrt(mean(h**2) + eps))`` over each row
        of ``h [rows, dim]`` (contiguous, float32 or bfloat16, as ``delta`` and ``weight``) as a new tensor."""
        rows, dim = h.shape
        if delta is not None:
            delta = delta.contiguous()
        out = torch.empty_like(h)
        self.lib.berth_add_rms_norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                    out.data_ptr(), rows, dim, eps, torch.get_num_threads(), DTYPES.index(h.dtype))
        return out

    def rotary_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  heads: int, kv_heads: int, head_dim: int, k_cache: torch.Tensor | None,
                  v_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None,
                  keys: torch.Tensor | None = None) -> torch.Tensor:
        """From ``qkv [tokens, (heads + 2 kv_heads) * head_dim]`` (rows contiguous): the queries rotated by
        the tables' rows ``positions`` as ``[tokens, heads, head_dim]``; the keys rotated and the values
        written into ``k_cache``/``v_cache`` ``[blocks, block_size, kv_heads, head_dim]`` at ``slot_mapping``;
        with ``keys`` (``[tokens, kv_heads, head_dim]``, contiguous), the rotated keys there too. Every
        tensor of ``qkv``'s dtype, float32 or bfloat16.
        Without caches (None: ones ``writes_cache`` refuses, which the caller writes) only ``keys``."""
        if k_cache is None and keys is None:
            raise ValueError("rotary_kv without a cache needs a keys tensor to put the rotated keys in")
        tokens = qkv.shape[0]
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
        self.lib.berth_rotary_kv(qkv.data_ptr(), tokens, qkv.stride(0), positions.data_ptr(), cos.data_ptr(),
                                 sin.data_ptr(), cos.shape[-1], heads, kv_heads, head_dim, q.data_ptr(),
                                 *(None if x is None else x.data_ptr() for x in (keys, k_cache, v_cache, slot_mapping)),
                                 torch.get_num_threads(), DTYPES.index(qkv.dtype))
        return q

    def takes(self, activations: torch.Tensor) -> bool:
        """Whether these are activations the kernel computes on: float32 or bfloat16 on the CPU."""
        return activations.dtype in DTYPES and activations.device.type == "cpu"

    def writes_cache(self, dtype: torch.dtype, *caches: torch.Tensor) -> bool:
        """Whether ``rotary_kv`` writes these caches itself from activations of ``dtype``: caches of that
        dtype, contiguous (an int8 cache is written by the attention backend's ``write_kv``, from the keys
        ``rotary_kv`` leaves)."""
        return all(c.dtype == dtype and c.device.type == "cpu" and c.is_contiguous() for c in caches)


@functools.cache
def load(folder: Path, isa: str | None = None) -> ElementwiseKernel | None:
    """The kernel, built into ``folder`` on first use, or None where it cannot be built (logged). ``isa``:
    as ``kernels.c_build.isa_flags`` ("avx2": the cache's streaming stores of an AVX2-only CPU)."""
    lib = build(SOURCE, folder, [*FLAGS, *isa_flags(isa)],
                without="the decoder's norms and rotary take PyTorch's operations")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.berth_add_rms_norm.restype = None
    lib.berth_add_rms_norm.argtypes = [ptr] * 4 + [i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.berth_rotary_kv.restype = None
    lib.berth_rotary_kv.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr,
                                    ctypes.c_int, ctypes.c_int]
    return ElementwiseKernel(lib)
