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

``--weight-dtype int8`` (``make_int8_linear``) multiplies by the weights quantized to int8 per output
row, symmetric (``scale = max|row| / 127``), from the float weights the loader gives (for a GGUF file,
its tensors dequantised, Q8_0 ones included: their blocks are not used as they lie). The activations
stay float: quantizing them too, as PyTorch's FBGEMM and oneDNN int8 multiplies do with a scale per
batch, cost the default model most of its accuracy. On a CPU, decode-sized batches go through berth's
C kernel (``kernels/int8_linear.c``), which streams a quarter of float32's bytes, and large ones through
oneDNN with the same int8 weights widened once (``FLOAT_FROM_ROWS``); the choice and its reason are
logged once, as for float. benchmarks/HISTORY.md has what each multiply costs per batch size and what
int8 does to perplexity and greedy output.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import int8_linear as int8_kernel
from kernels.cpu_features import cpu_flags
from worker.config import cache_dir

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



def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` as int8 values and a float32 scale per output row, symmetric:
    ``scale = max|row| / 127``, ``q = round(row / scale)``, so ``q * scale`` is within ``scale / 2`` of each weight."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()



FLOAT_FROM_ROWS: int | None = 64
"""With the int8 kernel, batches of this many rows or more multiply in float32 through oneDNN by the same
int8 weights widened once at load; smaller ones (decode) stream the int8 weights. The kernel wins below
about 64 rows and loses above (benchmarks/HISTORY.md), so both forms are kept: five bytes a weight, a quarter
more than float32 alone. None keeps the int8 form only (a quarter of float32's bytes, slower prefill)."""


@functools.cache
def int8_multiply_path(device_type: str, dtype: torch.dtype) -> str:
    """"kernel", "int8pack" or "dequantize": the multiply every int8 linear of this device and dtype uses,
    chosen once (logged with the reason)."""
    if device_type == "cpu" and dtype == torch.float32:
        kernel = int8_kernel.load(cache_dir("kernels"))
        if kernel is not None:
            log.info("int8 linear layers: berth's weight-only int8 kernel (%s path), float32 activations and sums",
                     kernel.isa)
            return "kernel"
    if device_type != "cpu" or cpu_flags() & {"avx512f"}:  # PyTorch's kernel is vectorised for AVX-512 only
        try:
            q, scales = quantize_per_channel(torch.ones(8, 64, device=device_type))
            torch.ops.aten._weight_int8pack_mm(torch.ones(2, 64, dtype=dtype, device=device_type), q, scales.to(dtype))
        except (RuntimeError, NotImplementedError) as exc:
            log.info("int8 linear layers: no _weight_int8pack_mm for %s on %s (%s)", dtype, device_type,
                     str(exc).splitlines()[0])
        else:
            log.info("int8 linear layers (%s on %s): PyTorch's weight-only _weight_int8pack_mm", dtype, device_type)
            return "int8pack"
    log.warning("int8 linear layers (%s on %s): the weights are widened back to %s at every multiply, slower "
                "than --weight-dtype auto", dtype, device_type, str(dtype).removeprefix("torch."))
    return "dequantize"


def make_int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """As ``make_linear``, but multiplying by ``weight`` quantized to int8 per output row (not bit-exact);
    with the int8 kernel, batches of ``FLOAT_FROM_ROWS`` rows or more use those weights widened to float32."""
    path = int8_multiply_path(weight.device.type, weight.dtype)
    q, scales = quantize_per_channel(weight)
    if path == "kernel":
        kernel = int8_kernel.load(cache_dir("kernels"))
        bias32 = None if bias is None else bias.float().contiguous()
        float_from = FLOAT_FROM_ROWS
        if float_from is None:
            return lambda x: kernel.linear(x, q, scales, bias32)
        wide = make_linear(q.float() * scales[:, None], bias32)  # the same int8 weights, widened once
        return lambda x: wide(x) if x.shape[0] >= float_from else kernel.linear(x, q, scales, bias32)
    scales = scales.to(weight.dtype)
    if path == "int8pack":
        if bias is None:
            return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales) + bias
    return lambda x: F.linear(x, q.to(x.dtype)) * scales + (0 if bias is None else bias)
