"""The model's matrix multiplies: ``x @ weight.T``, with the weight prepared once at load.

On the CPU each weight is reordered once into oneDNN's blocked layout and multiplied through
oneDNN. PyTorch's float32 ``F.linear`` calls MKL's sgemm, which runs AVX2 code on AMD CPUs (MKL's
own pre-packed weights were no faster): on the 2-core AMD EPYC machines berth is benchmarked on, the
reordered oneDNN multiply ran 2.2-3.4 times as fast in float32 at this model's shapes, with float32
accuracy unchanged (float32 accumulation either way), and 1.3-1.9 times as fast in bfloat16, where
PyTorch already uses oneDNN but reorders the weight on every call. Where PyTorch was built without
oneDNN, or on CUDA, ``F.linear`` it is.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
Linear = Callable[[torch.Tensor], torch.Tensor]
_BATCH_HINT = 256  # rows oneDNN tunes the layout for; measured the same from 64 to 2048


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A function ``x [rows, in] -> [rows, out]`` for ``weight [out, in]``, plus ``bias [out]`` if given."""
    if _onednn_usable(weight):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT)
            probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [None], "")
        except RuntimeError as exc:  # a build whose oneDNN lacks the kernel for this CPU or dtype
            log.warning("oneDNN linear unavailable (%s): using F.linear", exc)
        else:
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    return lambda x: F.linear(x, weight, bias)
