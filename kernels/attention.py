"""The one attention interface the model calls; it picks the PyTorch path or the Triton kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import reference


@dataclass(frozen=True)
class AttentionOps:
    name: str
    write_kv: Callable
    decode: Callable
    prefill: Callable
    # whether ``prefill`` reads a chunk's own keys and values from the step's tensors (the reference's
    # ``key``/``value``), so that the model hands them over; the Triton and C kernels read them from the cache
    prefill_reads_own_rows: bool = True


TORCH_OPS = AttentionOps("torch", reference.write_kv, reference.paged_decode_attention,
                         reference.paged_prefill_attention)


def select_ops(backend: str, device: torch.device | str, build_dir: Path | None = None) -> AttentionOps:
    """``auto`` takes Triton on CUDA and, on the CPU, the C kernels (decode and prefill) where a compiler builds them
    (into ``build_dir``; without one, the PyTorch path); ``torch`` forces the pure PyTorch path,
    ``cpu`` the C kernel, ``triton`` the Triton kernels. Every path reads the caches of
    ``kernels.kv_quant`` as their dtype says, but for the C kernel, which hands fp8 caches to the
    PyTorch path (``Settings.check_kv_cache_dtype`` keeps fp8 off the CPU)."""
    on_cuda = torch.device(device).type == "cuda"
    if backend == "cpu" or (backend == "auto" and not on_cuda):
        from kernels import cpu_attention

        kernel = cpu_attention.load(Path(build_dir)) if build_dir is not None else None
        if kernel is not None:
            # the C prefill reads the chunks' own rows from the cache (written before it runs), so the
            # model neither hands them over nor, for an int8 cache, rounds them through quantize/dequantize
            return AttentionOps("cpu", kernel.write_kv, kernel.paged_decode_attention,
                                kernel.paged_prefill_attention, prefill_reads_own_rows=False)
        if backend == "cpu":
            raise RuntimeError("attention_backend=cpu needs a C compiler with OpenMP (cc or $CC) to build "
                               "kernels/cpu_decode.c, and a folder to build it in; install gcc or use "
                               "attention_backend=torch")
        return TORCH_OPS
    if backend == "torch":
        return TORCH_OPS
    try:
        from kernels import triton_attention
    except ImportError as exc:  # triton missing
        if backend == "triton":
            raise RuntimeError(f"attention_backend=triton needs the triton package ({exc}); "
                               "install it with `pip install 'berth[gpu]'` or use attention_backend=torch") from exc
        return TORCH_OPS
    return AttentionOps("triton", triton_attention.write_kv, triton_attention.paged_decode_attention,
                        triton_attention.paged_prefill_attention, prefill_reads_own_rows=False)
