"""The quantized KV caches' row format: each (token, kv head) row of ``head_dim`` values is stored as
``head_dim`` one-byte values and their float32 scale, ``head_dim + 4`` bytes in one row.

A value is ``stored * scale`` with ``scale = max|row| / max_value`` (symmetric, per token and kv
head, as llama.cpp's q8_0 keeps a scale per 32 values and vLLM's int8/fp8 caches a scale per head
or token). Two formats share the scheme, named as the ``kv_cache_dtype`` setting names them:

- ``int8``: int8 values (``max_value`` 127, rounded half to even), rows held in a ``uint8`` tensor;
- ``fp8_e4m3``: ``torch.float8_e4m3fn`` values (``max_value`` 448, the format's largest finite
  value, rounded to nearest even), rows held in a ``float8_e4m3fn`` tensor whose last 4 elements
  are the scale's bytes. GPUs of compute capability 8.9 and newer convert it in hardware.

The cache tensor's dtype says which format its rows are in (``row_format``), so every kernel reads
a cache without being told. The scale sits in the row itself, so a block is still one contiguous
slab of bytes: copies, swap, checkpoints, restore and the prefix store move quantized blocks as
they are, with no second tensor to keep in step. A float32 row of the default model (head_dim 64)
takes 256 bytes, bfloat16 128, either format 68: 3.8 and 1.9 times the tokens in the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4
_TINY = 1e-30  # the scale of an all-zero row: its values stay 0


@dataclass(frozen=True)
class RowFormat:
    name: str  # the kv_cache_dtype setting
    value_dtype: torch.dtype  # what each of the head_dim bytes holds
    storage_dtype: torch.dtype  # the cache tensor's dtype: rows of head_dim + 4 elements of one byte
    max_value: float  # max|row| is stored as this


FORMATS = {
    "int8": RowFormat("int8", torch.int8, torch.uint8, 127.0),
    "fp8_e4m3": RowFormat("fp8_e4m3", torch.float8_e4m3fn, torch.float8_e4m3fn, 448.0),
}
_BY_STORAGE = {f.storage_dtype: f for f in FORMATS.values()}


def row_format(cache: torch.Tensor) -> RowFormat | None:
    """The format of a cache's rows, from its dtype; None for a cache of plain values."""
    return _BY_STORAGE.get(cache.dtype)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _BY_STORAGE


def row_bytes(head_dim: int) -> int:
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """``[..., head_dim]`` floats -> ``[..., head_dim + 4]`` packed rows with their scales, in
    ``FORMATS[fmt].storage_dtype``."""
    f = FORMATS[fmt]
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / f.max_value).clamp(min=_TINY)
    scaled = (x / scale).clamp_(-f.max_value, f.max_value)
    values = torch.round(scaled).to(torch.int8) if f.value_dtype == torch.int8 else scaled.to(f.value_dtype)
    rows = torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
    return rows.view(f.storage_dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim + 4]`` packed rows (their format from their dtype) -> ``[..., head_dim]``
    values in ``dtype``."""
    f = row_format(rows)
    assert f is not None, f"{rows.dtype} is not a quantized cache's dtype"
    raw = rows.view(torch.uint8)  # the CPU has few float8 kernels: slice and view bytes
    d = raw.shape[-1] - SCALE_BYTES
    values = raw[..., :d].view(f.value_dtype).float()
    scale = raw[..., d:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)


def as_values(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as values in ``dtype``, quantized or not."""
    return dequantize(cache_rows, dtype) if is_quantized(cache_rows) else cache_rows.to(dtype)
