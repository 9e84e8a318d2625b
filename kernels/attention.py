"""The one attention interface the model calls; it picks the PyTorch path or the Triton kernels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kernels import reference


@dataclass(frozen=True)
class AttentionOps:
    name: str
    write_kv: Callable
    decode: Callable
    prefill: Callable


TORCH_OPS = AttentionOps("torch", reference.write_kv, reference.paged_decode_attention,
                         reference.paged_prefill_attention)


def select_ops(backend: str, device: torch.device | str, build_dir: Path | None = None,
               kv_cache_dtype: str = "auto") -> AttentionOps:
    """``auto`` takes Triton on CUDA and, on the CPU, the C decode kernel where a compiler builds it
    (into ``build_dir``; without one, the PyTorch path); ``torch`` forces the pure PyTorch path,
    ``cpu`` the C kernel, ``triton`` the Triton kernels. An int8 KV cache (``kv_cache_dtype`` "int8")
    runs on the C kernel and the PyTorch path; the Triton kernels do not read it yet."""
    on_cuda = torch.device(device).type == "cuda"
    if kv_cache_dtype == "int8" and on_cuda:
        if backend == "triton":
            raise RuntimeError("kv_cache_dtype=int8 is not read by the Triton kernels yet: use kv_cache_dtype=auto "
                               "on CUDA, or attention_backend=torch (slower)")
        if backend == "auto":
            backend = "torch"
    if backend == "cpu" or (backend == "auto" and not on_cuda):
        from kernels import cpu_attention

        kernel = cpu_attention.load(Path(build_dir)) if build_dir is not None else None
        if kernel is not None:
            return AttentionOps("cpu", reference.write_kv, kernel.paged_decode_attention,
                                reference.paged_prefill_attention)
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
                        triton_attention.paged_prefill_attention)
