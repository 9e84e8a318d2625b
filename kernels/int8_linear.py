"""The weight-only int8 linear for the CPU (``int8_linear.c``), built with the system C compiler on first use.

PyTorch's own weight-only int8 multiply (``aten._weight_int8pack_mm``) is vectorised for AVX-512 only;
on an AVX2 CPU it runs scalar loops, tens of times slower than float32. Its dynamic-quantization
multiplies (FBGEMM, oneDNN's qlinear) quantize the activations too, a scale per batch, which costs the
default model most of its accuracy (benchmarks/HISTORY.md). This kernel reads the int8 weights and
widens them in registers, with float32 activations and sums. It is built like the decode-attention
kernel (``kernels.cpu_attention``): once per source, compiler and CPU, ``-march=native``, into the
folder its caller names; ``load(folder)`` gives None where no compiler works.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.c_build import build

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("int8_linear.c")


@dataclass(frozen=True)
class Int8Kernel:
    lib: ctypes.CDLL
    isa: str  # "avx2" or "none" (plain C)

    def linear(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` float32 times ``(q [N, K] int8 * scales [N, 1]).T``, plus ``bias [N]``: ``[M, N]`` float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != q.shape[1]:
            raise ValueError(f"int8 linear takes float32 [rows, {q.shape[1]}], not {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
        self.lib.berth_int8_linear(x.data_ptr(), q.data_ptr(), scales.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(),
                                   x.shape[0], q.shape[0], q.shape[1], torch.get_num_threads())
        return out


@functools.cache
def load(folder: Path) -> Int8Kernel | None:
    """The kernel, built into ``folder`` on first use, or None where it cannot be built (logged)."""
    lib = build(SOURCE, folder, without="int8 linears take PyTorch's path")
    if lib is None:
        return None
    lib.berth_int8_linear.restype = None
    lib.berth_int8_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.berth_int8_isa.restype = ctypes.c_char_p
    return Int8Kernel(lib, lib.berth_int8_isa().decode())
