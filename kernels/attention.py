"""The one attention interface the model calls; it picks the PyTorch path or the Triton kernels."""

from __future__ import annotations

from dataclasses import dataclass
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


def select_ops(backend: str, device: torch.device | str) -> AttentionOps:
    """``auto`` takes Triton on CUDA and PyTorch elsewhere; ``torch``/``triton`` force one."""
    on_cuda = torch.device(device).type == "cuda"
    if backend == "torch" or (backend == "auto" and not on_cuda):
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
