"""The model's matrix multiplies: ``x @ weight.T``, with the weight prepared once at load.

On the CPU each weight is reordered once into oneDNN's blocked layout and multiplied through
oneDNN. PyTorch's float32 ``F.linear`` calls MKL's sgemm, which runs AVX2 code on AMD CPUs (MKL's
own pre-packed weights were no faster): on the 2-core AMD EPYC machines berth is benchmarked on, the
reordered oneDNN multiply ran 2.2-3.4 times as fast in float32 at this model's shapes, with float32
accuracy unchanged (float32 accumulation either way), and 1.3-1.9 times as fast in bfloat16, where
PyTorch already uses oneDNN but reorders the weight on every call. Where PyTorch was built without
oneDNN, where its oneDNN has no kernel for this CPU and dtype, or on CUDA, ``F.linear`` it is.

The choice is made once per device and dtype, on a probe, and logged once with its reason (not once
per layer). bfloat16 on a CPU without bfloat16 instructions (AVX-512 BF16 or AMX) is emulated and
slower than float32: that is said once too, with the setting to change.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)
Linear = Callable[[torch.Tensor], torch.Tensor]
_BATCH_HINT = 256  # rows oneDNN tunes the layout for; measured the same from 64 to 2048
_NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def _packed(weight: torch.Tensor):
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT)


def _onednn_linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


@functools.cache
def multiply_path(device_type: str, dtype: torch.dtype) -> str:
    """"onednn" or "torch": the multiply every linear layer of this device and dtype uses, chosen
    once (logged with the reason)."""
    if device_type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "torch"
    if dtype == torch.bfloat16 and not cpu_flags() & _NATIVE_BF16_FLAGS:
        log.warning("this CPU has no bfloat16 instructions (%s): bfloat16 multiplies are emulated and slower "
                    "than float32; set BERTH_DTYPE=float32 (--dtype float32)", " or ".join(sorted(_NATIVE_BF16_FLAGS)))
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        log.info("linear layers (%s): F.linear, as this PyTorch has no oneDNN linear", dtype)
        return "torch"
    try:
        probe = torch.ones(8, 64, dtype=dtype)
        _onednn_linear(probe[:1], _packed(probe), None)
    except RuntimeError as exc:  # a build whose oneDNN lacks the kernel for this CPU or dtype
        log.warning("linear layers (%s): oneDNN linear unavailable (%s), using F.linear", dtype, exc)
        return "torch"
    log.info("linear layers (%s): oneDNN with weights reordered once at load", dtype)
    return "onednn"


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A function ``x [rows, in] -> [rows, out]`` for ``weight [out, in]``, plus ``bias [out]`` if given."""
    if multiply_path(weight.device.type, weight.dtype) == "onednn":
        packed = _packed(weight)
        return lambda x: _onednn_linear(x, packed, bias)
    return lambda x: F.linear(x, weight, bias)
