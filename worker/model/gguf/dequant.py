"""GGUF block quantisations dequantised with torch, equal bit for bit to ``gguf.quants``.

Why not ``gguf.quants`` (numpy): it builds one full-size temporary per step, on one core: 0.3-0.7 s
for the default model on the 2-core machine, against a start-up goal of 3 s to the first token.
Here each type is a few torch operations per chunk of a tensor (torch's thread pool, vectorised
kernels), the packed bits unpacked in 16- or 32-bit words (a block's bytes viewed as
``int16``/``int32``), two or four nibbles or bits per lane, so the integer work touches a
fraction of the values' bytes.

Why the results are exact: every value is ``scale * q``, with ``+ m`` or ``- dmin * m`` in the
types that have an offset, where ``scale`` is a float16 (11 significant bits), in the K-quants
times a sub-block scale, and ``q`` a small integer. The significant bits of a product are at most
the sum of its factors': 11 + 7 + 5 = 23 for Q6_K (int8 scale, 6-bit signed value), fewer for the
others (Q5_K 11 + 6 + 5, Q8_0 11 + 7), so float32 holds every product exactly, in any order of
multiplication and whether or not the compiler fuses it with the addition into an FMA; the one
rounding is the addition of the offset, the same single rounding ``gguf.quants`` does. The
integer steps (masks, shifts, the zero point subtracted in wrapping ``uint8``) are exact by
construction, and float16 -> float32 is exact, subnormals included. Inf and NaN scales give what
numpy gives, the operations being the same ones (``inf * 0`` is NaN in both). Signed zeros match
too: the zero point is subtracted before the scale is applied, as numpy does (``d * q - 8 * d``
would give +0 where numpy gives -0, and NaN for an infinite ``d`` where numpy gives an infinity).

Other dtypes: each chunk is computed in float32 and converted once (``copy_``), so a bfloat16
weight is the float32 value rounded once, as ``reference.to(bfloat16)`` is.

Byte order: GGUF files and ``gguf.quants`` are little-endian; on a big-endian host
``dequantise`` declines (returns None) and the caller keeps the numpy path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

# A chunk of this many values is computed at a time: float32 output is written in place (no
# temporary bigger than the chunk's packed integers), other dtypes go through one float32 scratch
# chunk (2 MiB) that stays in cache. Whole tensors were slowest (most of all in bfloat16, with a
# full-size float32 temporary); much smaller chunks pay per-operation overhead (benchmarks/HISTORY.md).
CHUNK_VALUES = 1 << 19
_M4_32, _M4_16 = 0x0F0F0F0F, 0x0F0F
_BIT_32 = 0x01010101


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 [n, 1] (exact)."""
    return blocks[:, at:at + 2].view(torch.float16).float()


def _nibbles(words: torch.Tensor, out: torch.Tensor, mask: int) -> torch.Tensor:
    """Low nibbles of ``words`` [..., k] into ``out[..., :k]``, high nibbles into ``out[..., k:]``
    (both word-wise, so byte i of a word stays byte i: gguf's order)."""
    k = words.shape[-1]
    torch.bitwise_and(words, mask, out=out[..., :k])
    torch.bitwise_right_shift(words, 4, out=out[..., k:])
    out[..., k:].bitwise_and_(mask)
    return out


def _planes(words: torch.Tensor, mask: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high nibbles of every byte of ``words`` (whole blocks, scales included), as uint8
    tensors shaped like the blocks' bytes. Operations over whole contiguous blocks run several
    times faster than over the packed bytes' slice (short strided rows); the float conversion
    then reads the slice."""
    lo = torch.bitwise_and(words, mask)
    hi = torch.bitwise_right_shift(words, 4).bitwise_and_(mask)
    n = words.shape[0]
    return lo.view(torch.uint8).view(n, -1), hi.view(torch.uint8).view(n, -1)


def _high_bits(words: torch.Tensor, shifts: range, mask: int, out: torch.Tensor) -> torch.Tensor:
    """``((words >> shift) << 4) & (mask << 4)`` for each shift: a new axis before the last one.
    One scalar shift per row of ``out`` (a tensor of shifts, broadcast, is several times slower)."""
    for i, shift in enumerate(shifts):
        if shift <= 4:
            torch.bitwise_left_shift(words, 4 - shift, out=out[..., i, :])
        else:
            torch.bitwise_right_shift(words, shift - 4, out=out[..., i, :])
    return out.bitwise_and_(mask << 4)


def _k_scales(scales: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins (12 bytes, gguf's ``Q4_K.get_scale_min``), times
    ``d`` and ``dmin``: [n, 8, 1] each."""
    s = scales.view(-1, 3, 4)
    lo_d, lo_m, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo_d & 0x3F, (hi & 0x0F) | ((lo_d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return (d * sc).unsqueeze(-1), (dmin * mn).unsqueeze(-1)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    lo, hi = _planes(b.view(torch.int16), _M4_16)
    out[:, :16].copy_(lo.sub_(8).view(torch.int8)[:, 2:])  # q - 8 wraps in uint8: int8's two's complement
    out[:, 16:].copy_(hi.sub_(8).view(torch.int8)[:, 2:])
    out.mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    lo, hi = _planes(b.view(torch.int32), _M4_32)
    out[:, :16].copy_(lo[:, 4:])
    out[:, 16:].copy_(hi[:, 4:])
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_bits(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0/Q5_1's fifth bits: bit j of the 32-bit word at byte ``at`` is value j's, as 16 or 0
    ([n, 32] uint8); the bytes themselves, as the word may be unaligned."""
    bits = torch.empty(b.shape[0], 4, 8, dtype=torch.uint8)
    torch.bitwise_right_shift(b[:, at:at + 4].unsqueeze(-1), _SHIFTS_8_U8, out=bits)
    return bits.bitwise_and_(1).bitwise_left_shift_(4).view(-1, 32)


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 6:].view(torch.int16), torch.empty(b.shape[0], 16, dtype=torch.int16), _M4_16)
    q = q.view(torch.uint8).bitwise_or_(_q5_bits(b, 2))
    out.copy_(q.sub_(16).view(torch.int8))
    out.mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b.view(torch.int32)[:, 2:], torch.empty(b.shape[0], 8, dtype=torch.int32), _M4_32)
    out.copy_(q.view(torch.uint8).bitwise_or_(_q5_bits(b, 4)))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scale, offset = _k_scales(b[:, 4:16], _f16(b, 0), _f16(b, 2))
    # four 32-byte groups: low nibbles are sub-block 2g, high nibbles 2g + 1
    lo, hi = _planes(b.view(torch.int32), _M4_32)
    groups = out.view(n, 4, 2, 32)
    groups[:, :, 0].copy_(lo[:, 16:].view(n, 4, 32))
    groups[:, :, 1].copy_(hi[:, 16:].view(n, 4, 32))
    out.view(n, 8, 32).mul_(scale).sub_(offset)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scale, offset = _k_scales(b[:, 4:16], _f16(b, 0), _f16(b, 2))
    w = b.view(torch.int32)
    q = _nibbles(w[:, 12:].view(n, 4, 8), torch.empty(n, 4, 16, dtype=torch.int32), _M4_32).view(n, 8, 8)
    # bit s of qh byte j is the fifth bit of sub-block s's value j
    q.bitwise_or_(_high_bits(w[:, 4:12], range(8), _BIT_32, torch.empty(n, 8, 8, dtype=torch.int32)))
    out = out.view(n, 8, 32)
    out.copy_(q.view(torch.uint8).view(n, 8, 32))
    out.mul_(scale).sub_(offset)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    w = b.view(torch.int16)  # 210-byte blocks: 2-byte words at most
    # two 64-byte groups of low bits (values 0-63 low nibbles, 64-127 high), each with a
    # 32-byte group of high bits holding 2 bits for 4 rows of 32 values
    q = _nibbles(w[:, :64].view(n, 2, 32), torch.empty(n, 2, 64, dtype=torch.int16), _M4_16).view(n, 2, 4, 16)
    q.bitwise_or_(_high_bits(w[:, 64:96].view(n, 2, 16), range(0, 8, 2), 0x0303,
                             torch.empty(n, 2, 4, 16, dtype=torch.int16)))
    q = q.view(torch.uint8).view(n, 16, 16).sub_(32)
    scale = _f16(b, 208) * b[:, 192:208].view(torch.int8)
    out = out.view(n, 16, 16)
    out.copy_(q.view(torch.int8))
    out.mul_(scale.unsqueeze(-1))


_SHIFTS_8_U8 = torch.arange(8, dtype=torch.uint8)


@dataclass(frozen=True)
class BlockType:
    block_size: int  # values per block
    type_size: int  # bytes per block
    fill: Callable[[torch.Tensor, torch.Tensor], None]  # (uint8 [n, type_size], float32 [n, block_size])


BLOCK_TYPES = {
    "Q8_0": BlockType(32, 34, _q8_0),
    "Q4_0": BlockType(32, 18, _q4_0),
    "Q4_1": BlockType(32, 20, _q4_1),
    "Q5_0": BlockType(32, 22, _q5_0),
    "Q5_1": BlockType(32, 24, _q5_1),
    "Q4_K": BlockType(256, 144, _q4_k),
    "Q5_K": BlockType(256, 176, _q5_k),
    "Q6_K": BlockType(256, 210, _q6_k),
}


def dequantise(type_name: str, blocks: torch.Tensor, dtype: torch.dtype,
               chunk_values: int = CHUNK_VALUES) -> torch.Tensor | None:
    """``blocks`` (uint8 [n, type_size], e.g. a view of the file's memory map) dequantised to
    [n, block_size] in ``dtype``; None where this module has no torch version of the type (or the
    host is big-endian): then use ``gguf.quants``."""
    kind = BLOCK_TYPES.get(type_name)
    if kind is None or sys.byteorder != "little":
        return None
    if blocks.shape[1:] != (kind.type_size,):
        raise ValueError(f"{type_name} blocks are {kind.type_size} bytes, not {tuple(blocks.shape[1:])}")
    if blocks.storage_offset() % 4 or blocks.data_ptr() % 4:
        blocks = blocks.clone()  # word views need aligned words (GGUF aligns tensors to 32 bytes)
    n = blocks.shape[0]
    out = torch.empty(n, kind.block_size, dtype=dtype)
    step = max(1, chunk_values // kind.block_size)
    scratch = None if dtype == torch.float32 else torch.empty(min(step, n), kind.block_size)
    for start in range(0, n, step):
        stop = min(start + step, n)
        if scratch is None:
            kind.fill(blocks[start:stop], out[start:stop])
        else:
            kind.fill(blocks[start:stop], scratch[:stop - start])
            out[start:stop].copy_(scratch[:stop - start])
    return out
